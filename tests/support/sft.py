"""Helpers for the SFT tests: write prompt/answer records, convert them with the real CLI, read the
shards back with streaming's own reader."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support import forkserver, paths

REPO = paths.REPO
SFT_SEQ_LEN = 96


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path


def convert(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m convert ARGS` in a subprocess (what a user runs)."""
    return forkserver.run(
        [sys.executable, "-m", "convert", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def convert_sft(inputs: list[Path], tokenizer: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["sft", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out), "--no-progress", *extra]
    return convert(*args)


def read_split(folder: Path) -> list[dict[str, np.ndarray]]:
    """Every sample of an SFT split, in order, through streaming's StreamingDataset."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(folder), shuffle=False, batch_size=1)
    try:
        return [{k: np.asarray(v).copy() for k, v in dataset[i].items()} for i in range(dataset.num_samples)]
    finally:
        del dataset


def examples_of(sample: dict[str, np.ndarray]) -> list[tuple[list[int], list[int]]]:
    """(prompt-part ids, answer-part ids) of each example in a sample, from its segments and mask."""
    out = []
    segments, tokens, mask = sample["segments"], sample["tokens"], sample["loss_mask"]
    for segment in sorted(set(segments.tolist()) - {0}):
        where = segments == segment
        ids, learn = tokens[where].tolist(), mask[where].tolist()
        cut = learn.index(1)
        assert all(learn[cut:]) and not any(learn[:cut]), learn  # the answer is one run at the end
        out.append((ids[:cut], ids[cut:]))
    return out


@pytest.fixture(scope="session")
def review_pairs() -> list[dict]:
    """Real prompt/answer pairs: the demo's labelled reviews (`python -m convert demo-sft`)."""
    from convert.demo.sft import labelled_pairs, prompt_for

    # Short reviews (as before the demo task took longer ones): they fit the tests' 96-token samples.
    return [{"prompt": prompt_for(r), "answer": a} for r, a in labelled_pairs(max_chars=100)[:400]]


@pytest.fixture(scope="session")
def sft_shards(tmp_path_factory, train_data, review_pairs) -> Path:
    """SFT shards of 400 review pairs, tokenized like `train_data` (its tokenizer), 96 tokens a sample."""
    root = tmp_path_factory.mktemp("sft-shards")
    records = write_jsonl(root / "pairs.jsonl", review_pairs)
    done = convert_sft(
        [records], str(train_data.tokenizer), root / "shards", "--seq-len", str(SFT_SEQ_LEN),
        "--min-prompt-chars", "1", "--min-answer-chars", "1", "--val-fraction", "0.1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root / "shards"
