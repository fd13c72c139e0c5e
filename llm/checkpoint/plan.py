"""The one entry point of checkpointing: `plan_checkpointing(cfg, ...)`, called before the Trainer.

It checks that `save_folder` can take a checkpoint, takes the folder's run lock on rank 0
(`llm.checkpoint.lock`: one run per folder), decides where training starts
(`llm.checkpoint.resume`) and builds the callbacks that save, publish, hold the lock and handle
preemption, in the only order that works:

  Saver (Composer's CheckpointSaver, saver.py) -> CheckpointPublisher -> RunLockCallback (rank 0)
  -> RestartTimings -> PreemptionCallback

The publisher stores what the saver just wrote, at the same event, so it must follow it; the lock
is released after the publisher's last tidying at fit end and close; the preemption callback exits
the process at `fit_end`, so every other callback must have run before it. `CheckpointPlan.callbacks_after(others)` is the only way the trainer adds them, and
both callbacks check their place again when the Trainer is built (Composer's Event.INIT), so a
wrong order fails at once instead of at the first save or the first SIGTERM.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from llm import startup
from llm.checkpoint import restart
from llm.checkpoint.local_copy import node_copy
from llm.checkpoint.lock import RunLock, RunLockHeld
from llm.checkpoint.preemption import StopBudget
from llm.checkpoint.records_hook import RunRecordsHook
from llm.checkpoint.resume import (
    ResumePoint,
    announce,
    check_load_path_allowed,
    choose_resume_point,
    refuse_optimizer_group_change,
    remove_stale_composer_copy,
    stop_if_complete,
    warn_recipe_changes,
)
from llm.checkpoint.schedule import SaveCosts, save_interval
from llm.checkpoint.sizes import (
    CHECKPOINT_BYTES_PER_PARAM,
    DEFAULT_DISK_BANDWIDTH,
    DEFAULT_SNAPSHOT_BANDWIDTH,
    DEFAULT_UPLOAD_BANDWIDTH,
    checkpoint_bytes,
    format_bytes,
    parse_bandwidth,
)
from llm.checkpoint.uploader import Deadline, run_bounded
from llm.config import TrainConfig
from llm.errors import ConfigError
from llm.model import count_params
from storage import StorageError, Store, open_store
from storage.s3 import OUTAGES
from storage.scratch import make_process_folder, remove_at_exit, remove_dead_process_folders

CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPlan:
    """Where to start, the Trainer arguments that say so, and the checkpointing callbacks in order."""

    resume: ResumePoint
    trainer_kwargs: dict[str, Any]
    # (CheckpointSaver, CheckpointPublisher, RunLockCallback?)? + (RestartTimings, PreemptionCallback)
    callbacks: tuple

    def callbacks_after(self, others: Sequence) -> list:
        """`others` followed by this plan's callbacks; refuses checkpointing callbacks in `others`."""
        from composer.callbacks import CheckpointSaver

        from llm.checkpoint.preemption import PreemptionCallback
        from llm.checkpoint.publisher import CheckpointPublisher

        ours = (
            CheckpointSaver,
            CheckpointPublisher,
            RunLockCallback,
            RestartTimings,
            PreemptionCallback,
        )
        stray = [type(cb).__name__ for cb in others if isinstance(cb, ours)]
        if stray:
            raise ValueError(f"{', '.join(stray)} must come from plan_checkpointing, not the callback list")
        return [*others, *self.callbacks]


def plan_checkpointing(
    cfg: TrainConfig, *, rank: int, world_size: int, records: RunRecordsHook | None = None
) -> CheckpointPlan:
    """Check the checkpoint settings, choose the resume point and build the callbacks (every rank).

    - `checkpoint.num_to_keep` and the load-path safety rule (ConfigError: a `load_path` outside
      `save_folder` needs `checkpoint.allow_untrusted_load_path: true`, because Composer 0.32.1
      unpickles checkpoints);
    - rank 0 checks that this node's memory holds a checkpoint's snapshots (`checkpoint.snapshot`),
      that `save_folder` can be written and has room for `num_to_keep` + 1 checkpoints, and takes
      its run lock (RunLockHeld, naming the holder, if another run has it); every rank learns
      the outcome, so all of them stop together;
    - deletes the stale `./s3:/<bucket>/...` copy Composer's autoresume leaves in the working
      directory, so it can never shadow a newer remote checkpoint, and (rank 0) the files of an
      interrupted save that no manifest claims;
    - with autoresume (on when `run_name` and `save_folder` are set) takes the newest complete
      checkpoint that verifies (`newest_usable_checkpoint`), else `checkpoint.load_path`, and says
      which; raises RunAlreadyComplete when that checkpoint already reached max_duration;
    - warns about every recipe value that differs from the checkpoint's recipe (docs/resume.md);
    - (rank 0) asks `records` (the trainer's, `llm.run_dir.RunRecords`) to bring the run's records
      back from beside the checkpoints and cut them to the resume step, or to clear them for a
      fresh start; the publisher then stores them with every checkpoint.

    The lock is released again if anything here fails; once the Trainer runs, its callback holds it.
    """
    from llm.checkpoint.preemption import PreemptionCallback

    ck = cfg.checkpoint
    if ck.num_to_keep == 0 or ck.num_to_keep < -1:
        raise ConfigError(
            f"checkpoint.num_to_keep={ck.num_to_keep}: keep at least 1 checkpoint, or -1 for all"
        )
    check_load_path_allowed(cfg)
    lock = take_run_lock(cfg, rank=rank, world_size=world_size) if ck.save_folder else None
    try:
        point = _starting_point(cfg, rank, world_size, records)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    restart.mark("checkpoint")

    kwargs: dict[str, Any] = {
        "save_folder": None,  # saving is done by the saver below, not by Composer's own
        "autoresume": False,  # the resume point above replaces Composer's autoresume
        "save_overwrite": True,
        "load_path": point.load_path,
        "load_weights_only": point.weights_only,
    }
    deadline = Deadline()  # the end's one bound on storage, shared by the publisher and the lock
    budget = StopBudget(cfg.preemption.notice_s, cfg.preemption.margin_s, ck.upload_wait_s)  # a signal's
    held = (RunLockCallback(lock, deadline),) if lock is not None else ()
    resumed_from = point.batch if point.source == "autoresume" else None
    # What the run before measured of its saves and steps (recorded with the checkpoint): `auto`
    # saves at the steady interval from the first step, the notice's projection is this run's.
    carried = SaveCosts.from_record(point.checkpoint.head.save_costs, point.batch) if resumed_from else None
    costs = None
    if ck.save_folder:  # then measured, save by save
        costs = carried or estimated_costs(cfg, world_size, open_store(ck.save_folder).is_remote)
    saving = (
        _saving_callbacks(cfg, rank, world_size, records, resumed_from, deadline, budget, costs)
        if costs is not None
        else ()
    )
    timings = RestartTimings(resumed_from, costs)
    callbacks = (*saving, *held, timings, PreemptionCallback(budget=budget))
    return CheckpointPlan(resume=point, trainer_kwargs=kwargs, callbacks=callbacks)


def _starting_point(
    cfg: TrainConfig, rank: int, world_size: int, records: RunRecordsHook | None
) -> ResumePoint:
    ck = cfg.checkpoint
    if ck.save_folder:
        remove_stale_composer_copy(ck.save_folder)
        if rank == 0:  # under the run lock: nobody else is saving there
            from llm.checkpoint.publisher import remove_unclaimed

            remove_unclaimed(open_store(ck.save_folder))
    point = choose_resume_point(cfg, rank=rank)
    if rank == 0:
        announce(cfg, point, world_size)
    stop_if_complete(cfg, point)
    saved = point.checkpoint.recipe if point.checkpoint is not None else None
    if saved:
        current = cfg.to_dict(redact=True)
        if point.source == "autoresume" or (point.source == "load_path" and not point.weights_only):
            refuse_optimizer_group_change(saved, current)  # the optimizer state is loaded
        if rank == 0:
            warn_recipe_changes(saved, current)
    if records is not None and rank == 0 and point.source != "load_path":
        records.restore(point.batch or 0)  # metrics, samples ... continue from the resume point
    return point


class RunLockCallback(Callback):
    """Holds the run lock (`llm.checkpoint.lock`) while the Trainer runs, on rank 0: checked after
    every batch, released at fit end and at close (which also follows an error or a signal),
    within the end's `deadline` (a storage that hangs must not hold the end of the run); once the
    storage was given up at the end, not at all (the next run takes the lease over)."""

    def __init__(self, lock: RunLock, deadline: Deadline | None = None):
        self.lock = lock
        self.deadline = deadline or Deadline()

    def batch_end(self, state: State, logger: Logger) -> None:
        self.lock.check()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._release()

    def close(self, state: State, logger: Logger) -> None:
        self._release()

    def _release(self) -> None:
        if OUTAGES.closed is not None or not run_bounded(self.lock.release, self.deadline.left()):
            self.lock.abandon()


def take_run_lock(cfg: TrainConfig, *, rank: int, world_size: int) -> RunLock | None:
    """Rank 0: check `save_folder` (`check_save_folder`) and take its run lock, returned; other
    ranks get None. If rank 0 fails, every rank raises the same error (one broadcast)."""
    lock, failure, error = None, [None], None
    if rank == 0:
        store = open_store(cfg.checkpoint.save_folder)
        try:
            check_host_memory(cfg, world_size)
            check_save_folder(cfg, store, world_size)
            try:
                lock = RunLock(store, cfg.run_name).acquire()
            except StorageError as err:  # the lease is the first write: the folder refuses writes
                if store.is_remote:
                    raise
                raise _unwritable(cfg, err) from None
        except (ConfigError, StorageError) as err:
            failure, error = [(type(err).__name__, str(err))], err
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is None:
        return lock
    if error is not None:
        raise error
    kind, message = failure[0]
    raise {"RunLockHeld": RunLockHeld, "StorageError": StorageError}.get(kind, ConfigError)(message)


def check_save_folder(cfg: TrainConfig, store: Store, world_size: int = 1) -> None:
    """ConfigError if a local `save_folder` cannot be written, or if the disk a checkpoint is first
    written to has less free space than this rank's checkpoints need there at the least: in a
    local save_folder `checkpoint.num_to_keep` of them plus the one being written (the oldest goes
    only after it), less what the folder's files already take; in the staging folder an S3 save is
    written to first, this rank's part of one (two with background uploads: one uploading while
    the next is written). Or if that folder cannot be written."""
    need = checkpoint_bytes(count_params(cfg.model).total)
    copies, held, why = 1, 0, ""
    if store.is_remote:
        where = staging_parent(cfg)
        if cfg.fsdp.enabled and cfg.fsdp.state_dict_type == "sharded":
            need //= world_size  # each rank stages only its shard
        if cfg.checkpoint.background_upload:
            copies, why = 2, "one uploading in the background while the next is written"
        what = (
            f"checkpoint.staging_folder={where}"
            if cfg.checkpoint.staging_folder
            else f"the temp folder {where} (where an S3 save is staged; set checkpoint.staging_folder)"
        )
        _check_staging_writable(cfg, where)
    else:
        try:
            store.check_writable()
        except StorageError as err:
            raise _unwritable(cfg, err) from None
        root = Path(store.root).absolute()
        where = next(p for p in [root, *root.parents] if p.exists())
        what = f"checkpoint.save_folder={cfg.checkpoint.save_folder}"
        keep = cfg.checkpoint.num_to_keep
        if keep > 0:
            copies, why = keep + 1, f"checkpoint.num_to_keep={keep} kept and the next one being written"
        held = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0
    free = shutil.disk_usage(where).free
    if free < copies * need - held:
        times = f" x {copies}: {why}" if copies > 1 else ""
        less = f", less the {format_bytes(held)} its files take now" if held else ""
        raise ConfigError(
            f"{what} has {format_bytes(free)} free, but this rank's checkpoints need at least "
            f"{format_bytes(copies * need - held)} there ({format_bytes(need)}{times}{less}; "
            f"{CHECKPOINT_BYTES_PER_PARAM} bytes per parameter: fp32 weights and AdamW's two moments); "
            "free some space or choose another folder"
        )


def check_host_memory(cfg: TrainConfig, world_size: int, available: int | None = None) -> None:
    """ConfigError if this node's writing ranks' snapshots (`checkpoint.snapshot`: each its part of
    a checkpoint, in host memory) do not fit the node's memory as the recipe gives it
    (`checkpoint.node_memory_gb`), or the memory it has available now (`available`, default
    /proc/meminfo's MemAvailable; not known: not checked)."""
    if not cfg.checkpoint.snapshot:
        return
    per_rank = rank_checkpoint_bytes(cfg, world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    writers = min(local, world_size) if _sharded(cfg) else 1
    need = per_rank * writers
    fix = (
        "shard the checkpoint over more ranks (fsdp.state_dict_type: sharded), or set "
        "checkpoint.snapshot=false (the step then waits for the local write)"
    )
    taken = (
        f"checkpoint.snapshot: the snapshots of a checkpoint take {format_bytes(need)} of host memory on "
        f"this node ({writers} writing rank(s), {format_bytes(per_rank)} each)"
    )
    node = cfg.checkpoint.node_memory_gb
    if node is not None and need > node * 1e9:
        raise ConfigError(f"{taken}, more than the node's {node:g} GB (checkpoint.node_memory_gb); {fix}")
    available = available if available is not None else memory_available()
    if available is not None and need > available:
        raise ConfigError(f"{taken}, but it has {format_bytes(available)} available; free memory, {fix}")


def memory_available() -> int | None:
    """Bytes of memory this machine can give now (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def staging_parent(cfg: TrainConfig) -> Path:
    """The folder each rank's private staging folder for an S3 save is made in."""
    return Path(cfg.checkpoint.staging_folder or tempfile.gettempdir())


STAGING_PREFIX = "llm-ckpt-rank"  # + "<rank>-<pid>-<random>": one staging folder per rank and process


def make_staging_folder(cfg: TrainConfig, rank: int) -> Path:
    """This rank's private staging folder for an S3 save, after removing those of killed runs
    (`storage.scratch`: a SIGKILLed run cannot remove its own, 10 GB per rank at 7B)."""
    parent = staging_parent(cfg)
    for gone in remove_dead_process_folders(rf"{STAGING_PREFIX}\d+-", parent):
        log.info("removed %s, the staging folder of a run that was killed", gone)
    return make_process_folder(f"{STAGING_PREFIX}{rank}-", parent)


def _check_staging_writable(cfg: TrainConfig, where: Path) -> None:
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".llm-staging-probe-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"checkpoint.staging_folder={where} cannot be written ({err.strerror or err}); fix its "
            "permissions or point checkpoint.staging_folder at a local disk that can hold a checkpoint"
        ) from None


def _unwritable(cfg: TrainConfig, err: StorageError) -> ConfigError:
    return ConfigError(
        f"checkpoint.save_folder={cfg.checkpoint.save_folder} cannot be written ({err}); fix its "
        "permissions or choose another folder"
    )


def _saving_callbacks(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    records: RunRecordsHook | None,
    resumed_from: int | None,
    deadline: Deadline,
    budget: StopBudget,
    costs: SaveCosts,
) -> tuple:
    from llm.checkpoint.publisher import CheckpointPublisher
    from llm.checkpoint.saver import Saver

    ck = cfg.checkpoint
    store = open_store(ck.save_folder)
    # Remote: Composer writes into a private staging folder that the publisher uploads and empties.
    staging = str(make_staging_folder(cfg, rank)) if store.is_remote else ck.save_folder
    if store.is_remote:  # emptied by each upload; the folder itself goes when the process ends
        remove_at_exit(staging)
    publisher = CheckpointPublisher(
        store,
        staging,
        ck.num_to_keep,
        recipe=cfg.to_dict(redact=True),
        records=records,
        background=ck.background_upload,
        wait_limit_s=ck.upload_wait_s,
        resumed_from=resumed_from,
        deadline=deadline,
        costs=costs,
        when_busy=ck.when_busy,
        budget=budget,
        copy=node_copy(cfg),
    )
    saver = Saver(
        folder=staging,
        filename=CHECKPOINT_FILENAME,
        remote_file_name=None,
        latest_filename=None,
        latest_remote_file_name=None,
        save_interval=save_interval(cfg, costs),
        overwrite=True,
        num_checkpoints_to_keep=-1,  # the publisher keeps num_to_keep across runs, not per process
        need_bytes=rank_checkpoint_bytes(cfg, world_size),
        publisher=publisher,
        costs=costs,
        snapshot=ck.snapshot,
        check_finite=not cfg.guard.enabled,  # the guard never applies a non-finite update
    )
    return saver, publisher


def rank_checkpoint_bytes(cfg: TrainConfig, world_size: int) -> int:
    """What one checkpoint takes on this rank's disk (and in its snapshot) at the least (a sharded
    save: its shard)."""
    need = checkpoint_bytes(count_params(cfg.model).total)
    return need // world_size if _sharded(cfg) else need


def _sharded(cfg: TrainConfig) -> bool:
    return cfg.fsdp.enabled and cfg.fsdp.state_dict_type == "sharded"


def estimated_costs(cfg: TrainConfig, world_size: int, remote: bool) -> SaveCosts:
    """A save's stall and background seconds before one is measured (`llm.checkpoint.schedule`):
    this rank's part at the default snapshot rate, the node's at the default disk and upload rates."""
    per_rank = rank_checkpoint_bytes(cfg, world_size)
    per_node = per_rank * (
        min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), world_size) if _sharded(cfg) else 1
    )
    write_s = per_node / parse_bandwidth(DEFAULT_DISK_BANDWIDTH)
    upload_s = per_node / parse_bandwidth(DEFAULT_UPLOAD_BANDWIDTH) if remote else 0.0
    if cfg.checkpoint.snapshot:
        return SaveCosts(
            stall_s=per_rank / parse_bandwidth(DEFAULT_SNAPSHOT_BANDWIDTH), background_s=write_s + upload_s
        )
    return SaveCosts(stall_s=write_s, background_s=upload_s)


class RestartTimings(Callback):
    """Marks Composer's events and prints the `[restart]` line (rank 0) at the first step of a
    run that resumed from `resumed_at` (None: a fresh start, nothing printed), and gives the
    restart's seconds to `costs` (`SaveCosts.restart_s`: `auto`'s line and the manifests)."""

    def __init__(self, resumed_at: int | None, costs: SaveCosts | None = None):
        self.resumed_at = resumed_at
        self.costs = costs
        self._printed = False

    def init(self, state: State, logger: Logger) -> None:
        restart.mark("trainer_init")

    def before_load(self, state: State, logger: Logger) -> None:
        restart.mark("before_load")

    def after_load(self, state: State, logger: Logger) -> None:
        restart.mark("loaded")

    def after_dataloader(self, state: State, logger: Logger) -> None:
        restart.mark("first_batch")

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._printed:
            return
        self._printed = True
        restart.mark("first_step")
        startup.settled()  # the collector back on, the start's objects frozen (llm/startup.py)
        if self.resumed_at is None:
            return
        took = restart.total_s()
        if self.costs is not None and took is not None:
            self.costs.restart_s = took
        if dist.get_global_rank() == 0:
            print(restart.describe(self.resumed_at), flush=True)
