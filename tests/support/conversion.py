"""Fixtures for the converter's tests: a small real tokenizer, a small real corpus, helpers.

A pytest plugin (tests/conftest.py lists it): tests name the fixtures as arguments. Everything
is built from the People's Daily text (`chinese_documents`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support import forkserver, paths

REPO_ROOT = paths.REPO
SMALL_VOCAB = 2000
TOKENIZER_DOCS = 600
CORPUS_DOCS = 300


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory, chinese_documents) -> str:
    """Path of a 2000-piece BPE model trained once per session with the converter's settings."""
    from convert.tokens.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "small.model"
    # Coverage below the default: 2000 pieces cannot hold every character People's Daily uses.
    train_tokenizer(
        chinese_documents[:TOKENIZER_DOCS], vocab_size=SMALL_VOCAB, out=str(path), character_coverage=0.98
    )
    return str(path)


@pytest.fixture(scope="session")
def small_corpus_docs(chinese_documents) -> list[str]:
    """300 real documents (about 190,000 characters)."""
    return chinese_documents[:CORPUS_DOCS]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, small_corpus_docs) -> str:
    """The 300 documents as JSON lines ({"id", "text"})."""
    from tests.support.corpus import write_jsonl

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_jsonl(path, small_corpus_docs)
    return str(path)


def run_convert(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m convert ARGS` in a subprocess, from the repository root."""
    return forkserver.run(
        [sys.executable, "-m", "convert", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Return once `path` exists (e.g. a part's marker: the conversion is that far), `proc` has
    ended, or `timeout` seconds have passed; the caller asserts which."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)


def local_samples(out: str, split: str = "train") -> np.ndarray:
    """All samples of a finished local split, in index order, as an (n, seq_len) array."""
    import zstd

    folder = Path(out) / split
    index = json.loads((folder / "index.json").read_text())
    rows = []
    for shard in index["shards"]:
        raw = zstd.decompress((folder / shard["zip_data"]["basename"]).read_bytes())
        dtype = np.dtype(shard["column_encodings"][0].split(":")[1])
        rows.append(_decode_shard(raw, dtype))
    return np.concatenate(rows) if rows else np.empty((0, 0), dtype=np.uint16)


def _decode_shard(raw: bytes, dtype: np.dtype) -> np.ndarray:
    """The `tokens` column of every sample of one raw MDS shard (format: shards/writer.py)."""
    n = int(np.frombuffer(raw, "<u4", count=1)[0])
    offsets = np.frombuffer(raw, "<u4", count=n + 1, offset=4)
    out = []
    for begin, end in zip(offsets[:-1], offsets[1:], strict=True):
        sample = raw[begin + 4 : end]  # skip the datum size
        ndim_code = sample[0]
        shape_dtype = {0: np.uint8, 1: np.uint16, 2: np.uint32}[ndim_code & 3]
        header = 1 + (ndim_code >> 2) * np.dtype(shape_dtype).itemsize
        out.append(np.frombuffer(sample[header:], dtype=dtype))
    return np.stack(out)


def sorted_rows(rows: np.ndarray) -> list[bytes]:
    return sorted(row.tobytes() for row in rows)
