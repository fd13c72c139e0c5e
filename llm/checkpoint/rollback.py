"""The rollback point: the state the guard (llm/callbacks/guard.py) goes back to after a spike.

`RollbackPoint` is the one interface: `restore(state, logger, at_most)` puts the model, the
optimizer, the learning-rate scheduler and the RNG back to the newest good state at or before batch
`at_most` this run can reach (the newest there is, when none is that old), on every rank, and
returns that state's batch (None when there is none yet). Nothing else is restored: the
batch counter, the data position and the callbacks' state stay where they are, because the data
stream only moves forward (the guard's skip window starts at the returned batch, llm/data/skip.py).

`NewestCheckpoint` is the implementation used today: the newest complete checkpoint in
`checkpoint.save_folder` at or before `at_most` that verifies, chosen as a resume chooses one
(`resume.newest_usable_checkpoint`), and loaded with Composer's own loader (monolithic or sharded,
local or S3: `composer.utils.checkpoint.load_checkpoint`, as the Trainer loads at start) with
everything but those four parts filtered out. Before choosing, each rank waits until its
checkpoint upload in flight, if any, is stored (`checkpoint.background_upload`), and the ranks meet:
so every rank sees the same newest checkpoint, and no checkpoint newer than the rollback point
completes later (it would hold training on batches the guard has just skipped). Cost: a load
from storage (a download for S3), seconds at the test scale, minutes for the 7B recipe's 84 GB.

Where a host-memory copy of the state taken at each checkpoint save exists (the preemption
snapshot, issue 32), it is a second `RollbackPoint` with no storage round trip: the guard takes
whichever `llm.trainer.rollback_point` builds, and nothing else changes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

from composer.core import State
from composer.loggers import Logger
from composer.utils import dist, maybe_create_object_store_from_uri, parse_uri, reproducibility
from composer.utils.checkpoint import load_checkpoint

from llm.checkpoint.resume import newest_usable_checkpoint
from storage import open_store

log = logging.getLogger(__name__)

RESTORED = ("model", "optimizers", "schedulers")  # the parts of Composer's state a rollback loads


class RollbackPoint(Protocol):
    """Where a rollback goes: the newest good training state (see the module docstring)."""

    def restore(self, state: State, logger: Logger, at_most: int) -> int | None:
        """Load the model, optimizer, scheduler and RNG of the newest good state at or before batch
        `at_most` (else the newest there is) into `state` on every rank (a collective: all ranks
        call it together); its batch, or None if there is none."""
        ...


class NewestCheckpoint:
    """The newest complete, verified checkpoint in `save_folder` (module docstring)."""

    def __init__(self, save_folder: str):
        self.save_folder = save_folder

    def restore(self, state: State, logger: Logger, at_most: int) -> int | None:
        _wait_for_uploads(state)
        rank = dist.get_global_rank()
        point = newest_usable_checkpoint(self.save_folder, rank=rank, at_most=at_most)
        if point is None:  # none that old: the newest there is
            point = newest_usable_checkpoint(self.save_folder, rank=rank)
        if point is None:
            return None
        object_store = maybe_create_object_store_from_uri(point.load_path)
        _, _, path = parse_uri(point.load_path)
        rng = load_checkpoint(
            path,
            state,
            logger,
            object_store=object_store,
            progress_bar=False,
            ignore_keys=_training_state_only,
        )
        if rng and len(rng) > rank:
            reproducibility.load_rng_state(rng)  # indexed by global rank inside
        _remove_local_copy(self.save_folder, point.load_path, point.checkpoint)
        log.info("rolled back to the checkpoint at batch %d: %s", point.batch, point.load_path)
        return point.batch


def _training_state_only(state_dict: dict[str, Any]) -> None:
    """Composer's `ignore_keys` hook: keep the model, optimizer and scheduler state (and the RNG)."""
    state_dict["state"] = {k: v for k, v in state_dict.get("state", {}).items() if k in RESTORED}
    for key in [k for k in state_dict if k not in ("state", "rng")]:
        del state_dict[key]


def _wait_for_uploads(state: State) -> None:
    """Every rank: wait until its checkpoint upload in flight (if any) has stored its files and
    manifest; then meet, so that every writer's manifest is in place before anyone scans."""
    from llm.checkpoint.publisher import CheckpointPublisher

    for callback in state.callbacks:
        upload = callback.uploader.pending if isinstance(callback, CheckpointPublisher) else None
        if upload is not None:  # bounded: every request of the storage layer has its timeouts
            upload.stored.wait()
    dist.barrier()


def _remove_local_copy(save_folder: str, load_path: str, checkpoint: Any) -> None:
    """A monolithic S3 checkpoint is verified in a local copy (`resume._verified_load_path`): once
    loaded, delete it now rather than at exit (each rollback would keep one)."""
    store = open_store(save_folder)
    if not store.is_remote or checkpoint is None or checkpoint.sharded or "://" in load_path:
        return
    root = load_path[: -len(checkpoint.load_path)].rstrip("/")
    if root and Path(root).name.startswith("llm-resume-rank"):
        shutil.rmtree(root, ignore_errors=True)
