"""Store each checkpoint Composer writes, then mark it complete; keep the newest `num_to_keep`.

Composer's `CheckpointSaver` writes the files (into a local staging folder when the recipe's
`save_folder` is on S3, straight into `save_folder` when it is local). This callback runs right
after it at the same event (it must come after the saver in the callback list), and on every rank:

1. uploads the files this rank wrote (retried by the store; the staging copy is then removed),
   and on rank 0 first the run's records when the trainer gives them (`llm.run_dir.RunRecords`
   through `llm.checkpoint.records_hook.RunRecordsHook`: metrics, samples, plot, config beside the
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

Uploads run in the background (`checkpoint.background_upload`, on by default): Composer writes
the files locally on the training thread (the stall), steps 1-2 run in this rank's upload thread
(`llm.checkpoint.uploader`) while training goes on, and rank 0's thread moves `latest.json` and
applies retention once every writer's manifest is stored (step 4). At most one upload is in flight
per rank: the next save first waits for it (a log line says so), then the ranks agree on its
outcome (step 3, on the training thread) and a failure is raised there as the same one-line
`StorageError`, as it is at fit end. Fit end and close wait for a pending upload at most
`checkpoint.upload_wait_s` seconds, with one line when that bound is hit. The save written on
SIGTERM is stored on the training thread, as every save is with `background_upload: false`, so it
is durable before the process exits. A crash with an upload in flight leaves that checkpoint
without all its manifests: the previous complete one stays the resume point, and the next run's
start removes the unclaimed files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from llm.checkpoint.preemption import stop_requested
from llm.checkpoint.records_hook import RunRecordsHook
from llm.checkpoint.uploader import Upload, Uploader
from storage import StorageError, Store

log = logging.getLogger(__name__)


class CheckpointPublisher(Callback):
    def __init__(
        self,
        store: Store,
        staging_root: str,
        num_to_keep: int,
        recipe: dict[str, Any] | None = None,
        records: RunRecordsHook | None = None,
        *,
        background: bool = True,
        wait_limit_s: float = 600.0,
    ):
        self.store = store
        self.records = records  # stored by rank 0 with every checkpoint, before its manifests
        self.staging_root = Path(staging_root)
        self.num_to_keep = num_to_keep
        self.recipe = recipe
        self.background = background
        self.wait_limit_s = wait_limit_s
        self.uploader = Uploader()
        self.last_batch: int | None = None
        self.last_stored_at: float | None = None  # time.monotonic() of the last completed save
        self.completed: list[int] = []  # batches this process made complete (rank 0)
        self._seen_saves = 0
        self._start_batch: int | None = None  # the batch this fit started at
        self._records_final = False
        self._abandoned: Upload | None = None  # an upload still running after the wait bound

    def init(self, state: State, logger: Logger) -> None:
        check_order(state.callbacks)  # Event.INIT runs inside Trainer(): a wrong order fails there

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start_batch = int(state.timestamp.batch)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._settle(state, limit=self.wait_limit_s)
        self._remove_interrupted_saves()

    def close(self, state: State, logger: Logger) -> None:
        self._finish_quietly()
        self._remove_interrupted_saves()
        # At close, not fit end: Composer runs the loggers' fit_end (metrics.jsonl's last line)
        # after the callbacks', and a run stopping on a signal exits inside fit_end.
        self._store_records_at_end()
        if self.store.is_remote and self._abandoned is None:
            shutil.rmtree(self.staging_root, ignore_errors=True)

    def _store_records_at_end(self) -> None:
        if self.records is not None and dist.get_global_rank() == 0 and not self._records_final:
            self._records_final = True
            self.records.save_quietly()

    def _remove_interrupted_saves(self) -> None:
        # Once (fit_end, or close after an error or a signal), while the run lock is still held:
        # it is given back after this callback at both events. Not while an upload still runs.
        if self._start_batch is None or dist.get_global_rank() != 0 or self._abandoned is not None:
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
        # Every rank sees the same `last_checkpoint_batch`, so all of them reach the collectives below.
        if batch is None or int(batch) == self.last_batch:
            return
        stopping = stop_requested(state)  # a SIGTERM save: stored before the process exits
        # One upload in flight per rank: the previous one settles first (bounded on SIGTERM).
        self._settle(state, next_save=int(batch), limit=self.wait_limit_s if stopping else None)
        self.last_batch = int(batch)
        error, files, manifest = None, [], None
        try:
            new_paths = saver.saved_checkpoints[self._seen_saves :]
            self._seen_saves = len(saver.saved_checkpoints)
            if new_paths:
                if self.records is not None and dist.get_global_rank() == 0:
                    self.records.save(state)  # before the manifests: a complete checkpoint has its records
                files, manifest = self._rank_files(state, new_paths[-1])
        except Exception as err:  # reported after the ranks agree, so no rank hangs in a collective
            error = err
        if not _all_ranks_ok(state, error is None):
            raise self._failure(self.last_batch, error)
        background = self.background and not stopping
        follow_up = None
        if dist.get_global_rank() == 0:
            writers = manifest.writers if manifest is not None else 1
            follow_up = functools.partial(self._complete_when_stored, writers=writers)
        store_files = (lambda: self._store_rank_files(files, manifest)) if files else (lambda: None)
        self.uploader.start(self.last_batch, store_files, follow_up, background=background)
        if background:
            log.info("checkpoint at batch %d written locally; storing it in the background", self.last_batch)
        else:
            self._settle(state)

    def _settle(self, state: State, *, next_save: int | None = None, limit: float | None = None) -> None:
        """Wait for the pending upload (at most `limit` s), agree with the other ranks that theirs
        finished too, and make the checkpoint complete on rank 0 if its thread has not; else raise
        the one-line StorageError."""
        upload = self.uploader.pending
        if upload is None:
            return
        if next_save is not None and not upload.stored.is_set():
            log.warning(
                "checkpoint at batch %d waits for the upload of batch %d, still in flight after %.1f s "
                "(uploads take longer than checkpoint.save_interval)",
                next_save,
                upload.batch,
                time.monotonic() - upload.started,
            )
        stored = upload.stored.wait(limit)
        if not stored:
            self._abandoned = upload  # still running: nothing of this run's saves is removed now
        if not _all_ranks_ok(state, stored and upload.error is None):
            upload.stop.set()
            self.uploader.pending = None
            reason = upload.error or (
                f"its upload did not finish within {limit:g} s (checkpoint.upload_wait_s)"
                if not stored
                else "another rank failed to store its part"
            )
            raise self._failure(upload.batch, upload.error, reason)
        self.uploader.finish()  # rank 0: its thread stops waiting for the others' manifests
        if dist.get_global_rank() == 0 and upload.batch not in self.completed:
            self._complete(upload)

    def _abandon(self, upload: Upload, limit: float) -> None:
        self._abandoned = upload
        print(
            f"[checkpoint] the upload of the checkpoint at batch {upload.batch} did not finish within "
            f"{limit:g} s (checkpoint.upload_wait_s); exiting without it: the newest complete "
            "checkpoint stays the resume point",
            flush=True,
        )

    def _finish_quietly(self) -> None:
        """At close (after an error or a signal, when fit end did not settle): no collective, as
        the other ranks may be gone; wait at most the bound for this rank's own upload."""
        upload = self.uploader.pending
        if upload is None:
            return
        if not upload.stored.wait(self.wait_limit_s):
            self._abandon(upload, self.wait_limit_s)
            return
        self.uploader.finish(self.wait_limit_s)  # rank 0: completes it if every manifest is there

    def _failure(self, batch: int, error: BaseException | None, reason: Any = None) -> StorageError:
        where = f"{self.store.root} (batch {batch})"
        reason = reason or error or "another rank failed to store its part"
        failure = StorageError(
            f"could not store checkpoint {where}: {reason}. The previous complete checkpoint "
            "remains the resume point; fix the storage and rerun the same command."
        )
        failure.__cause__ = error
        return failure

    def _rank_files(self, state: State, saved_path: str) -> tuple[list[Path], cm.Manifest]:
        """This rank's files of the save and its manifest but the files' digests (taken now, on
        the training thread: the upload thread never reads the training state)."""
        rank = dist.get_global_rank()
        sharded = state.fsdp_sharded_state_dict_enabled
        files = [Path(saved_path)]
        if sharded and rank == 0:
            files.append(Path(saved_path).parent / ".metadata")
        load_target = Path(saved_path).parent if sharded else Path(saved_path)
        manifest = cm.Manifest(
            batch=self.last_batch,
            rank=rank,
            writers=_sharded_writers(state) if sharded else 1,
            world_size=dist.get_world_size(),
            sharded=sharded,
            load_path=load_target.relative_to(self.staging_root).as_posix(),
            timestamp={k: int(getattr(state.timestamp, k)) for k in ("epoch", "batch", "sample", "token")},
            recipe=self.recipe if rank == 0 else None,
        )
        return files, manifest

    def _store_rank_files(self, files: list[Path], manifest: cm.Manifest) -> None:
        records = {}
        for path in files:
            rel = path.relative_to(self.staging_root).as_posix()
            records[rel] = cm.file_digest(path)
            self.store.upload(path, rel)
        manifest = dataclasses.replace(manifest, files=records, saved_at=time.time())
        # The manifest goes last: its presence says the files above are completely stored.
        self.store.write_text(cm.manifest_name(manifest.batch, manifest.rank), manifest.to_json())
        if self.store.is_remote:
            for path in files:
                path.unlink(missing_ok=True)

    def _complete_when_stored(self, upload: Upload, writers: int) -> None:
        """Rank 0's upload thread, after its own manifest: once every writer's manifest is stored,
        move latest.json and apply retention. Returns early when `upload.stop` is set (the training
        thread then agrees with the ranks and completes the checkpoint itself)."""
        waiting = list(range(1, writers))
        while True:
            waiting = [r for r in waiting if not self.store.exists(cm.manifest_name(upload.batch, r))]
            if not waiting:
                self._complete(upload)
                return
            if upload.stop.wait(0.5):
                return

    def _complete(self, upload: Upload) -> None:
        self._move_latest(upload.batch)
        self._retain()
        self.completed.append(upload.batch)
        self.last_stored_at = time.monotonic()
        log.info(
            "checkpoint at batch %d stored in %s (%.2f s after the save)",
            upload.batch,
            self.store.root,
            self.last_stored_at - upload.started,
        )

    def _move_latest(self, batch: int) -> None:
        ckpts, _ = cm.scan(self.store)
        current = next((c for c in ckpts if c.batch == batch), None)
        if current is None or not current.complete:
            raise StorageError(f"checkpoint at batch {batch} has no complete manifests in {self.store.root}")
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
            self.store.delete([cm.manifest_name(ckpt.batch, m.rank) for m in ckpt.manifests])
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
