"""Saving a checkpoint: Composer decides when and names the files; this module takes a snapshot of
the state on the training thread and writes it in the background.

Composer's `CheckpointSaver` decides when to save (`checkpoint.save_interval`, through
`llm.checkpoint.schedule` for wall-clock and `auto` intervals; the end of training; a signal) and
names the files. Its own write, `composer.utils.checkpoint.save_checkpoint`, runs `torch.save` (a
sharded save: `torch.distributed.checkpoint.save`) on the training thread, so the step waits for
the whole local write: 42 s for the 7B recipe's 84 GB per node at 2 GB/s. `Saver` keeps
Composer's decision and file names and replaces the write (`checkpoint.snapshot: true`, the
default):

1. on the training thread: at most one save in flight per rank, so the previous save must be
   written and stored first (`checkpoint.when_busy`: wait for it, or skip this save, one line
   each: the publisher's `make_room`); then the dict Composer would write (`State.state_dict()`
   plus every rank's RNG state, `{"state": ..., "rng": ...}`) is copied into host memory by
   `HostStager`: torch.distributed.checkpoint's `BlockingAsyncStager` with its buffers allocated
   once and reused (pinned on a GPU, so the copy runs at the device-to-host rate); later steps
   cannot change what is written. That copy is the stall (`SaveCosts.stall_s`);
2. in this rank's upload thread (`llm.checkpoint.uploader`, started by the publisher right after):
   the snapshot is written with `torch.save` (monolithic, rank 0) or, for a sharded save, by
   `torch.distributed.checkpoint.async_save` (its thread, its staging through `HostStager`, over a
   gloo process group of the writing ranks of its own, so its collectives never race the training
   step's), to the same file names Composer uses; then it is stored and completed as before.

Each rank's newest snapshot stays in host memory until the next save overwrites its buffers
(`Saver.held`): the guard rolls back from it without reading storage (`llm.checkpoint.rollback`).
Restores and saves both run on the training thread, and the upload thread only reads the buffers,
so nothing overwrites them during a restore.

Composer loads these files as its own (same names, same dict). A process killed while a snapshot
is written leaves a file no manifest claims: the previous complete checkpoint is the resume point
and the next start removes the file. `checkpoint.snapshot: false` keeps Composer's own write on the
training thread (the previous behaviour; the benchmark's "background" mode).

Composer's `State.state_dict()` records its environment with every save (`composer_env_info`:
version, commit hash, CPU and GPU model), and finding the commit hash lists every file of the
installed package: 21 ms of the 29 ms the state dict took here, at every save, on the training
thread. The environment does not change within a process, so `Saver` has Composer compute it once
(`_env_once`, for Composer's own write too).

A full disk during the write, on either path, is one `StorageError` line naming the folder, the
space a checkpoint needs and the space left, and the checkpoint the next run resumes from; this
rank's partial file is removed (the fault used to surface as two tracebacks, ENOSPC and torch's
zip writer's "unexpected pos").
"""

from __future__ import annotations

import errno
import functools
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.core import state as composer_state
from composer.loggers import Logger
from composer.utils import checkpoint as composer_checkpoint
from composer.utils import dist, reproducibility
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from llm.checkpoint.schedule import SaveCosts
from llm.checkpoint.sizes import format_bytes
from llm.errors import NonFiniteStop
from storage import StorageError

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
log = logging.getLogger(__name__)


@dataclass
class PendingWrite:
    """A snapshot taken on the training thread, for the upload thread to write first."""

    batch: int
    path: Path  # this rank's file (a sharded save: its .distcp in the save's folder)
    write: Callable[[], None]


@dataclass
class HeldSnapshot:
    """This rank's newest snapshot (a sharded save: its shards), kept for the guard
    (`llm.checkpoint.rollback`). `state_dict` is what `HostStager.stage` returned: its tensors are
    the stager's buffers (no second copy), so it is valid until the next save overwrites them, and
    the saver replaces it then."""

    batch: int
    state_dict: dict[str, Any]


class Saver(CheckpointSaver):
    """`CheckpointSaver` that snapshots and writes in the background (module docstring).

    `need_bytes`: this rank's part of one checkpoint (what the start check asks room for);
    `publisher`: the `CheckpointPublisher` that follows it (one save in flight, the newest complete
    checkpoint); `costs`: where the measured stall goes (`llm.checkpoint.schedule`).
    """

    def __init__(
        self,
        *args: Any,
        need_bytes: int,
        publisher: Any = None,
        costs: SaveCosts | None = None,
        snapshot: bool = True,
        check_finite: bool = False,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        _env_once()
        self.need_bytes = need_bytes
        self.publisher = publisher
        self.costs = costs
        self.snapshot = snapshot
        self.check_finite = check_finite  # the guard is off: refuse to save non-finite weights
        self.stager = HostStager()
        self.pending: PendingWrite | None = None  # taken by the publisher at the same event
        self.held: HeldSnapshot | None = None  # this rank's newest snapshot: the guard's rollback point
        self._state_s = 0.0  # the last snapshot's time in Composer's state_dict (the rest: the copy)
        self._group: Any = None  # the gloo process group of a sharded save's writers

    def _save_checkpoint(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if self.check_finite and not _weights_finite(state):
            raise NonFiniteStop(
                f"[guard] the weights after batch {batch} are not finite (its loss was "
                f"{state.total_loss_dict.get('loss/train/total')}: its update made them so) with "
                f"guard.enabled=false: not saved; stopping with exit code {NonFiniteStop.EXIT_CODE}, the newest "
                "checkpoint is the last good state. Lower optimizer.lr, or set guard.enabled=true to skip "
                "non-finite steps and roll back spikes"
            )
        if self.publisher is not None and not self.publisher.make_room(state, batch):
            return  # skipped (checkpoint.when_busy: skip), or no time for it (preemption.notice_s)
        started = time.monotonic()
        if self.snapshot:
            self._snapshot(state)
        else:
            self._write_now(state, logger)
        stall = time.monotonic() - started
        if self.costs is not None:
            self.costs.record(stall_s=stall)
        what = (
            f"snapshot of {self.stager.nbytes / 1e6:.1f} MB (the state dict {self._state_s:.3f} s, the copy "
            f"{stall - self._state_s:.3f} s)"
            if self.snapshot
            else "written"
        )
        log.info("checkpoint at batch %d: %s on the training thread in %.3f s", batch, what, stall)

    def _write_now(self, state: State, logger: Logger) -> None:
        """Composer's own write, on the training thread (`checkpoint.snapshot: false`)."""
        try:
            super()._save_checkpoint(state, logger)
        except Exception as err:
            if not disk_full(err):
                raise
            raise self._disk_full(self._path(state), int(state.timestamp.batch)) from None

    def _path(self, state: State) -> Path:
        return Path(
            composer_checkpoint.get_save_filename(state, self.filename.format(state, keep_placeholders=True))
        )

    def _snapshot(self, state: State) -> None:
        """Step 1 of the module docstring: the same dict and file name as Composer's write."""
        self.last_checkpoint_batch = state.timestamp.batch
        path = self._path(state)
        self.all_saved_checkpoints_to_timestamp[str(path)] = state.timestamp
        started = time.monotonic()
        state_dict = {"state": state.state_dict(), "rng": reproducibility.get_rng_state()}
        self._state_s = time.monotonic() - started
        sharded = state.fsdp_sharded_state_dict_enabled
        if sharded and dist.get_global_rank() > 0:
            state_dict.pop("rng")  # as Composer: only rank 0 keeps the RNG states of a sharded save
        writers = _writing_ranks(state)
        if dist.get_global_rank() not in writers:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self.stager.staged = None
        if sharded:
            future = dcp.async_save(
                state_dict,
                storage_writer=_StagedWriter(path.parent, self.stager),
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                process_group=self._writers_group(writers),
            )
            write = future.result
        else:
            write = functools.partial(write_file, self.stager.stage(state_dict), path)
        if self.stager.staged is not None:  # staged just now (a sharded save: inside async_save)
            self.held = HeldSnapshot(int(state.timestamp.batch), self.stager.staged)
        self.saved_checkpoints.append(str(path))
        guarded = functools.partial(self._guarded, write, path, int(state.timestamp.batch))
        self.pending = PendingWrite(int(state.timestamp.batch), path, guarded)

    def _guarded(self, write: Callable[[], object], path: Path, batch: int) -> None:
        try:
            write()
        except Exception as err:
            if not disk_full(err):
                raise
            raise self._disk_full(path, batch) from None

    def _writers_group(self, writers: list[int]):
        """A gloo process group of the ranks that write a sharded save, made once by every rank."""
        if self._group is None:
            self._group = torch_dist.new_group(ranks=writers, backend="gloo")
        return self._group

    def fit_start(self, state: State, logger: Logger) -> None:
        super().fit_start(state, logger)
        if self.snapshot and state.fsdp_sharded_state_dict_enabled and dist.get_world_size() > 1:
            self._writers_group(_writing_ranks(state))  # every rank takes part, writer or not

    def _disk_full(self, path: Path, batch: int) -> StorageError:
        path.unlink(missing_ok=True)  # the partial file: nothing half-written is kept
        folder = next(p for p in [path.parent, *path.parents] if p.exists())
        resume = getattr(self.publisher, "newest_complete", None)
        keeps = (
            f"the checkpoint at batch {resume} remains the resume point"
            if resume is not None
            else "no checkpoint is complete yet: the next run starts from scratch"
        )
        return DiskFull(
            f"could not write the checkpoint at batch {batch} to {folder}: no space left on the device "
            f"(a checkpoint needs about {format_bytes(self.need_bytes)} on this rank, "
            f"{format_bytes(shutil.disk_usage(folder).free)} is free); the partial file was removed and "
            f"{keeps}; free some space or give checkpoint.save_folder (or checkpoint.staging_folder for "
            "an s3:// save) a larger disk, then rerun the same command"
        )


def _weights_finite(state: State) -> bool:
    """Whether every rank's parameters (its shards) are finite: one pass over them, one sync."""
    flags = [torch.isfinite(getattr(p, "_local_tensor", p).detach()).all() for p in state.model.parameters()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    flag = state.device.tensor_to_device(torch.tensor([int(bool(ok))], dtype=torch.int32))
    dist.all_reduce(flag, reduce_operation="MIN")
    return bool(flag.item())


def _env_once() -> None:
    """Make Composer's state dict look its environment up once per process (module docstring)."""
    if getattr(composer_state.get_composer_env_dict, "once", False):
        return
    env = functools.cache(composer_state.get_composer_env_dict)

    def once() -> dict:
        return dict(env())

    once.once = True  # type: ignore[attr-defined]
    composer_state.get_composer_env_dict = once


class DiskFull(StorageError):
    """A checkpoint could not be written: its disk is full. The message is the whole story."""


def write_file(state_dict: dict[str, Any], path: Path) -> None:
    """A monolithic checkpoint from its snapshot, as Composer writes one (`torch.save`)."""
    with open(path, "wb") as f:
        torch.save(state_dict, f)


def _writing_ranks(state: State) -> list[int]:
    """The ranks that write a file: rank 0 for a monolithic save; for a sharded one every rank, or
    with HSDP the first replica group (Composer's `save_checkpoint` skips the other replicas)."""
    if not state.fsdp_sharded_state_dict_enabled:
        return [0]
    mesh = state.device_mesh
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "data_parallel_replicate" in names:
        first = mesh.mesh.select(names.index("data_parallel_replicate"), 0)
        return [int(r) for r in first.flatten().tolist()]
    return list(range(dist.get_world_size()))


class HostStager(BlockingAsyncStager):
    """The state copied into host memory, into buffers allocated at the first save and reused.

    torch's `BlockingAsyncStager(cache_staged_state_dict=True)` does this for a plain state dict,
    but pins its buffers unconditionally (no pinned memory without a GPU) and type-checks every
    value for torch.distributed.checkpoint (Composer's dict holds timestamps, RNG tuples, numpy
    arrays). Here the buffers are pinned only on a GPU (the device-to-host copy then runs without
    a bounce buffer, `non_blocking`, one synchronize at the end), other values are deep-copied,
    and the buffers are made again when the dict's layout changes (a new optimizer state)."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True, type_check=False)
        self.pinned = torch.cuda.is_available()
        self.staged: dict[str, Any] | None = None  # what the last `stage` returned

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        cache = self.state_dict_cache
        if cache is None or not _same_layout(state_dict, cache):
            cache = self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self.pinned)
        if self.pinned:
            self.staged = _copy_state_dict(state_dict, cache, non_blocking=True, type_check=False)
            torch.cuda.synchronize()
            return self.staged
        # Host to host: one thread. torch splits each tensor's copy over its intra-op threads, and
        # with the cores busy a small copy then waits milliseconds for a thread to be scheduled
        # (measured here: median 19 ms with 2 threads, 3 ms with one, for a 10 MB state).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.staged = _copy_state_dict(state_dict, cache, type_check=False)
            return self.staged
        finally:
            torch.set_num_threads(threads)

    @property
    def nbytes(self) -> int:
        """The host memory its buffers hold."""
        total = 0

        def count(value: Any) -> None:
            nonlocal total
            if isinstance(value, torch.Tensor):
                local = getattr(value, "_local_tensor", value)
                total += local.numel() * local.element_size()
            elif isinstance(value, dict):
                for v in value.values():
                    count(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    count(v)

        count(self.state_dict_cache)
        return total


def _same_layout(state: Any, cache: Any) -> bool:
    """Whether `cache` has `state`'s keys, and tensors of its shapes and dtypes, where it has tensors.
    (torch's `_check_state_dict_similarity` copies every tensor into the cache while it looks.)"""
    if isinstance(state, torch.Tensor):
        ours = getattr(state, "_local_tensor", state)
        theirs = getattr(cache, "_local_tensor", cache)
        return isinstance(cache, torch.Tensor) and ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if isinstance(state, dict):
        return (
            isinstance(cache, dict)
            and state.keys() == cache.keys()
            and all(_same_layout(v, cache[k]) for k, v in state.items())
        )
    if isinstance(state, (list, tuple)):
        return (
            isinstance(cache, (list, tuple))
            and len(state) == len(cache)
            and all(_same_layout(a, b) for a, b in zip(state, cache, strict=True))
        )
    return not isinstance(cache, (torch.Tensor, dict, list, tuple))


class _StagedWriter(dcp.FileSystemWriter):
    """torch.distributed.checkpoint's file writer whose staging (`async_save` calls it on the
    training thread) is the saver's `HostStager`, buffers reused from save to save."""

    def __init__(self, path: Path, stager: HostStager):
        super().__init__(str(path))
        self._stager = stager

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._stager.stage(state_dict)


def disk_full(err: BaseException) -> bool:
    """Whether `err`, or what it replaced on the way up, says the disk (or the quota) is full."""
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        if isinstance(err, OSError) and err.errno in _FULL:
            return True
        # torch.distributed.checkpoint gathers every rank's failure: {rank: (exception, traceback)}
        if any(disk_full(f[0]) for f in (getattr(err, "failures", None) or {}).values()):
            return True
        seen.append(err)
        err = err.__cause__ or err.__context__
    return False
