"""Fixtures for the converter's tests: a small real tokenizer, a small real corpus, helpers.

Import them into a test module (`from convert_fixtures import small_tokenizer, ...`) or expose
them from conftest. Everything is built from the People's Daily text (`chinese_documents`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL_VOCAB = 2000
TOKENIZER_DOCS = 600
CORPUS_DOCS = 300


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory, chinese_documents) -> str:
    """Path of a 2000-piece BPE model trained once per session with the converter's settings."""
    from convert.tokenizer import train_tokenizer

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
    from corpus_fixtures import write_jsonl

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_jsonl(path, small_corpus_docs)
    return str(path)


def run_convert(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m convert ARGS` in a subprocess, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "convert", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def local_samples(out: str, split: str = "train") -> np.ndarray:
    """All samples of a finished local split, in index order."""
    from convert.writer import Store, read_split

    return read_split(Store.open(out), split)


def sorted_rows(rows: np.ndarray) -> list[bytes]:
    return sorted(row.tobytes() for row in rows)
