"""Resume harness shared by the resume tests and the resume benchmarks: tiny token shards, a tiny
recipe, training subprocesses, records.

Every run is a real `train.py` process (through bench/resume_driver.py, which adds a recorder
callback): it writes one JSON line per batch (batch number, loss, SHA-256 of the batch's
input_ids) and, at the end, the final weights. Comparing those files is how the tests decide
"bit-identical" and "no sample repeated or skipped".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("resume_driver.py")
SEQ_LEN = 32
VOCAB = 256
NUM_SAMPLES = 96
MAX_BATCHES = 12
SAVE_EVERY = 4


def write_shards(root: Path) -> Path:
    """A train split of NUM_SAMPLES deterministic token samples in the convert/FORMAT.md layout."""
    from streaming import MDSWriter

    split = root / "train"
    if (split / "index.json").exists():
        return split
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, VOCAB, size=(NUM_SAMPLES, SEQ_LEN), dtype=np.uint16)
    columns = {"tokens": "ndarray:uint16"}
    with MDSWriter(out=str(split), columns=columns, hashes=["sha1", "xxh64"], size_limit=1 << 12) as writer:
        for row in tokens:
            writer.write({"tokens": row})
    meta = {
        "format": "llm-pretrain-tokens",
        "format_version": 1,
        "split": "train",
        "seq_len": SEQ_LEN,
        "dtype": "uint16",
        "vocab_size": VOCAB,
        "eos_id": 2,
        "bos_id": 1,
        "add_bos": False,
        "tokenizer_sha256": "none",
        "num_samples": NUM_SAMPLES,
        "num_tokens": NUM_SAMPLES * SEQ_LEN,
        "num_documents": NUM_SAMPLES,
        "dropped": {},
    }
    (split / "meta.json").write_text(json.dumps(meta))
    return split


def write_recipe(path: Path, shards: Path, save_folder: str, *, run_name: str = "rs", cache: Path) -> Path:
    """A tiny CPU recipe: 2-layer model, 12 batches of 4 x 32 tokens, a checkpoint every 4."""
    tok = path.parent / "tokenizer.model"
    tok.write_bytes(b"not used: data.check_tokenizer_hash is false and generation is off")
    path.write_text(
        f"""
run_name: {run_name}
run_dir: {path.parent / "runs" / run_name}
seed: 17
model: {{vocab_size: {VOCAB}, dim: 32, n_layers: 2, n_heads: 2, max_seq_len: {SEQ_LEN}}}
tokenizer: {{path: {tok}}}
data:
  train: [{{remote: {shards}}}]
  cache_root: {cache}
  check_tokenizer_hash: false
optimizer: {{lr: 1.0e-2}}
scheduler: {{warmup: 2ba, min_lr: 1.0e-4}}
training:
  global_batch_size: 4
  device_microbatch_size: 4
  max_duration: {MAX_BATCHES}ba
  eval_interval: 1000ba
  log_interval: 1
  device: cpu
checkpoint: {{save_folder: {save_folder}, save_interval: {SAVE_EVERY}ba, num_to_keep: 2}}
callbacks: {{generate: {{enabled: false}}, loss_plot: false, memory_monitor: false}}
loggers: {{progress_bar: false, metrics_file: false}}
"""
    )
    return path


@dataclass
class Run:
    """One training process: its exit code, output and what its recorder wrote."""

    returncode: int
    output: str
    record: Path
    weights: Path
    seconds: float

    def batches(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]


def driver_env(record: Path, weights: Path, sleep: float = 0.0, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        LLM_TEST_RECORD=str(record),
        LLM_TEST_WEIGHTS=str(weights),
        LLM_TEST_BATCH_SLEEP=str(sleep),
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def start(
    recipe: Path, tag: str, *, cwd: Path, overrides=(), sleep=0.0, env=None, launcher=None, folder=None
):
    """Start a training process; returns (Popen, record path, weights path).

    The record, weights and log go to `folder` (default: the recipe's folder) as `<tag>.*`.
    """
    folder = Path(folder or recipe.parent)
    record = folder / f"{tag}.jsonl"
    weights = folder / f"{tag}.weights.pt"
    for p in (record, weights):
        p.unlink(missing_ok=True)
    cmd = [*(launcher or [sys.executable]), str(DRIVER), str(recipe), *overrides]
    log = open(folder / f"{tag}.log", "w")
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=driver_env(record, weights, sleep, env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.tag_log = folder / f"{tag}.log"  # type: ignore[attr-defined]
    return proc, record, weights


def finish(proc, record: Path, weights: Path, started: float, timeout: float = 300) -> Run:
    proc.wait(timeout=timeout)
    output = Path(proc.tag_log).read_text()
    return Run(proc.returncode, output, record, weights, time.monotonic() - started)


def run(recipe: Path, tag: str, *, cwd: Path, overrides=(), env=None, launcher=None, timeout=300) -> Run:
    started = time.monotonic()
    proc, record, weights = start(recipe, tag, cwd=cwd, overrides=overrides, env=env, launcher=launcher)
    return finish(proc, record, weights, started, timeout)


def wait_for_batch(record: Path, batch: int, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if record.exists():
            lines = [json.loads(x) for x in record.read_text().splitlines() if x.strip()]
            if lines and lines[-1]["batch"] >= batch:
                return
        if proc.poll() is not None:
            raise AssertionError(
                f"training exited with {proc.returncode} before batch {batch}:\n{Path(proc.tag_log).read_text()[-4000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"batch {batch} not reached in {timeout} s")


def interrupt(
    recipe: Path, tag: str, *, cwd: Path, at_batch: int, sig: int, overrides=(), env=None, launcher=None
):
    """Run until `at_batch` is recorded, then send `sig` to the whole process group."""
    started = time.monotonic()
    proc, record, weights = start(
        recipe, tag, cwd=cwd, overrides=overrides, sleep=0.25, env=env, launcher=launcher
    )
    wait_for_batch(record, at_batch, proc)
    sent = time.monotonic()
    if launcher:  # the composer launcher forwards SIGTERM to its ranks, as on a real node
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)
    result = finish(proc, record, weights, started)
    result.seconds = time.monotonic() - sent  # from the signal to the process's exit
    return result


def load_weights(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ in {different[:5]}"


def assert_continues(reference: Run, first: Run, resumed: Run, resume_batch: int) -> None:
    """Sample order and per-step losses of first[:resume] + resumed equal the reference run."""
    ref = reference.batches()
    done = [b for b in first.batches() if b["batch"] <= resume_batch]
    after = resumed.batches()
    assert after and after[0]["batch"] == resume_batch + 1, (
        f"resumed at {after[:1]}, expected {resume_batch + 1}"
    )
    combined = done + after
    assert [b["batch"] for b in combined] == [b["batch"] for b in ref]
    assert [b["ids"] for b in combined] == [b["ids"] for b in ref], "sample order differs"
    assert [b["loss"] for b in after] == [b["loss"] for b in ref[resume_batch:]], "losses differ"


def kill_group(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def reference_run(base: Path, shards: Path) -> Run:
    """The uninterrupted run every resumed run is compared with (made once per pytest session)."""
    folder = base / "resume-reference"
    done = folder / "done"
    recipe = folder / "recipe.yaml"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_recipe(recipe, shards, str(folder / "ckpt"), cache=folder / "cache")
        result = run(recipe, "reference", cwd=folder)
        assert result.returncode == 0, result.output[-4000:]
        done.touch()
    return Run(0, "", folder / "reference.jsonl", folder / "reference.weights.pt", 0.0)
