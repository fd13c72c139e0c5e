"""Encoding speed of the tokenizer's two backends (shards/tokenizer.py): `python -m bench.tokenizer`
(`make bench-tokenizer`).

Trains two tokenizers of `--vocab-size` pieces on the same text, People's Daily (the demo corpus's
Chinese) and English prose and code (Python's own library sources): a SentencePiece BPE with the
converter's settings (convert/tokens/tokenizer.py) and a Hugging Face byte-level BPE with the
`tokenizers` library (scenarios/byte_bpe.py). Then encodes held-out text, each document once, in
batches of about `convert.run.worker.SUB_BATCH_CHARS` characters as a conversion worker calls it,
and prints per core (CPU seconds of this one thread, which a loaded machine changes little), for
Chinese and for English/code apart:
  * SentencePiece's batched encode, one thread (what a worker runs with a .model);
  * the tokenizers library's batched encode with its threads off, `encode_batch_fast` (what a
    worker runs with a tokenizer.json), its batched encode with offsets (`encode_batch`), and one
    `encode` call per document: why the worker takes the first;
  * tokens/s and characters/s of each, the ratio to SentencePiece's, and tokens per character
    (the same text cut into other pieces: characters/s compares the work done).
Then the library's own threads over every core, wall-clock, for reference; and a whole conversion
of the held-out text (`convert_corpus`, one worker) with each tokenizer: CPU seconds of all its
processes per million tokens, the share of them the encode itself takes. Best of `--rounds`.
Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

Batches = list[list[str]]


def batches_of(texts: list[str], chars: int) -> Batches:
    """Consecutive runs of `texts` of about `chars` characters each."""
    out, run, size = [], [], 0
    for text in texts:
        run.append(text)
        size += len(text)
        if size >= chars:
            out.append(run)
            run, size = [], 0
    return out + ([run] if run else [])


def timed(encode: Callable[[list[str]], list], batches: Batches, rounds: int) -> tuple[float, float, int]:
    """(best CPU seconds, best wall seconds, tokens) of encoding every batch, over `rounds` rounds."""
    best_cpu = best_wall = float("inf")
    tokens = 0
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        tokens = sum(len(ids) for batch in batches for ids in encode(batch))
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return best_cpu, best_wall, tokens


def corpus(code_modules: int) -> tuple[list[str], dict[str, list[str]]]:
    """(training texts, held-out texts by language): the first two thirds of each for training."""
    from convert.demo.corpus import peoples_daily_documents
    from scenarios.byte_bpe import english_and_code

    chinese = peoples_daily_documents()
    code = [
        block for text in english_and_code(code_modules) for block in text.split("\n\n\n") if block.strip()
    ]
    cut_zh, cut_code = len(chinese) * 2 // 3, len(code) * 2 // 3
    return chinese[:cut_zh] + code[:cut_code], {"Chinese": chinese[cut_zh:], "English/code": code[cut_code:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=16000, help="pieces of both tokenizers")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many rounds")
    parser.add_argument(
        "--code-modules", type=int, default=120, help="Python library modules as English/code"
    )
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer as LibraryTokenizer

    from convert.run.worker import SUB_BATCH_CHARS
    from convert.tokens.tokenizer import train_tokenizer
    from scenarios.byte_bpe import train_byte_level_bpe
    from shards.tokenizer import Tokenizer

    train_texts, held_out = corpus(args.code_modules)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        sp_path = str(Path(tmp) / "sp.model")
        train_tokenizer(train_texts, vocab_size=args.vocab_size, out=sp_path, character_coverage=0.9995)
        sp_s = time.perf_counter() - start
        start = time.perf_counter()
        hf_folder = train_byte_level_bpe(Path(tmp) / "hf", train_texts, args.vocab_size)
        hf_s = time.perf_counter() - start
        sp, hf = Tokenizer(sp_path), Tokenizer(hf_folder)
        library = LibraryTokenizer.from_file(str(hf_folder / "tokenizer.json"))
        conversions = {
            name: conversion_cost(path, held_out, Path(tmp) / name)
            for name, path in (("SentencePiece", sp_path), ("tokenizers", str(hf_folder)))
        }
    print(
        f"tokenizers of {args.vocab_size} pieces trained on {sum(map(len, train_texts)):,} characters "
        f"(SentencePiece {sp_s:.1f} s, tokenizers {hf_s:.1f} s); batches of ~{SUB_BATCH_CHARS:,} characters, "
        f"best of {args.rounds}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    one_thread = {
        "SentencePiece, batched": lambda b: sp.encode_batch(b, add_eos=True, num_threads=1),
        "tokenizers, batched (encode_batch_fast)": lambda b: hf.encode_batch(b, add_eos=True, num_threads=1),
        "tokenizers, batched with offsets": lambda b: _threads_off(library.encode_batch, b),
        "tokenizers, one call per document": lambda b: [hf.encode(t) for t in b],
    }
    for language, texts in held_out.items():
        batches = batches_of(texts, SUB_BATCH_CHARS)
        chars = sum(map(len, texts))
        print(
            f"\n{language}: {len(texts):,} documents, {chars:,} characters; per core (CPU time, one thread)"
        )
        print(f"  {'':42} {'tokens/s':>11} {'chars/s':>11} {'vs SP':>6} {'tok/char':>8}")
        reference = None
        for name, encode in one_thread.items():
            cpu, _, tokens = timed(encode, batches, args.rounds)
            reference = reference or chars / cpu
            print(
                f"  {name:42} {tokens / cpu:11,.0f} {chars / cpu:11,.0f} {chars / cpu / reference:6.2f} "
                f"{tokens / chars:8.3f}"
            )
        cpu, wall, tokens = timed(lambda b: hf.encode_batch(b, add_eos=True), batches, args.rounds)
        print(
            f"  tokenizers, its own threads: {tokens / wall:,.0f} tokens/s wall-clock "
            f"({cpu / wall:.1f} cores busy), {chars / wall / reference:.2f} x one SentencePiece core"
        )
    print("\nwhole conversion of the held-out text, 1 worker (CPU seconds of every process)")
    for name, (cpu, tokens) in conversions.items():
        print(
            f"  {name:14} {cpu / tokens * 1e6:6.2f} CPU s per million tokens ({tokens:,} tokens, {cpu:.1f} s)"
        )
    return 0


def conversion_cost(tokenizer: str, held_out: dict[str, list[str]], root: Path) -> tuple[float, int]:
    """(CPU seconds of this process and its workers, tokens written) of converting the held-out
    documents with `tokenizer`, one worker."""
    import json
    import resource

    from convert.run.jobs import convert_corpus
    from convert.run.options import ShardOptions

    root.mkdir()
    corpus = root / "corpus.jsonl"
    texts = [t for group in held_out.values() for t in group]
    corpus.write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8"
    )
    options = ShardOptions(seq_len=512, val_fraction=0.0, workers=1, progress=False)

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    start = cpu()
    with contextlib.redirect_stdout(io.StringIO()):  # its summary lines
        convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(root / "out"), options=options)
    used = cpu() - start
    meta = json.loads((root / "out" / "train" / "meta.json").read_text())
    return used, meta["num_tokens"]


def _threads_off(encode_batch: Callable, batch: list[str]) -> list[list[int]]:
    """The library's `encode_batch` (with offsets) on this thread only, as a worker would call it."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return [e.ids for e in encode_batch(batch, add_special_tokens=False)]
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


if __name__ == "__main__":
    raise SystemExit(main())
