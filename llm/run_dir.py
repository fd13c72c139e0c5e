"""The run folder (`run_dir`): the one owner of its file names, and of its records beside the checkpoints.

`RunDir` names the files; every module that writes or reads one asks it (`RunDir(path).metrics`).
`RunRecords` keeps them beside the checkpoints, so that a resume on an empty machine continues them.
Checkpointing knows nothing of these files: the trainer hands it a `RunRecords` to `restore` at
start and to `save` with each checkpoint (`llm.checkpoint.records_hook.RunRecordsHook`).

The records are the files a person reads after a run, written to `run_dir` by the callbacks and
loggers: `config.yaml`, `metrics.jsonl`, `samples.jsonl`, `tasks.jsonl`, `loss.png`, and
`trackers.json` (the MLflow / W&B run ids, llm/loggers/tracker_ids.py). When `checkpoint.save_folder` is
remote, rank 0 stores them under `<save_folder>/records/` as part of every checkpoint save (before
the checkpoint's manifests, so a complete checkpoint always has records at least as new as itself)
and again at the end of the run.

At start, `restore(step)` brings them back and cuts them to the checkpoint the run resumes from:

- resuming at step N: the stored records replace the local ones (the bucket is the source of
  truth; a local folder may be missing or stale), then every line of the JSON-lines files whose
  `step` is past N is dropped: a run killed after its last checkpoint logged steps that the
  resumed run logs again. The run appends from there, so a run interrupted any number of times ends
  with exactly one line per logged step, as an uninterrupted run;
- starting fresh (step 0): the JSON-lines files and `trackers.json` of an earlier attempt are
  removed, locally only (the next save overwrites the stored copies).

With a local `save_folder` nothing is copied (run_dir is on the same machine), but the lines past
the resume step are cut all the same.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage import StorageError, Store, atomic_write_text, open_store

log = logging.getLogger(__name__)

RECORDS_DIR = "records"  # inside a checkpoint save folder
CONFIG = "config.yaml"  # the resolved, redacted recipe (llm.config.save_resolved)
METRICS = "metrics.jsonl"  # one line per logged step (llm/loggers/metrics_file.py)
SAMPLES = "samples.jsonl"  # generated samples (llm/callbacks/generation.py)
TASKS = "tasks.jsonl"  # task accuracies (llm/callbacks/task_eval.py)
LOSS_PLOT = "loss.png"  # the loss curves (llm/callbacks/loss_plot.py, llm.plots)
TRACKERS = "trackers.json"  # the MLflow / W&B run ids (llm/loggers/tracker_ids.py)
STORAGE_LOG = "storage-errors.log"  # tracebacks of failed downloads (llm/data/datasets.py); not a record
STEP_FILES = (METRICS, SAMPLES, TASKS)  # JSON lines, each with a "step"
# A line's mark for the step an interrupted process stopped at (between two logged steps): it shows
# where that attempt's checkpoint is until a resume, which drops it (`cut_after`) and logs on.
STOPPED = "stopped"
OTHER_FILES = (CONFIG, LOSS_PLOT, TRACKERS)
RECORD_FILES = (*STEP_FILES, *OTHER_FILES)


class RunDir:
    """The paths of one run folder's files."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def storage_log(self) -> Path:
        return self.root / STORAGE_LOG

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES

    @property
    def tasks(self) -> Path:
        return self.root / TASKS

    @property
    def loss_plot(self) -> Path:
        return self.root / LOSS_PLOT

    @property
    def trackers(self) -> Path:
        return self.root / TRACKERS


class RunRecords:
    """The record files of one run: `run_dir` on this machine, mirrored to `store`/records/ if given.

    `before_store` are called with the trainer's state before each store, in order: the trainer
    puts metrics.jsonl's flush of the current step first (Composer runs loggers after the other
    callbacks of an event, so the line of the step being saved is not written yet), then the loss
    plot's redraw. `for_run` builds the records of a run with its checkpoint `save_folder`.
    """

    def __init__(
        self,
        run_dir: str | Path,
        store: Store | None = None,
        before_store: list[Callable[[Any], object]] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.store = store
        self.before_store = list(before_store or [])
        self.stored = 0  # how many times the records were stored

    @classmethod
    def for_run(cls, run_dir: str | Path, save_folder: str | None) -> RunRecords:
        """The records of `run_dir`, mirrored beside the checkpoints when `save_folder` is remote."""
        store = open_store(save_folder) if save_folder else None
        return cls(run_dir, store if store is not None and store.is_remote else None)

    def save(self, state: Any = None) -> list[str]:
        """Store every record file that exists (rank 0); returns the names stored."""
        return self.snapshot(state)()

    def snapshot(self, state: Any = None) -> Callable[[], list[str]]:
        """Run the hooks (with the trainer's `state`) and read every record file now; the function
        returned stores what was read (rank 0; a checkpoint's upload thread calls it, while the
        files go on growing) and returns the names stored."""
        if self.store is None:
            return list
        for hook in self.before_store if state is not None else []:
            try:
                hook(state)
            except Exception as err:  # a plot that cannot be drawn must not fail a checkpoint
                log.warning("records: %s before storing failed: %s", getattr(hook, "__name__", hook), err)
        files = {
            name: (self.run_dir / name).read_bytes()
            for name in RECORD_FILES
            if (self.run_dir / name).is_file()
        }
        store = self.store

        def store_them() -> list[str]:
            for name, data in files.items():
                store.write_bytes(f"{RECORDS_DIR}/{name}", data)
            self.stored += 1
            return list(files)

        return store_them

    def save_quietly(self) -> None:
        """`save`, with a failure reported as one warning (the end of a run; the next save retries)."""
        try:
            self.save()
        except StorageError as err:
            log.warning("could not store the run records in %s: %s", self.store.url(RECORDS_DIR), err)
            print(f"[records] WARNING could not store the run records: {err}", flush=True)

    def restore(self, step: int) -> dict[str, int]:
        """Bring the records back for a run starting at `step` (see the module docstring).

        Returns, per JSON-lines file, how many lines it holds afterwards.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if step <= 0:
            for name in (*STEP_FILES, TRACKERS):
                (self.run_dir / name).unlink(missing_ok=True)
            return {}
        if self.store is not None:
            stored = self.store.list(f"{RECORDS_DIR}/")
            for name in RECORD_FILES:
                if f"{RECORDS_DIR}/{name}" in stored:
                    self.store.download(f"{RECORDS_DIR}/{name}", self.run_dir / name)
        return {name: cut_after(self.run_dir / name, step) for name in STEP_FILES}


def cut_after(path: Path, step: int) -> int:
    """Drop the lines of a JSON-lines file whose `step` is past `step`, those marked `STOPPED` (an
    earlier attempt's last step, not logged by an uninterrupted run) and torn lines; return the
    lines kept. The file is replaced atomically; an absent file stays absent."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill mid-write
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            if not row.get(STOPPED):
                kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return len(kept)
