"""`train.py` plus a recorder, for the resume tests: `python scenarios/resume_driver.py RECIPE [k=v ...]`.

The recorder writes one JSON line per batch to $LLM_TEST_RECORD (rank 0; other ranks append
`.rank<N>`): batch number, the all-rank mean loss, and the SHA-256 of this rank's input_ids, then
sleeps $LLM_TEST_BATCH_SLEEP seconds (the soak's random timing). $LLM_TEST_PAUSE_AT=<batch>[,<batch>...]
holds the process after each of those batches' lines until a SIGTERM/SIGINT arrives or the file
`$LLM_TEST_RECORD.go.<batch>` appears, so that a test acts at a known batch (a signal, an outage)
without slowing every batch; before the line of such a batch is written, the checkpoint upload in
flight (background uploads) has finished, so a test acting there knows which checkpoints are
stored (not with $LLM_TEST_UPLOAD_HOLD, which holds one on purpose). At the end of a
complete run it saves the full model weights to $LLM_TEST_WEIGHTS. Optional, for elastic resume:
$LLM_TEST_LOADED_WEIGHTS gets the full weights at fit start (after a checkpoint was loaded), and
$LLM_TEST_STOP_WEIGHTS the full weights at the end of a run stopped before max_duration.
$LLM_TEST_SAVE_STALL=<seconds> makes each checkpoint file's writing stall once, after its first
bytes, so that a test can signal the process in the middle of torch.save: the driver touches
`$LLM_TEST_RECORD.stalling` as the stall begins.
$LLM_TEST_UPLOAD_HOLD=<batch> holds the storing of that batch's checkpoint files (in the
background upload thread, before the storage layer's upload starts): the driver touches
`$LLM_TEST_RECORD.uploading.<batch>` and waits for `$LLM_TEST_RECORD.go.upload.<batch>`, so that a
test acts while an upload is in flight (kill the process, break the storage) without timing.
$LLM_TEST_WRITE_HOLD=<batch> holds the background write of that batch's snapshot (in the upload
thread, inside `torch.save` after the file's first bytes, llm/checkpoint/saver.py): the driver
touches `$LLM_TEST_RECORD.writing.<batch>` and waits for `$LLM_TEST_RECORD.go.write.<batch>`, so
that a test trains on, or kills the process, while a snapshot is half written.
$LLM_TEST_LOG_INFO=<logger>[,<logger>...] prints those loggers' INFO lines too (a benchmark reads
the publisher's "stored in ... s after the save").
$LLM_TEST_SPIKE_AT=<batch>:<factor>[,...] multiplies the loss of that batch (the N-th, metrics.jsonl's
step N) by the factor (`nan` for a non-finite step) before its backward pass (`LossSpike`): a spike
at a known batch for the guard's tests (llm/callbacks/guard.py); with $LLM_TEST_SPIKE_RANK=<rank>
on that rank's micro-batches only.
$LLM_TEST_GUARD_SCORES=1 adds to each line the guard's measures of that batch's step (`"guard"`: its
`Scores`: how near each rule came to firing; bench/guard.py).
$LLM_TEST_LR_SPIKE=<from>:<to>:<factor> multiplies the learning rate of batches from+1 .. to (the
window [from, to) of data.skip's numbering) by the factor (`LearningRateSpike`): the guard demo's
instability, a stretch of updates far too large (scenarios/guard_demo.py).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: restart-to-first-step includes them

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm import startup  # noqa: E402

startup.begin()  # as train.py's own process does, before the heavy imports (llm/startup.py)

import torch  # noqa: E402
from composer.core import Callback, State  # noqa: E402
from composer.loggers import Logger  # noqa: E402
from composer.utils import dist  # noqa: E402


class Recorder(Callback):
    def __init__(self):
        rank = dist.get_global_rank()
        path = os.environ["LLM_TEST_RECORD"]
        self.path = path if rank == 0 else f"{path}.rank{rank}"
        self.sleep = float(os.environ.get("LLM_TEST_BATCH_SLEEP", "0"))
        self.pause_at = {int(b) for b in os.environ.get("LLM_TEST_PAUSE_AT", "").split(",") if b.strip()}
        self.release = path
        self.planned = None
        self.started = None

    def batch_end(self, state: State, logger: Logger) -> None:
        held = os.environ.get("LLM_TEST_UPLOAD_HOLD") or os.environ.get("LLM_TEST_WRITE_HOLD")
        if int(state.timestamp.batch) in self.pause_at and not held:
            _settle_uploads(state)
        batch = state.batch["input_ids"].cpu().contiguous()
        ids = batch.numpy().tobytes()
        row = {
            "batch": int(state.timestamp.batch),
            "loss": state.total_loss_dict.get("loss/train/total"),
            "ids": hashlib.sha256(ids).hexdigest(),
            # Per sample, so runs at different world sizes can be compared batch by batch.
            "samples": [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16] for row in batch],
            "time": time.time(),
            "started": self.started,  # this batch's BATCH_START: after the previous batch's save
            "process_started": STARTED,
            "imported": IMPORTED,
            # Trainer construction began (Event.INIT), a checkpoint (if any) was loaded
            # (Event.AFTER_LOAD), fit started: where a restart's time goes.
            **MILESTONES,
        }
        if os.environ.get("LLM_TEST_GUARD_SCORES"):
            row["guard"] = _guard_scores(state)
        # A test acts once it reads this batch's line: a pause must catch signals before it is written.
        pause = Pause() if row["batch"] in self.pause_at else None
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.sleep:
            time.sleep(self.sleep)
        if pause:
            pause.wait(Path(f"{self.release}.go.{row['batch']}"))

    def batch_start(self, state: State, logger: Logger) -> None:
        self.started = time.time()

    def fit_start(self, state: State, logger: Logger) -> None:
        self.planned = state.max_duration  # a preemption's stop_training() lowers max_duration
        _save_full_weights(state, os.environ.get("LLM_TEST_LOADED_WEIGHTS"))

    def fit_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) == 0:
            return
        if state.timestamp < self.planned:
            _save_full_weights(state, os.environ.get("LLM_TEST_STOP_WEIGHTS"))
        else:
            _save_full_weights(state, os.environ["LLM_TEST_WEIGHTS"])


def _guard_scores(state: State) -> dict | None:
    """The guard's measures of this batch's step (`Scores`, llm/callbacks/guard.py), if it judged one."""
    from dataclasses import asdict

    from llm.callbacks.guard import SpikeGuard

    guard = next((cb for cb in state.callbacks if isinstance(cb, SpikeGuard)), None)
    last = getattr(guard.detector, "last", None) if guard is not None else None
    return None if last is None else asdict(last)


def _settle_uploads(state: State) -> None:
    """Wait until the background upload in flight (if any) is stored and, on rank 0, complete."""
    for cb in state.callbacks:
        pending = getattr(getattr(cb, "uploader", None), "pending", None)
        if pending is not None:
            pending.finished.wait(300)


def _save_full_weights(state: State, path: str | None) -> None:
    if not path:
        return
    weights = full_weights(state)  # every rank takes part (FSDP gathers the shards)
    if dist.get_global_rank() == 0:
        torch.save(weights, path)


def full_weights(state: State) -> dict:
    if state.fsdp_enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(state.model, options=options)
    model = state.model.module if hasattr(state.model, "module") else state.model
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


class Pause:
    """Hold the process until SIGTERM/SIGINT (then passed to the handlers installed before) or a
    release file. The signals are caught from construction on, so one that arrives before `wait`
    (right after the batch's line was written) is not lost."""

    def __init__(self):
        self.arrived = threading.Event()
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in self.previous:
            signal.signal(sig, self._chained)

    def _chained(self, signum, frame) -> None:
        self.arrived.set()
        handler = self.previous[signum]
        signal.signal(signum, handler)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def wait(self, release: Path, limit: float = 300.0) -> None:
        deadline = time.monotonic() + limit
        try:
            while not self.arrived.is_set() and not release.exists() and time.monotonic() < deadline:
                self.arrived.wait(0.02)
        finally:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)


IMPORTED = STARTED
MILESTONES: dict[str, float] = {}


class LossSpike(Callback):
    """Multiplies the loss of chosen batches by a factor at AFTER_LOSS (before the backward pass):
    `{batch: factor}`, batch numbered as metrics.jsonl's steps; `nan` makes a non-finite step.
    A batch the guard skipped is never trained again, so its spike is not seen again."""

    def __init__(self, spikes: dict[int, float], rank: int | None = None):
        self.spikes = spikes
        self.rank = rank  # None: every rank

    @classmethod
    def from_env(cls, text: str, rank: str = "") -> LossSpike:
        pairs = (item.split(":") for item in text.split(",") if item.strip())
        return cls({int(batch): float(factor) for batch, factor in pairs}, int(rank) if rank else None)

    def after_loss(self, state: State, logger: Logger) -> None:
        factor = self.spikes.get(int(state.timestamp.batch) + 1)
        if factor is None or self.rank not in (None, dist.get_global_rank()):
            return
        if isinstance(state.loss, dict):
            state.loss = {**state.loss, "total": state.loss["total"] * factor}
        else:
            state.loss = state.loss * factor


class LearningRateSpike(Callback):
    """Multiplies the learning rate of the batches in [start, end) (data.skip's numbering: the
    batches after the first `start` up to batch `end`) by `factor`, at BATCH_START; the scheduler's
    next step sets the rate from the schedule again. A batch the guard skipped is never trained, so
    a rollback over the window leaves no trace of it."""

    def __init__(self, start: int, end: int, factor: float):
        self.start, self.end, self.factor = start, end, factor

    @classmethod
    def from_env(cls, text: str) -> LearningRateSpike:
        start, end, factor = text.split(":")
        return cls(int(start), int(end), float(factor))

    def batch_start(self, state: State, logger: Logger) -> None:
        if self.start <= int(state.timestamp.batch) < self.end:
            for optimizer in state.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.factor


class _StallingFile:
    """A checkpoint file being written that stalls once, in its second write: inside torch.save's
    zip records, where an exception leaves its writer unable to close the file."""

    def __init__(self, file, seconds: float, marker: Path):
        self._file, self._seconds, self._writes, self._marker = file, seconds, 0, marker

    def write(self, data):
        written = self._file.write(data)
        self._writes += 1
        if self._writes == 2:
            self._file.flush()
            self._marker.touch()
            time.sleep(self._seconds)
        return written

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


def _stall_checkpoint_writes(seconds: float, record: str) -> None:
    """Composer (checkpoint.snapshot: false) and the saver's background write open each checkpoint
    file with the `open` of their module: wrap both."""
    import builtins

    import composer.utils.checkpoint as composer_checkpoint

    import llm.checkpoint.saver as saver_module

    def stalling_open(file, mode="r", *args, **kwargs):
        opened = builtins.open(file, mode, *args, **kwargs)
        return (
            _StallingFile(opened, seconds, Path(f"{record}.stalling"))
            if "w" in mode and str(file).endswith(".pt")
            else opened
        )

    composer_checkpoint.open = stalling_open
    saver_module.open = stalling_open


def _hold_uploads(batch: int, record: str) -> None:
    """Wrap the storage layer's `upload` of both stores: hold the files of `batch` (see above)."""
    import storage.store as store_module

    marker, release = Path(f"{record}.uploading.{batch}"), Path(f"{record}.go.upload.{batch}")
    for cls in (store_module.LocalStore, store_module.S3Store):
        original = cls.upload

        def held(self, local, rel, _original=original):
            if f"-ba{batch}-" in rel or f"-ba{batch}/" in rel:
                marker.touch()
                while not release.exists():
                    time.sleep(0.02)  # the upload thread's wait; the training thread goes on
            return _original(self, local, rel)

        cls.upload = held


def _hold_writes(batch: int, record: str) -> None:
    """Wrap the `open` of the saver's background write: the file of `batch` is held after its first
    bytes (a partial file on disk, as a write cut short leaves), until released (see above)."""
    import builtins

    import llm.checkpoint.saver as saver_module

    marker, release = Path(f"{record}.writing.{batch}"), Path(f"{record}.go.write.{batch}")

    class HeldFile(_StallingFile):
        def write(self, data):
            written = self._file.write(data)
            self._writes += 1
            if self._writes == 2:
                self._file.flush()
                marker.touch()
                while not release.exists():
                    time.sleep(0.02)  # the upload thread's wait; the training thread goes on
            return written

    def held_open(file, mode="r", *args, **kwargs):
        opened = builtins.open(file, mode, *args, **kwargs)
        return HeldFile(opened, 0.0, marker) if "w" in mode and f"-ba{batch}-" in str(file) else opened

    saver_module.open = held_open


def main() -> int:
    global IMPORTED
    import llm.trainer  # noqa: F401  (the import cost, measured apart from the restart itself)
    import train

    IMPORTED = time.time()
    for name in filter(None, os.environ.get("LLM_TEST_LOG_INFO", "").split(",")):
        import logging

        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if os.environ.get("LLM_TEST_UPLOAD_HOLD"):
        _hold_uploads(int(os.environ["LLM_TEST_UPLOAD_HOLD"]), os.environ["LLM_TEST_RECORD"])
    if os.environ.get("LLM_TEST_WRITE_HOLD"):
        _hold_writes(int(os.environ["LLM_TEST_WRITE_HOLD"]), os.environ["LLM_TEST_RECORD"])
    if os.environ.get("LLM_TEST_SAVE_STALL"):
        _stall_checkpoint_writes(float(os.environ["LLM_TEST_SAVE_STALL"]), os.environ["LLM_TEST_RECORD"])
    extra = [_LazyRecorder()]
    if os.environ.get("LLM_TEST_SPIKE_AT"):
        extra.append(
            LossSpike.from_env(os.environ["LLM_TEST_SPIKE_AT"], os.environ.get("LLM_TEST_SPIKE_RANK", ""))
        )
    if os.environ.get("LLM_TEST_LR_SPIKE"):
        extra.append(LearningRateSpike.from_env(os.environ["LLM_TEST_LR_SPIKE"]))
    return train.main(sys.argv[1:], extra_callbacks=extra, owns_process=True)


class _LazyRecorder(Callback):
    """Builds the Recorder once the process group exists (the rank decides the file name)."""

    def __init__(self):
        self.inner: Recorder | None = None

    def init(self, state: State, logger: Logger) -> None:
        MILESTONES["trainer_init"] = time.time()
        self.inner = Recorder()

    def after_load(self, state: State, logger: Logger) -> None:
        MILESTONES["loaded"] = time.time()

    def fit_start(self, state: State, logger: Logger) -> None:
        MILESTONES["fit_start"] = time.time()
        self.inner.fit_start(state, logger)

    def batch_start(self, state: State, logger: Logger) -> None:
        self.inner.batch_start(state, logger)

    def batch_end(self, state: State, logger: Logger) -> None:
        self.inner.batch_end(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.inner.fit_end(state, logger)


if __name__ == "__main__":
    sys.exit(main())
