"""The converter's output, byte for byte, against a record written by the code before issue 21
moved the per-document work out of the main process (tests/convert_golden.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from convert_golden import CASES, RECORD, convert, digests, write_corpus

pytestmark = pytest.mark.slow  # worker processes


@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory, chinese_documents, small_tokenizer) -> tuple[list[str], dict]:
    record = json.loads(RECORD.read_text())
    assert hashlib.sha256(Path(small_tokenizer).read_bytes()).hexdigest() == record["tokenizer_sha256"]
    inputs = write_corpus(tmp_path_factory.mktemp("golden"), chinese_documents)
    assert [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in inputs] == record["corpus_sha256"]
    return inputs, record


@pytest.mark.parametrize(
    ("label", "near", "run"), [(label, near, run) for label, near, runs in CASES for run in runs]
)
def test_output_is_byte_identical_to_the_record(golden_inputs, small_tokenizer, tmp_path, label, near, run):
    inputs, record = golden_inputs
    convert(inputs, small_tokenizer, tmp_path / "out", near, run)
    assert digests(tmp_path / "out") == record["cases"][label]
