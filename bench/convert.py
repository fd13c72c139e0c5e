"""Conversion benchmark: `python -m bench.convert` (or `make bench-convert`).

Converts a few MB of real Chinese text (the demo corpus) and prints the end-to-end tokens/s
per worker, the raw `SentencePieceProcessor.encode` tokens/s on the same text (the limit), their
ratio (target >= 0.8), the speed-up from 1 to 2 workers (target >= 1.6 on 2 cores) and the peak
memory of the process and its workers. Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def raw_encode_rate(corpus: Path, tokenizer: str) -> tuple[float, int]:
    """Tokens/s of one-thread batched encode over the cleaned documents (what a worker can reach)."""
    import sentencepiece as spm

    from convert.cleaning import Cleaner

    cleaner = Cleaner()
    lines = corpus.read_text(encoding="utf-8").splitlines()
    texts = [t for t in (cleaner.clean(json.loads(line)["text"]) for line in lines) if t]
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    start = time.perf_counter()
    tokens = sum(len(ids) for ids in sp.encode(texts, num_threads=1))
    return tokens / (time.perf_counter() - start), tokens


def convert_rate(corpus: Path, tokenizer: str, out: Path, workers: int, seq_len: int) -> dict:
    from convert.jobs import convert_corpus
    from convert.pipeline import ShardOptions

    options = ShardOptions(
        seq_len=seq_len, val_fraction=0.01, workers=workers, overwrite=True, progress=False
    )
    start = time.perf_counter()
    summary = convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(out), options=options)
    elapsed = time.perf_counter() - start
    # Every kept token was encoded, whether or not it ended in the last partial sample.
    encoded = sum(s["tokens"] + s["lost_tail_tokens"] for s in summary["splits"].values())
    return {"workers": workers, "elapsed_s": elapsed, "tokens_per_s": encoded / elapsed}


def peak_memory_mb() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, children


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=3_000_000, help="corpus size in characters")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-workers", type=int, default=2)
    args = parser.parse_args(argv)

    from convert.demo_corpus import write_demo_corpus
    from convert.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        written = write_demo_corpus(corpus, max_chars=args.chars)
        tokenizer = str(root / "tok.model")
        lines = corpus.read_text(encoding="utf-8").splitlines()
        train_tokenizer(
            (json.loads(line)["text"] for line in lines), vocab_size=args.vocab_size, out=tokenizer
        )
        raw, tokens = raw_encode_rate(corpus, tokenizer)
        print(
            f"corpus: {written['documents']:,} documents, {written['chars']:,} characters, {tokens:,} tokens"
        )
        print(f"raw SentencePiece encode (1 thread): {raw:,.0f} tokens/s")
        runs = [
            convert_rate(corpus, tokenizer, root / "out", workers, args.seq_len)
            for workers in range(1, args.max_workers + 1)
        ]
    for run in runs:
        per_worker = run["tokens_per_s"] / run["workers"]
        print(
            f"end-to-end, {run['workers']} worker(s): {run['tokens_per_s']:,.0f} tokens/s "
            f"({per_worker:,.0f} per worker) in {run['elapsed_s']:.2f} s"
        )
    ratio = runs[0]["tokens_per_s"] / raw
    print(f"ratio end-to-end (1 worker) / raw encode: {ratio:.2f} (target >= 0.8)")
    if len(runs) > 1:
        speedup = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
        print(
            f"speed-up 1 -> 2 workers: {speedup:.2f} (target >= 1.6 on 2 cores; {os.cpu_count()} CPUs here)"
        )
    own, children = peak_memory_mb()
    print(f"peak memory: {own:,.0f} MB main process, {children:,.0f} MB largest worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
