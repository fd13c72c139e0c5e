"""Reading throughput per input format against tokenization: `python -m bench.reading` (or
`make bench-reading`).

Reading must never be what a conversion waits for: one core reads (the main process, or a worker
its byte range or row group) what several cores tokenize. This writes the demo corpus (real
Chinese text, `--copies` times, each copy with its own suffix) as JSON lines, plain and compressed
(gzip, zstd, bzip2, xz: each with its default level), and as Parquet (snappy pages, pyarrow's
default and the Hub's; zstd pages; row groups of 1,000 documents, as datatrove and `datasets`
write them), then prints for each file, side by side:
  * the characters/s of reading its documents (`read_documents`, one thread: decompressing,
    splitting lines, parsing JSON or decoding the text column, UTF-8, one Python string each);
  * the characters/s of raw SentencePiece encode on one thread over the same texts, one call per
    text batch as a worker makes it (a tokenizer of `--vocab-size` pieces trained on the corpus);
  * their ratio, "read / tokenize per core" (target >= 3).
Best of `--repeat` runs, in rounds (each round reads every file and encodes once, so a burst of
load hits them alike), with the paired ratios of each round. Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.convert import build_corpus


def compressors() -> dict[str, Callable[[bytes], bytes]]:
    import pyarrow as pa

    def zstd(data: bytes) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as stream:
            stream.write(data)
        return sink.getvalue().to_pybytes()

    return {".gz": gzip.compress, ".zst": zstd, ".bz2": bz2.compress, ".xz": lzma.compress}


def write_inputs(corpus: Path, texts: list[str]) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [corpus]
    data = corpus.read_bytes()
    for suffix, compress in compressors().items():
        files.append(corpus.with_name(corpus.name + suffix))
        files[-1].write_bytes(compress(data))
    table = pa.table({"id": pa.array(range(len(texts))), "text": pa.array(texts), "url": ["https://example.org/"] * len(texts)})  # fmt: skip
    for compression in ("snappy", "zstd"):
        files.append(corpus.with_name(f"corpus.{compression}.parquet"))
        pq.write_table(table, files[-1], row_group_size=1000, compression=compression)
    return files


def read_rate(path: Path) -> tuple[float, int]:
    """Characters/s of reading every document of `path` in this process, and the characters."""
    from convert.reading.readers import ReadStats, read_documents

    start = time.perf_counter()
    chars = sum(len(doc.text) for doc in read_documents([str(path)], "auto", stats=ReadStats()))
    return chars / (time.perf_counter() - start), chars


def encode_rate(texts: list[str], tokenizer: str) -> float:
    """Characters/s of one-thread SentencePiece encode, one call per text batch."""
    import sentencepiece as spm

    from convert.run.conversion import BATCH_CHARS

    batches, batch, size = [], [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    start = time.perf_counter()
    for batch in batches:
        sp.encode(batch, num_threads=1)
    return sum(map(len, texts)) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reading",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--chars", type=int, default=3_000_000, help="demo-corpus characters per copy")
    parser.add_argument("--copies", type=int, default=2, help="copies of it in the corpus")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of measurement")
    args = parser.parse_args(argv)

    import json

    from convert.tokens.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-reading-") as tmp:
        root = Path(tmp)
        corpus, base = build_corpus(root, args.chars, args.copies)
        tokenizer = str(root / "tok.model")
        train_tokenizer(base, vocab_size=args.vocab_size, out=tokenizer)
        texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
        files = write_inputs(corpus, texts)
        print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)):,} characters")
        encode_rate(texts, tokenizer)  # a warm-up, not counted
        reads: dict[str, list[float]] = {path.name: [] for path in files}
        encodes = []
        for _ in range(args.repeat):
            encodes.append(encode_rate(texts, tokenizer))
            for path in files:
                rate, chars = read_rate(path)
                assert chars == sum(map(len, texts)), (path, chars)
                reads[path.name].append(rate)
        sizes = {path.name: path.stat().st_size for path in files}
    best_encode = max(encodes)
    print(
        f"raw SentencePiece encode, one thread ({args.vocab_size} pieces): {best_encode / 1e6:.2f} M characters/s "
        f"(runs: {', '.join(f'{r / 1e6:.2f}' for r in encodes)})"
    )
    for name, rates in reads.items():
        paired = [read / encode for read, encode in zip(rates, encodes, strict=True)]
        print(
            f"{name:<26} {sizes[name] / 1e6:7.1f} MB  read {max(rates) / 1e6:6.1f} M characters/s  "
            f"RATIO read / tokenize per core {max(rates) / best_encode:5.1f} (paired rounds: "
            f"{', '.join(f'{r:.1f}' for r in paired)}, median {statistics.median(paired):.1f}; target >= 3)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
