"""Resume harness shared by the resume tests and the resume benchmarks: tiny token shards, a tiny
recipe, training subprocesses, records.

Every run is a real `train.py` process (through scenarios/resume_driver.py, which adds a recorder
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
# How a training process is started: `subprocess.Popen`, or a stand-in with its interface (the test
# suite's fork server, tests/support/forkserver.py, which skips the interpreter's start-up).
SPAWN = subprocess.Popen
SEQ_LEN = 32
VOCAB = 256
NUM_SAMPLES = 96
MAX_BATCHES = 12
SAVE_EVERY = 4
# Run records on: metrics.jsonl every 3 steps (a stop at batch 4 or 5 falls between two lines, and
# the checkpoint at 8 between the lines at 6 and 9), the loss plot drawn.
RECORDS = ["loggers.metrics_file=true", "training.log_interval=3", "callbacks.loss_plot=true"]


def write_shards(root: Path, shard_bytes: int = 1 << 12) -> Path:
    """A train split of NUM_SAMPLES deterministic token samples in the shards/FORMAT.md layout."""
    from shards.meta import SplitMeta, now
    from shards.writer import write_token_split
    from storage import open_store

    split = root / "train"
    if (split / "index.json").exists():
        return split
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, VOCAB, size=(NUM_SAMPLES, SEQ_LEN), dtype=np.uint16)
    meta = SplitMeta(
        split="train", seq_len=SEQ_LEN, dtype="uint16", vocab_size=VOCAB, eos_id=2, bos_id=1, add_bos=False,
        tokenizer_sha256="none", num_samples=NUM_SAMPLES, num_tokens=NUM_SAMPLES * SEQ_LEN,
        num_documents=NUM_SAMPLES, dropped={}, created_at=now(), command="bench.resume_harness",
    )  # fmt: skip
    write_token_split(open_store(split), [tokens], meta, size_limit=shard_bytes)
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
    pid: int | None = None  # the process's (a launcher's: the first node's)

    def batches(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]


def driver_env(
    record: Path, weights: Path, sleep: float = 0.0, extra: dict | None = None, pause_at: int | tuple = ()
) -> dict:
    env = dict(os.environ)
    env.update(
        LLM_TEST_RECORD=str(record),
        LLM_TEST_WEIGHTS=str(weights),
        LLM_TEST_BATCH_SLEEP=str(sleep),
        LLM_TEST_PAUSE_AT=",".join(map(str, pause_at if isinstance(pause_at, tuple) else [pause_at])),
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def start(
    recipe: Path, tag: str, *, cwd: Path, overrides=(), sleep=0.0, env=None, launcher=None, folder=None,
    driver: Path = DRIVER, pause_at: int | tuple = (),
):  # fmt: skip
    """Start a training process; returns (Popen, record path, weights path).

    The record, weights and log go to `folder` (default: the recipe's folder) as `<tag>.*`.
    `pause_at`: the process holds after that batch (or each of those) until it is signalled or
    `release(record, batch)`.
    `driver` is the script run (default scenarios/resume_driver.py; bench/gpu_check_driver.py wraps it).
    """
    folder = Path(folder or recipe.parent)
    record = folder / f"{tag}.jsonl"
    weights = folder / f"{tag}.weights.pt"
    for p in (record, weights, *release_files(record)):
        p.unlink(missing_ok=True)
    cmd = [*(launcher or [sys.executable]), str(driver), str(recipe), *overrides]
    proc = _spawn(cmd, folder / f"{tag}.log", cwd=cwd, env=driver_env(record, weights, sleep, env, pause_at))
    proc.tag_log = folder / f"{tag}.log"  # type: ignore[attr-defined]
    return proc, record, weights


def _spawn(cmd: list[str], log: Path, *, cwd: Path, env: dict):
    """Start `cmd` in its own session through SPAWN, its output (both streams) into `log`."""
    with open(log, "w") as out:  # the process keeps its own descriptor
        return SPAWN(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc, record: Path, weights: Path, started: float, timeout: float = 300) -> Run:
    proc.wait(timeout=timeout)
    output = Path(proc.tag_log).read_text()
    return Run(proc.returncode, output, record, weights, time.monotonic() - started, proc.pid)


def run(
    recipe: Path, tag: str, *, cwd: Path, overrides=(), env=None, launcher=None, timeout=300, driver=DRIVER
) -> Run:
    started = time.monotonic()
    proc, record, weights = start(
        recipe, tag, cwd=cwd, overrides=overrides, env=env, launcher=launcher, driver=driver
    )
    return finish(proc, record, weights, started, timeout)


# --- several "nodes" on one machine ------------------------------------------------------------

# A new mount namespace with a fresh tmpfs on /dev/shm (needs root or CAP_SYS_ADMIN): two node
# leaders on one machine would otherwise collide in mosaicml-streaming's shared memory names.
PRIVATE_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "node"]


def private_shm_problem() -> str | None:
    """Why launchers cannot pose as separate nodes here (no private /dev/shm), or None."""
    probe = subprocess.run([*PRIVATE_SHM, "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip() or "unshare failed"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """`composer` launchers posing as `len(launchers)` nodes, handled like one process.

    Each runs in its own /dev/shm and temp folder with its own stream cache (`data.cache_root`), as
    on separate machines; they share the file system (checkpoints, records), as nodes share S3 or NFS.
    """

    def __init__(self, procs: list, log: Path):
        self.procs = procs
        self.tag_log = log
        self.pid = procs[0].pid

    def poll(self):
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return self.returncode

    @property
    def returncode(self):
        codes = [p.returncode for p in self.procs]
        return None if None in codes else next((c for c in codes if c), 0)

    def send_signal(self, sig: int) -> None:  # a scheduler's preemption reaches every node
        for p in self.procs:
            p.send_signal(sig)

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        # One log, node by node, so a failure on any node is visible in Run.output.
        parts = [
            f"===== node {i} =====\n{Path(f'{self.tag_log}.node{i}').read_text()}"
            for i in range(len(self.procs))
        ]
        Path(self.tag_log).write_text("\n".join(parts))
        return self.returncode


def start_nodes(
    recipe: Path, tag: str, *, cwd: Path, nodes: int, nproc: int, overrides=(), sleep=0.0, env=None,
    pause_at: int | tuple = (),
) -> tuple[Nodes, Path, Path]:  # fmt: skip
    """Like `start`, with `nodes` launchers of `nproc` ranks each (world size nodes x nproc)."""
    folder = Path(recipe.parent)
    record, weights = folder / f"{tag}.jsonl", folder / f"{tag}.weights.pt"
    for p in (record, weights, *release_files(record)):
        p.unlink(missing_ok=True)
    composer = str(Path(sys.executable).with_name("composer"))
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [
            *PRIVATE_SHM, composer, "--nproc", str(nproc), "--world_size", str(nodes * nproc),
            "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(DRIVER), str(recipe), *overrides, f"data.cache_root={folder / f'cache-{tag}-node{node}'}",
        ]  # fmt: skip
        env_node = driver_env(record, weights, sleep, env, pause_at)
        # Its own temp folder too: streaming picks its shared-memory prefix by scanning /dev/shm
        # and its file locks in the temp folder, and each rank scans for itself. A shared /tmp let
        # another process's new lock land between the two ranks' scans: they picked different
        # prefixes and the run failed at start ("prefix=1425 was not registered by local leader").
        node_tmp = folder / f"tmp-{tag}-node{node}"
        node_tmp.mkdir(exist_ok=True)
        env_node["TMPDIR"] = str(node_tmp)
        procs.append(_spawn(cmd, folder / f"{tag}.log.node{node}", cwd=cwd, env=env_node))
    return Nodes(procs, folder / f"{tag}.log"), record, weights


def run_nodes(recipe: Path, tag: str, *, cwd: Path, nodes: int, nproc: int, overrides=(), env=None,
              timeout=600) -> Run:  # fmt: skip
    started = time.monotonic()
    group, record, weights = start_nodes(
        recipe, tag, cwd=cwd, nodes=nodes, nproc=nproc, overrides=overrides, env=env
    )
    return finish(group, record, weights, started, timeout)


def release_files(record: Path) -> list[Path]:
    return [
        *record.parent.glob(f"{record.name}.go.*"),
        *record.parent.glob(f"{record.name}.uploading.*"),
        *record.parent.glob(f"{record.name}.writing.*"),
    ]


def write_held(record: Path, batch: int) -> Path:
    """The file a driver run with LLM_TEST_WRITE_HOLD=<batch> touches once that write is held."""
    return Path(f"{record}.writing.{batch}")


def release_write(record: Path, batch: int) -> None:
    """Let the held background write of `batch` (LLM_TEST_WRITE_HOLD) go on."""
    Path(f"{record}.go.write.{batch}").touch()


def upload_held(record: Path, batch: int) -> Path:
    """The file a driver run with LLM_TEST_UPLOAD_HOLD=<batch> touches once that upload is held."""
    return Path(f"{record}.uploading.{batch}")


def release_upload(record: Path, batch: int) -> None:
    """Let the held upload of `batch` (LLM_TEST_UPLOAD_HOLD) go on."""
    Path(f"{record}.go.upload.{batch}").touch()


def wait_for_file(path: Path, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"exited with {proc.returncode} before {path.name} appeared:\n{Path(proc.tag_log).read_text()[-4000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def release(record: Path, batch: int) -> None:
    """Let a process held at `batch` (`pause_at`) go on without a signal."""
    Path(f"{record}.go.{batch}").touch()


def _poll(ready, proc, what: str, log: Path, timeout: float) -> None:
    """Wait until `ready()` is true; fail with the log's tail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"exited with {proc.returncode} before {what}:\n{Path(log).read_text()[-4000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s (log: {log})")


def wait_for_line(log: Path, text: str, proc, timeout: float = 120) -> None:
    """Wait until the process's log has a line containing `text`."""
    _poll(lambda: text in Path(log).read_text(), proc, repr(text), log, timeout)


def wait_for_batch(record: Path, batch: int, proc, timeout: float = 180) -> None:
    """Wait until the recorder has written batch `batch` (or a later one)."""

    def reached() -> bool:
        lines = [x for x in record.read_text().splitlines() if x.strip()] if record.exists() else []
        try:
            return bool(lines) and json.loads(lines[-1])["batch"] >= batch
        except json.JSONDecodeError:  # a line being written
            return False

    _poll(reached, proc, f"batch {batch}", proc.tag_log, timeout)


def interrupt(
    recipe: Path, tag: str, *, cwd: Path, at_batch: int, sig: int, overrides=(), env=None, launcher=None,
    nodes: tuple[int, int] | None = None, driver: Path = DRIVER,
):  # fmt: skip
    """Run until `at_batch` is recorded (the process holds there), then send `sig` to the whole
    process group (or to every launcher: `launcher`, or `nodes=(nodes, ranks per node)` for
    launchers posing as nodes). The run stops after exactly `at_batch`."""
    started = time.monotonic()
    if nodes:
        proc, record, weights = start_nodes(
            recipe, tag, cwd=cwd, nodes=nodes[0], nproc=nodes[1], overrides=overrides, env=env,
            pause_at=at_batch,
        )  # fmt: skip
    else:
        proc, record, weights = start(
            recipe, tag, cwd=cwd, overrides=overrides, env=env, launcher=launcher, driver=driver,
            pause_at=at_batch,
        )  # fmt: skip
    wait_for_batch(record, at_batch, proc)
    sent = time.monotonic()
    if launcher or nodes:  # the composer launcher forwards SIGTERM to its ranks, as on a real node
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


# Documents kept apart, positions restarting, the guard watching: the variant of the recipe that the
# resume tests also run (the shards' EOS id is 2: about one sample in nine holds two documents).
DOCUMENTS = ["model.attention=document", "model.positions=document", "guard.enabled=true"]


def reference_run(
    base: Path, shards: Path, overrides: tuple[str, ...] = (), name: str = "resume-reference"
) -> Run:
    """The uninterrupted run every resumed run is compared with (made once per pytest session), with
    its records on (`RECORDS`): its run folder's metrics.jsonl is what a resumed run's must equal.
    `overrides` make a variant of the recipe (in its own folder, `name`)."""
    folder = base / name
    done = folder / "done"
    recipe = folder / "recipe.yaml"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_recipe(recipe, shards, str(folder / "ckpt"), cache=folder / "cache")
        result = run(recipe, "reference", cwd=folder, overrides=[*RECORDS, *overrides])
        assert result.returncode == 0, result.output[-4000:]
        done.touch()
    return Run(0, "", folder / "reference.jsonl", folder / "reference.weights.pt", 0.0)
