"""Shared helpers for the training tests: real shards of real Chinese text, small recipes.

`train_data` (session-scoped) converts a few hundred People's Daily articles once per session with
the project's own converter (`python -m convert tokenizer`, `python -m convert shards`), exactly as
a user would, into 64-token samples. `write_recipe` writes a CPU-sized recipe over them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support import forkserver, paths

REPO = paths.REPO
SEQ_LEN = 64
VOCAB_SIZE = 4096
NUM_DOCUMENTS = 400


@dataclass(frozen=True)
class TrainData:
    root: Path
    tokenizer: Path
    train: Path  # split folders holding index.json + meta.json
    val: Path
    vocab_size: int
    seq_len: int


def _convert(*args: str, cwd: Path) -> None:
    proc = forkserver.run(
        [sys.executable, "-m", "convert", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m convert {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def build_train_data(root: Path, documents: list[str]) -> TrainData:
    """Corpus (jsonl) -> tokenizer -> shards (train + val), through the convert CLI."""
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as f:
        for doc in documents[:NUM_DOCUMENTS]:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    tokenizer = root / "tokenizer.model"
    _convert(
        "tokenizer",
        str(corpus),
        "--format",
        "jsonl",
        "--vocab-size",
        str(VOCAB_SIZE),
        "--out",
        str(tokenizer),
        cwd=root,
    )
    shards = root / "shards"
    _convert(
        "shards", str(corpus), "--format", "jsonl", "--tokenizer", str(tokenizer), "--seq-len", str(SEQ_LEN),
        "--val-fraction", "0.1", "--workers", "1", "--out", str(shards), "--overwrite",
        cwd=root,
    )  # fmt: skip
    meta = json.loads((shards / "train" / "meta.json").read_text())
    return TrainData(root, tokenizer, shards / "train", shards / "val", meta["vocab_size"], meta["seq_len"])


@pytest.fixture(scope="session")
def train_data(tmp_path_factory, chinese_documents) -> TrainData:
    """Real token shards of real Chinese text, built once per test session."""

    return build_train_data(tmp_path_factory.mktemp("train-data"), chinese_documents)


def recipe_dict(shards: TrainData, run_dir: Path, **sections) -> dict:
    """A CPU-sized recipe (2 layers, dim 64) over `data`; `sections` replace whole top-level keys."""
    recipe = {
        "run_name": "test",
        "run_dir": str(run_dir),
        "seed": 17,
        "model": {
            "vocab_size": shards.vocab_size,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": shards.seq_len,
            "tie_embeddings": True,
        },
        "tokenizer": {"path": str(shards.tokenizer)},
        "data": {
            "train": [{"remote": str(shards.train)}],
            "eval": [{"remote": str(shards.val)}],
            "cache_root": str(run_dir / "cache"),
        },
        "optimizer": {"lr": 3.0e-3},
        "scheduler": {"warmup": "4ba", "min_lr": 1.0e-4},
        "training": {
            "global_batch_size": 8,
            "device_microbatch_size": 8,
            "max_duration": "24ba",
            "eval_interval": "12ba",
            "eval_subset_num_batches": 4,
            "log_interval": 4,
        },
        "callbacks": {"generate": {"enabled": False}},
        "loggers": {"progress_bar": False},
    }
    recipe.update(sections)
    return recipe


def write_recipe(path: Path, shards: TrainData, **sections) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    run_dir = sections.pop("run_dir", path.parent / "run")
    path.write_text(yaml.safe_dump(recipe_dict(shards, Path(run_dir), **sections), allow_unicode=True))
    return path


def load(path: Path, *overrides: str):
    from llm.config import load_config

    return load_config(path, list(overrides))


def checkpoint_bytes(tag: str) -> bytes:
    """A small torch.save file with a model and an optimizer state, told apart by `tag`: what
    a monolithic checkpoint holds, for the tests that store one without training."""
    import io

    import torch

    adamw = {"state": {}, "param_groups": [{"lr": 1e-3, "params": ["model.tok_embeddings.weight"]}]}
    state = {"model": {"model.tok_embeddings.weight": torch.ones(2)}, "optimizers": {"AdamW": adamw}}
    buffer = io.BytesIO()
    torch.save({"state": state, "tag": tag}, buffer)
    return buffer.getvalue()


def store_checkpoint(store, batch: int, local: Path) -> str:
    """Store the file `local` as a run's monolithic checkpoint at `batch` with its manifest, as
    CheckpointPublisher writes them (no training needed); the checkpoint's path in `store`."""
    from llm.checkpoint import manifest as cm

    rel = f"ep0-ba{batch}-rank0.pt"
    store.upload(local, rel)
    manifest = cm.Manifest(
        batch=batch,
        rank=0,
        writers=1,
        world_size=1,
        sharded=False,
        load_path=rel,
        timestamp={"batch": batch},
        files={rel: cm.file_digest(local)},
    )
    store.write_text(cm.manifest_name(batch, 0), manifest.to_json())
    return rel


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file (what `llm.loggers.metrics_file` writes), in order."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def train_py(*argv: str) -> int:
    """`python train.py ARGV` in this process: its exit code (argparse's SystemExit included)."""
    import train

    try:
        return train.main(list(argv))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
