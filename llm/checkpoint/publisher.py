"""Store each checkpoint Composer writes, then mark it complete; keep the newest `num_to_keep`.

Composer's `CheckpointSaver` writes the files (into a local staging folder when the recipe's
`save_folder` is on S3, straight into `save_folder` when it is local). This callback runs right
after it at the same event (it must come after the saver in the callback list), and on every rank:

1. uploads the files this rank wrote (retried by the store; the staging copy is then removed),
   and on rank 0 first the run's records when the trainer gives them (`llm.run_dir.RunRecords`
   through `llm.checkpoint.plan.RunRecordsHook`: metrics, samples, plot, config beside the
   checkpoints),
2. writes this rank's manifest (sizes + SHA-256 of those files) after its files are stored,
3. agrees with the other ranks that all of them succeeded (`all_reduce` MIN),
4. on rank 0 only: moves `latest.json` to this checkpoint, then deletes checkpoints beyond the
   newest `num_to_keep` complete ones (manifests first, so a half-deleted checkpoint is never
   taken for a complete one), across all earlier runs, not only this process's saves.

At fit end and at close (also after an error or a second signal that cut a save short), rank 0
deletes the files of this run's saves that no manifest claims (`remove_unclaimed`: a partial
`.pt`); at close rank 0 stores the records once more (what the end added: the last samples and
metrics line, the final plot), and every rank removes its private staging folder.

Uploads run on the training thread: a save blocks training until it is stored. That keeps the
order of steps simple and makes a checkpoint written on preemption durable before the process
exits.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from llm.checkpoint import manifest as cm
from storage import StorageError, Store

log = logging.getLogger(__name__)


class CheckpointPublisher(Callback):
    def __init__(
        self,
        store: Store,
        staging_root: str,
        num_to_keep: int,
        recipe: dict[str, Any] | None = None,
        records: Any = None,  # llm.checkpoint.plan.RunRecordsHook
    ):
        self.store = store
        self.records = records  # stored by rank 0 with every checkpoint, before its manifests
        self.staging_root = Path(staging_root)
        self.num_to_keep = num_to_keep
        self.recipe = recipe
        self.last_batch: int | None = None
        self.last_stored_at: float | None = None  # time.monotonic() of the last completed save
        self._seen_saves = 0
        self._start_batch: int | None = None  # the batch this fit started at
        self._records_final = False

    def init(self, state: State, logger: Logger) -> None:
        check_order(state.callbacks)  # Event.INIT runs inside Trainer(): a wrong order fails there

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start_batch = int(state.timestamp.batch)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._remove_interrupted_saves()

    def close(self, state: State, logger: Logger) -> None:
        self._remove_interrupted_saves()
        # At close, not fit end: Composer runs the loggers' fit_end (metrics.jsonl's last line)
        # after the callbacks', and a run stopping on a signal exits inside fit_end.
        self._store_records_at_end()
        if self.store.is_remote:
            shutil.rmtree(self.staging_root, ignore_errors=True)

    def _store_records_at_end(self) -> None:
        if self.records is not None and dist.get_global_rank() == 0 and not self._records_final:
            self._records_final = True
            self.records.save_quietly()

    def _remove_interrupted_saves(self) -> None:
        # Once (fit_end, or close after an error or a signal), while the run lock is still held:
        # it is given back after this callback at both events.
        if self._start_batch is None or dist.get_global_rank() != 0:
            return
        start, self._start_batch = self._start_batch, None
        try:
            remove_unclaimed(self.store, after_batch=start)
        except StorageError as err:  # the next run's start removes them
            log.warning("could not remove the files of an interrupted save from %s: %s", self.store.root, err)

    # Composer saves at one of these events; publish right after, at the same one.
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish_new_save(state)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish_new_save(state)

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish_new_save(state)

    def _publish_new_save(self, state: State) -> None:
        saver = _find_saver(state)
        batch = saver.last_checkpoint_batch
        # Every rank sees the same `last_checkpoint_batch`, so all of them reach the collective below.
        if batch is None or int(batch) == self.last_batch:
            return
        self.last_batch = int(batch)
        start = time.monotonic()
        error = None
        try:
            new_paths = saver.saved_checkpoints[self._seen_saves :]
            self._seen_saves = len(saver.saved_checkpoints)
            if new_paths:
                if self.records is not None and dist.get_global_rank() == 0:
                    self.records.save(state)  # before the manifests: a complete checkpoint has its records
                self._store_rank_files(state, new_paths[-1])
        except Exception as err:  # reported after the ranks agree, so no rank hangs in a collective
            error = err
        if not _all_ranks_ok(state, error is None):
            where = f"{self.store.root} (batch {self.last_batch})"
            reason = error or "another rank failed to store its part"
            raise StorageError(
                f"could not store checkpoint {where}: {reason}. The previous complete checkpoint "
                "remains the resume point; fix the storage and rerun the same command."
            ) from error
        if dist.get_global_rank() == 0:
            self._move_latest(state)
            self._retain()
        self.last_stored_at = time.monotonic()
        log.info(
            "checkpoint at batch %d stored in %s (%.2f s)",
            self.last_batch,
            self.store.root,
            time.monotonic() - start,
        )

    def _store_rank_files(self, state: State, saved_path: str) -> None:
        rank = dist.get_global_rank()
        sharded = state.fsdp_sharded_state_dict_enabled
        files = [Path(saved_path)]
        if sharded and rank == 0:
            files.append(Path(saved_path).parent / ".metadata")
        records = {}
        for path in files:
            rel = path.relative_to(self.staging_root).as_posix()
            records[rel] = cm.file_digest(path)
            self.store.upload(path, rel)
        load_target = Path(saved_path).parent if sharded else Path(saved_path)
        manifest = {
            "batch": self.last_batch,
            "rank": rank,
            "writers": _sharded_writers(state) if sharded else 1,
            "world_size": dist.get_world_size(),
            "sharded": sharded,
            "load_path": load_target.relative_to(self.staging_root).as_posix(),
            "files": records,
            "timestamp": {k: int(getattr(state.timestamp, k)) for k in ("epoch", "batch", "sample", "token")},
            "saved_at": time.time(),
        }
        if rank == 0:
            manifest["recipe"] = self.recipe
        # The manifest goes last: its presence says the files above are completely stored.
        self.store.write_text(cm.manifest_name(self.last_batch, rank), cm.dumps(manifest))
        if self.store.is_remote:
            for path in files:
                path.unlink(missing_ok=True)

    def _move_latest(self, state: State) -> None:
        ckpts, _ = cm.scan(self.store)
        current = next((c for c in ckpts if c.batch == self.last_batch), None)
        if current is None or not current.complete:
            raise StorageError(
                f"checkpoint at batch {self.last_batch} has no complete manifests in {self.store.root}"
            )
        pointer = {
            "batch": current.batch,
            "load_path": current.load_path,
            "uri": self.store.url(current.load_path),
        }
        self.store.write_text(cm.LATEST, cm.dumps(pointer))

    def _retain(self) -> None:
        if self.num_to_keep < 0:
            return
        ckpts, _ = cm.scan(self.store)
        complete = [c for c in ckpts if c.complete]
        if not complete:
            return
        keep = {c.batch for c in complete[: self.num_to_keep]}
        newest = complete[0].batch
        # Older than what we keep: complete ones past the count, and leftovers of interrupted saves.
        doomed = [c for c in ckpts if c.batch not in keep and c.batch < newest]
        for ckpt in doomed:
            self.store.delete([cm.manifest_name(ckpt.batch, m["rank"]) for m in ckpt.manifests])
            self.store.delete(sorted(ckpt.files))
            log.info("deleted old checkpoint at batch %d from %s", ckpt.batch, self.store.root)


def remove_unclaimed(store: Store, after_batch: int | None = None) -> list[str]:
    """Delete checkpoint files no manifest claims (`manifest.unclaimed_files`); return their names.

    Only while this run holds the folder's run lock: nobody else is saving there.
    """
    doomed = cm.unclaimed_files(store.list(), after_batch)
    if doomed:
        store.delete(doomed)
        if not store.is_remote:  # the folder of a sharded save, once empty
            for folder in {Path(store.root, rel).parent for rel in doomed} - {Path(store.root)}:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        log.warning("removed %s of an interrupted save from %s", ", ".join(doomed), store.root)
    return doomed


def _sharded_writers(state: State) -> int:
    """Ranks that write a sharded checkpoint: all of them, or with HSDP the first replica group
    (global ranks 0 .. shard size - 1; Composer's `save_checkpoint` skips the other replicas)."""
    mesh = state.device_mesh
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "data_parallel_replicate" in names:
        return mesh.size(names.index("data_parallel_shard"))
    return dist.get_world_size()


def _find_saver(state: State) -> CheckpointSaver:
    for cb in state.callbacks:
        if isinstance(cb, CheckpointSaver):
            return cb
    raise RuntimeError("CheckpointPublisher needs a CheckpointSaver before it in the callback list")


def check_order(callbacks: list) -> None:
    """Raise if the publisher does not come right after Composer's saver (see the module docstring)."""
    kinds = [type(cb) for cb in callbacks]
    if CheckpointPublisher not in kinds:
        return
    at = kinds.index(CheckpointPublisher)
    if at == 0 or not isinstance(callbacks[at - 1], CheckpointSaver):
        raise RuntimeError(
            "callback order: CheckpointPublisher must come right after Composer's CheckpointSaver "
            "(build them with llm.checkpoint.plan_checkpointing)"
        )


def _all_ranks_ok(state: State, ok: bool) -> bool:
    flag = state.device.tensor_to_device(torch.tensor([1 if ok else 0], dtype=torch.int32))
    dist.all_reduce(flag, reduce_operation="MIN")
    return bool(flag.item())
