"""A fixed small corpus and the conversion settings whose output `tests/data/convert_golden.json`
records (sha256 of every shard, part.json and index.json), written by the converter as it was
before the main process stopped reading the documents itself (issue 21). `test_convert_golden.py`
converts the same corpus with today's code and compares byte for byte.

Regenerate the record only when a change of output is intended:
    python -m tests.support.golden --write
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "data" / "convert_golden.json"
SEQ_LEN = 64
CHUNK_CHARS = 12_000
# (label, near-dedup + filters, (workers, the main process cleans and writes) runs)
CASES = (
    ("plain", False, ((1, True), (1, False), (2, False), (3, False))),
    ("near_filters", True, ((1, True), (3, False))),
)


def corpus_documents(docs: list[str]) -> tuple[list[str], list[str]]:
    """Two files' documents from People's Daily: exact copies, edited copies, short texts."""
    from tests.support.corpus import edited_copy

    base = docs[:160]
    first, second = [], []
    for i, text in enumerate(base[:100]):
        first.append(text)
        if i % 7 == 3:
            first.append(text)  # exact copy, next line
        if i % 11 == 5:
            first.append(edited_copy(text, 0.01, seed=i))  # near copy
        if i % 13 == 0:
            first.append(text[:30])  # short under --filters
    for i, text in enumerate(base[100:]):
        second.append(text)
        if i % 5 == 0:
            second.append(base[i])  # a copy of a document of the first file
        if i % 9 == 2:
            second.append(edited_copy(base[i + 3], 0.02, seed=100 + i))
    return first, second


def write_corpus(root: Path, docs: list[str]) -> list[str]:
    first, second = corpus_documents(docs)
    a, b = root / "a.jsonl", root / "b.jsonl"
    with open(a, "w", encoding="utf-8") as f:
        for n, text in enumerate(first):
            f.write(json.dumps({"id": n, "text": text}, ensure_ascii=False) + "\n")
            if n == 17:
                f.write("{not json\n")
            if n == 40:
                f.write("\n")
    with open(b, "w", encoding="utf-8") as f:
        for text in second:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return [str(a), str(b)]


def record_texts(docs: list[str]) -> list[str | None]:
    """The corpus's records as one list, both files in order, with a null where a.jsonl has its
    line that is not JSON and an empty text where it has a blank line (at the same line numbers):
    the same documents, for inputs of other formats (Parquet) that must give the same bytes."""
    first, second = corpus_documents(docs)
    return [*first[:18], None, *first[18:41], "", *first[41:], *second]


def train(root: Path, docs: list[str]) -> str:
    from convert.tokens.tokenizer import train_tokenizer

    path = root / "golden.model"  # as the tests' `small_tokenizer` (tests/support/conversion.py)
    train_tokenizer(docs[:600], vocab_size=2000, out=str(path), character_coverage=0.98)
    return str(path)


def options(near: bool, workers: int, main_works: bool):
    from convert.dedup.options import NearDedupOptions
    from convert.filters.quality import QualityFilters
    from convert.run.options import ShardOptions

    return ShardOptions(
        seq_len=SEQ_LEN, val_fraction=0.05, workers=workers, overwrite=True, progress=False,
        chunk_chars=CHUNK_CHARS, main_works=main_works,
        filters=QualityFilters.recommended(chinese=True) if near else QualityFilters(),
        near_dedup=NearDedupOptions() if near else None,
    )  # fmt: skip


def digests(out: Path) -> dict[str, str]:
    """sha256 of every output file that the converter's decisions and packing decide."""
    found = {}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and (rel.endswith((".mds", ".zstd", "index.json", "part.json"))):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def convert(inputs: list[str], tokenizer: str, out: Path, near: bool, run: tuple[int, bool]):
    from convert.run.jobs import convert_corpus

    return convert_corpus(inputs, tokenizer=tokenizer, out=str(out), options=options(near, *run))


def main() -> int:
    from convert.demo.corpus import peoples_daily_documents

    docs = peoples_daily_documents()
    record: dict = {"cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = write_corpus(root, docs)
        tokenizer = train(root, docs)
        record["tokenizer_sha256"] = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
        record["corpus_sha256"] = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in inputs]
        for label, near, runs in CASES:
            results = {}
            for run in runs:
                convert(inputs, tokenizer, root / "out", near, run)
                results[run] = digests(root / "out")
            first = results[runs[0]]
            assert all(r == first for r in results.values()), f"{label}: output depends on the workers"
            record["cases"][label] = first
    if "--write" in sys.argv:
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    same = record == json.loads(RECORD.read_text())
    print(json.dumps({k: len(v) for k, v in record["cases"].items()}), "same as the record:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
