"""The rollback point: the state the guard (llm/callbacks/guard.py) goes back to after a spike.

`RollbackPoint` is the one interface: `restore(state, logger, at_most)` puts the model, the
optimizer, the learning-rate scheduler and the RNG back to the newest good state at or before batch
`at_most` this run can reach (the newest there is, when none is that old), on every rank, and
returns that state's batch and where it came from (`Restored`; None when there is none yet).
Nothing else is restored: the batch counter, the data position and the callbacks' state stay where
they are, because the data stream only moves forward (the guard's skip window starts at the
returned batch, llm/data/skip.py). Two implementations; `llm.trainer.rollback_point` chooses:

`HostSnapshot` (with `checkpoint.snapshot: true`, the default): the snapshot of the newest save,
still in host memory (`llm.checkpoint.saver.Saver.held`: the stager's buffers, kept until the next
save overwrites them; no second copy), loaded with no storage round trip. The snapshot is the dict
Composer writes to that checkpoint (`{"state": State.state_dict(), "rng": ...}`; a sharded save:
each rank's shards, as DTensors), copied at a batch boundary, so it is a valid rollback point from
the moment it is taken, written yet or not, and it is loaded as Composer loads that checkpoint
(`State.load_state_dict` on the same four parts, on every rank its own shards; then the RNG, every
rank's from rank 0, where a sharded save keeps them): the restored state is bit-identical to
loading the checkpoint from storage. The live state never shares memory with the snapshot: its
containers and non-tensor values are copied, the model's weights are copied into the parameters,
and an optimizer tensor that would be the buffer itself (torch's `Optimizer.load_state_dict` keeps
a tensor already on its parameter's device, as on the CPU) is cloned, so later steps cannot change
the snapshot that a second rollback or the background write still reads. Restores and saves both
run on the training thread, one save in flight at most (`CheckpointPublisher.make_room`), so no
save overwrites the buffers during a restore. The ranks agree first (`all_reduce`) that each
holds its part of the same save. It falls back to `NewestCheckpoint` when the snapshot is newer
than `at_most` (a `guard.rewind` longer than the save interval), when there is none yet (before
the first save of this process, e.g. right after a resume), and, saying why once, when not every
rank holds its part: a monolithic save on more than one rank (DDP) is staged on rank 0 only, an
HSDP save on the first replica's ranks only. Cost: a copy of the state from host memory (for the
7B recipe's 10 GB per rank, a host-to-device copy: about a second on a GPU).

`NewestCheckpoint`: the newest complete checkpoint in `checkpoint.save_folder` at or before
`at_most` that verifies, chosen as a resume chooses one (`resume.newest_usable_checkpoint`), and
loaded with Composer's own loader (monolithic or sharded, local or S3:
`composer.utils.checkpoint.load_checkpoint`, as the Trainer loads at start) with everything but
those four parts filtered out. Before choosing, each rank waits until its checkpoint upload in
flight, if any, is stored (`checkpoint.background_upload`), and the ranks meet: so every rank sees
the same newest checkpoint, and no checkpoint newer than the rollback point completes later (it
would hold training on batches the guard has just skipped; the snapshot needs no such wait: it is
the newest save, so no save newer than it is in flight). Cost: a load from storage (a download for
S3), seconds at the test scale, minutes for the 7B recipe's 84 GB.
"""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from composer.core import State
from composer.loggers import Logger
from composer.utils import dist, maybe_create_object_store_from_uri, parse_uri, reproducibility
from composer.utils.checkpoint import load_checkpoint

from llm.checkpoint.resume import newest_usable_checkpoint
from llm.checkpoint.saver import HeldSnapshot, Saver
from storage import open_store

log = logging.getLogger(__name__)

RESTORED = ("model", "optimizers", "schedulers")  # the parts of Composer's state a rollback loads
IN_MEMORY = "the snapshot in host memory"  # `Restored.source` of a restore from `HostSnapshot`


class Restored(NamedTuple):
    """What a rollback restored: the state after batch `batch`, from `source` (`IN_MEMORY`, or "the
    checkpoint " and its path in the save folder)."""

    batch: int
    source: str


class RollbackPoint(Protocol):
    """Where a rollback goes: the newest good training state (see the module docstring)."""

    def restore(self, state: State, logger: Logger, at_most: int) -> Restored | None:
        """Load the model, optimizer, scheduler and RNG of the newest good state at or before batch
        `at_most` (else the newest there is) into `state` on every rank (a collective: all ranks
        call it together); its batch and source, or None if there is none."""
        ...


class NewestCheckpoint:
    """The newest complete, verified checkpoint in `save_folder` (module docstring)."""

    def __init__(self, save_folder: str):
        self.save_folder = save_folder

    def restore(self, state: State, logger: Logger, at_most: int) -> Restored | None:
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
        where = point.checkpoint.load_path if point.checkpoint is not None else point.load_path
        return Restored(point.batch, f"the checkpoint {self.save_folder.rstrip('/')}/{where}")


class HostSnapshot:
    """The newest save's snapshot in host memory, else `fallback` (module docstring)."""

    def __init__(self, fallback: NewestCheckpoint):
        self.fallback = fallback
        self._said = False  # why the snapshot is not used on this run: said once

    def restore(self, state: State, logger: Logger, at_most: int) -> Restored | None:
        held = self._usable(state, at_most)
        if held is None:
            return self.fallback.restore(state, logger, at_most)
        snapshot = held.state_dict
        parts = {k: _containers_copied(v) for k, v in snapshot["state"].items() if k in RESTORED}
        state.load_state_dict(parts, logger)  # as Composer's loader does with the checkpoint's file
        _unshare(state, _storages(snapshot))
        rng = snapshot.get("rng")  # every rank's; a sharded save keeps them on rank 0 only
        if dist.get_world_size() > 1:
            shared = [rng]
            dist.broadcast_object_list(shared, src=0)
            rng = shared[0]
        if rng and len(rng) > dist.get_global_rank():
            reproducibility.load_rng_state(_containers_copied(rng))  # indexed by global rank inside
        log.info("rolled back to the snapshot in host memory at batch %d", held.batch)
        return Restored(held.batch, IN_MEMORY)

    def _usable(self, state: State, at_most: int) -> HeldSnapshot | None:
        """The saver's snapshot if every rank holds its part of the same save and it is at or
        before `at_most` (a collective on more than one rank: all take the same decision)."""
        saver = next((cb for cb in state.callbacks if isinstance(cb, Saver)), None)
        held = saver.held if saver is not None else None
        if dist.get_world_size() > 1:
            batch = held.batch if held is not None else -1
            both = state.device.tensor_to_device(torch.tensor([batch, -batch], dtype=torch.int64))
            dist.all_reduce(both, reduce_operation="MIN")
            oldest, newest = int(both[0].item()), -int(both[1].item())
            if newest < 0:  # no rank has saved yet (e.g. right after a resume)
                return None
            if oldest != newest:
                self._say_why_not()
                return None
        return held if held is not None and held.batch <= at_most else None

    def _say_why_not(self) -> None:
        if not self._said and dist.get_global_rank() == 0:
            print(
                "[guard] rolling back from checkpoints in storage, not the snapshot in host memory: "
                "not every rank holds its part of the last save (a monolithic save is staged on rank "
                "0 only, an HSDP save on the first replica's ranks; llm/checkpoint/rollback.py)",
                flush=True,
            )
        self._said = True


def _training_state_only(state_dict: dict[str, Any]) -> None:
    """Composer's `ignore_keys` hook: keep the model, optimizer and scheduler state (and the RNG)."""
    state_dict["state"] = {k: v for k, v in state_dict.get("state", {}).items() if k in RESTORED}
    for key in [k for k in state_dict if k not in ("state", "rng")]:
        del state_dict[key]


def _containers_copied(value: Any) -> Any:
    """`value` with its dicts, lists and tuples rebuilt and its other values deep-copied, its
    tensors kept: the live state then shares no mutable object with the snapshot but tensors."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: _containers_copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_containers_copied(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return copy.deepcopy(value)


def _storages(value: Any) -> set[int]:
    """The addresses of the memory the tensors in `value` hold (the snapshot's buffers)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return {local.untyped_storage().data_ptr()}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(v) for v in value))
    return set()


def _unshare(state: State, buffers: set[int]) -> None:
    """Clone each live tensor that is one of the snapshot's buffers: the optimizer's (on the CPU,
    torch's `Optimizer.load_state_dict` keeps a tensor already on its parameter's device) and, should
    a loader ever assign rather than copy, the model's."""
    for optimizer in state.optimizers:
        for values in optimizer.state.values():
            for name, value in values.items():
                if isinstance(value, torch.Tensor) and _storages(value) <= buffers:
                    values[name] = value.clone()
    for tensor in [*state.model.parameters(), *state.model.buffers()]:
        if _storages(tensor) <= buffers:
            tensor.data = tensor.data.clone()


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
