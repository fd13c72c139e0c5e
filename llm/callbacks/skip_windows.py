"""`SkipWindowsCallback`: the skip windows in the trainer, in checkpoints and in the run records.

The windows and their numbering are `llm/data/skip.py`'s: data batches in sample order, dropped
by the training loader (`SkippingLoader`), counted as steps. This callback keeps the trainer's
batch counter (Composer's timestamp: batch, sample, token and their in-epoch counts) equal to the
number of data batches consumed:

- at FIT_START it tells the loader where the data resumes (the checkpoint's batch; 0 fresh), and
  marks the train dataset as resuming itself (`state.dataset_resumption`), so that Composer never
  "spins" its loader past batches on its own once the counter has moved over a window;
- at AFTER_DATALOADER, when the loader dropped batches before the one about to train, it moves the
  counter over them, each counted as one global batch of samples and tokens (the batch's own
  size, as Composer counts it); at EPOCH_END likewise over the dropped tail of an epoch;
- at BATCH_END (after the guard, which may have just added a window) and at FIT_START, when every
  batch left up to `max_duration` is skipped, it moves the counter to the end, and training ends.

So the counter, the learning-rate schedule (a function of the counter), `max_duration`, the
checkpoints' sample position and metrics.jsonl's steps all treat a skipped batch as a step, in a
run told `data.skip` from the start and in one whose guard added the window alike.

The windows are this callback's checkpoint state (Composer stores every callback's `state_dict`
in its checkpoints), so a resume keeps the guard's windows; the recipe's `data.skip` is added to
them. Rank 0 also writes the run's `config.yaml` again with `data.skip` holding every window, so
the run records say which batches were never trained on, and that file starts a run that skips
the same batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from llm.config import TrainConfig, save_resolved
from llm.data.skip import SkippingLoader
from llm.run_dir import RunDir


class SkipWindowsCallback(Callback):
    def __init__(self, loader: SkippingLoader, cfg: TrainConfig):
        self.loader = loader
        self.windows = loader.windows
        self.cfg = cfg
        self._recorded = cfg.data.skip

    def fit_start(self, state: State, logger: Logger) -> None:
        state.dataset_resumption["train"] = True
        self.loader.next_index = int(state.timestamp.batch)
        self._record()
        self._end_if_the_rest_is_skipped(state)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._advance(state, self.loader.next_index - 1)

    def epoch_end(self, state: State, logger: Logger) -> None:
        # Composer has already moved the counter to the next epoch: the dropped tail counts in the
        # totals only, not in the new epoch's (from which a resume takes its sample position).
        self._advance(state, self.loader.next_index, in_epoch=False)

    def batch_end(self, state: State, logger: Logger) -> None:
        self._end_if_the_rest_is_skipped(state)

    def add(self, start: int, end: int) -> None:
        """A new window (from the guard): dropped from the next batch on, recorded in config.yaml."""
        if self.windows.add(start, end):
            self._record()

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.as_lists()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for start, end in state.get("windows", []):
            self.windows.add(start, end)

    def _advance(self, state: State, index: int, in_epoch: bool = True) -> None:
        """Move the batch counter forward to data batch `index`, over the batches dropped before it
        (`in_epoch`: in the current epoch, so its in-epoch counts move too)."""
        dropped = index - int(state.timestamp.batch)
        if dropped <= 0:
            return
        samples, tokens = _global_batch_size(state)
        timestamp = state.timestamp
        if in_epoch:
            for _ in range(dropped):
                timestamp = timestamp.to_next_batch(samples=samples, tokens=tokens)
        else:
            timestamp = timestamp.copy(
                batch=int(timestamp.batch) + dropped,
                sample=int(timestamp.sample) + dropped * samples,
                token=int(timestamp.token) + dropped * tokens,
                token_in_iteration=int(timestamp.token_in_iteration) + dropped * tokens,
            )
        state.timestamp = timestamp

    def _end_if_the_rest_is_skipped(self, state: State) -> None:
        end = int(state.max_duration.value) if state.max_duration is not None else None
        now = int(state.timestamp.batch)
        if end is not None and now < end and self.windows.covers(self.loader.next_index, end):
            self._advance(state, end)

    def _record(self) -> None:
        """Rank 0: config.yaml with data.skip = every window, when that changed."""
        windows = self.windows.as_lists()
        if windows == self._recorded or dist.get_global_rank() != 0:
            return
        self._recorded = windows
        data = dataclasses.replace(self.cfg.data, skip=windows)
        save_resolved(dataclasses.replace(self.cfg, data=data), RunDir(Path(self.cfg.run_dir)).config)


def _global_batch_size(state: State) -> tuple[int, int]:
    """(samples, tokens) of one global batch, as Composer counts them: the rank's batch (about to
    train, or just trained) times the world size; else from the counter's own average."""
    batch = state.batch
    if isinstance(batch, dict) and "input_ids" in batch:
        ids = batch["input_ids"]
        world = dist.get_world_size()
        return int(ids.shape[0]) * world, int(ids.numel()) * world
    done = max(1, int(state.timestamp.batch))
    return int(state.timestamp.sample) // done, int(state.timestamp.token) // done
