"""Store each checkpoint Composer writes, then mark it complete; keep the newest `num_to_keep`.

Composer's `CheckpointSaver` writes the files (into a local staging folder when the recipe's
`save_folder` is on S3, straight into `save_folder` when it is local). This callback runs right
after it at the same event (it must come after the saver in the callback list), and on every rank:

1. uploads the files this rank wrote (retried by the store; the staging copy is then removed),
   and on rank 0 first the run's records (as read at the save) when the trainer gives them
   (`llm.run_dir.RunRecords` through `llm.checkpoint.records_hook.RunRecordsHook`: metrics, samples,
   plot, config beside the
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
the files locally on the training thread (the stall), the run's records are read into memory
(`RunRecords.snapshot`), and steps 1-2 run in this rank's upload thread (`llm.checkpoint.uploader`)
while training goes on; rank 0's thread moves `latest.json` and applies retention once every
writer's manifest is stored (step 4). At most one upload is in flight per rank: the next save
first waits for it (a log line says so), then the ranks agree on its outcome (step 3, on the
training thread) and a failure is raised there as the same one-line `StorageError`. With
`background_upload: false` the training thread waits for each upload at once; the job still runs
in its thread, so that every wait is bounded where it must be.

The end of a run (its last save, fit end, close) and the save on SIGTERM wait for the storage at
most `checkpoint.upload_wait_s` in all: one `Deadline`, started at the last save (or at the
signal), shared with the run lock's release. When it runs out at the end of training, the
one-line StorageError is the run's last line and the process gives its storage up
(`storage.s3.OUTAGES.close`: nothing waits or prints after it); on SIGTERM the preemption callback
says which checkpoint the next run resumes from (`StopSave`) and the process exits 143. A crash
with an upload in flight leaves that checkpoint without all its manifests: the previous complete
one stays the resume point, and the next run's start removes the unclaimed files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from llm.checkpoint import manifest as cm
from llm.checkpoint.local_copy import NodeCopy
from llm.checkpoint.preemption import (
    StopBudget,
    StopSave,
    Stored,
    preemption_callback,
    second_signal,
    signalled,
    stop_requested,
)
from llm.checkpoint.records_hook import RunRecordsHook
from llm.checkpoint.saver import DiskFull
from llm.checkpoint.schedule import SaveCosts
from llm.checkpoint.uploader import Deadline, Upload, Uploader, run_bounded
from storage import StorageError, Store
from storage.s3 import OUTAGES

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
        resumed_from: int | None = None,
        deadline: Deadline | None = None,
        costs: SaveCosts | None = None,
        when_busy: str = "wait",
        budget: StopBudget | None = None,
        copy: NodeCopy | None = None,
    ):
        self.store = store
        self.copy = copy  # this node's copy of the newest checkpoint (llm.checkpoint.local_copy)
        self.records = records  # stored by rank 0 with every checkpoint, before its manifests
        self.staging_root = Path(staging_root)
        self.num_to_keep = num_to_keep
        self.recipe = recipe
        self.background = background
        self.wait_limit_s = wait_limit_s
        self.deadline = deadline or Deadline()  # the end's one bound (shared with the run lock's release)
        self.costs = costs or SaveCosts(stall_s=0.0, background_s=0.0)  # measured here and by the saver
        self.when_busy = when_busy
        self.budget = budget or StopBudget(upload_wait_s=wait_limit_s)  # what a signal leaves
        self.uploader = Uploader()
        self.last_batch: int | None = None
        self.last_stored_at: float | None = None  # time.monotonic() of the last completed save
        self.completed: list[int] = []  # batches this process made complete (rank 0)
        self.newest_complete = resumed_from  # what the next run would resume from, as far as known here
        self._seen_saves = 0
        self._start_batch: int | None = None  # the batch this fit started at
        self._records_final = False
        self._abandoned: Upload | None = None  # an upload still running after the wait bound
        self._stop_reason = ""  # why the save on a signal was not stored
        self._bound_text = f"{wait_limit_s:g} s (checkpoint.upload_wait_s)"  # what the end's wait is
        # Once the process is ending at once (`exit_report`), no manifest is written any more: a save
        # cut short never becomes complete behind the line that says so.
        self._gate = threading.Lock()
        self._exiting = False
        self._manifest_writing: int | None = None  # the batch whose manifest is being written
        self._manifests: dict[int, int] = {}  # batch -> writers, of the manifests this rank stored

    def init(self, state: State, logger: Logger) -> None:
        check_order(state.callbacks)  # Event.INIT runs inside Trainer(): a wrong order fails there
        cb = preemption_callback(state)
        if cb is not None:
            cb.exit_report = self.exit_report

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start_batch = int(state.timestamp.batch)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.deadline.start(self.wait_limit_s)
        self._settle(state, final=True)
        self._bounded(self._remove_interrupted_saves)
        if self.copy is not None and not signalled(state):  # the run reached its end: no restart
            self.copy.remove()

    def close(self, state: State, logger: Logger) -> None:
        if second_signal(state):  # stop at once: drop the save in flight (its files go below)
            if self.uploader.pending is not None:
                self.uploader.pending.stop.set()
                self.uploader.pending = None
            self._bounded(self._remove_interrupted_saves)
            return
        self._finish_quietly()
        self._bounded(self._remove_interrupted_saves)
        # At close, not fit end: Composer runs the loggers' fit_end (metrics.jsonl's last line)
        # after the callbacks', and a run stopping on a signal exits inside fit_end.
        self._bounded(self._store_records_at_end)
        if self.store.is_remote and self._abandoned is None:
            shutil.rmtree(self.staging_root, ignore_errors=True)

    def _bounded(self, tidy) -> None:
        """Run one of the end's storage chores within the end's deadline (if it started); nothing
        once the storage was given up (the run's last line is printed: nothing may follow)."""
        if storage_closed():
            return
        if not run_bounded(tidy, self.deadline.left()):
            log.info("%s did not finish within checkpoint.upload_wait_s; left to the next run", tidy.__name__)

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
        final = self._start_end(state)
        self.last_batch = int(batch)
        write, saver.pending = saver_write(saver), None  # the snapshot to write first (the saver's)
        error, files, manifest, records = None, [], None, None
        try:
            new_paths = saver.saved_checkpoints[self._seen_saves :]
            self._seen_saves = len(saver.saved_checkpoints)
            if new_paths:
                if self.records is not None and dist.get_global_rank() == 0:
                    records = self.records.snapshot(state)  # stored before the manifests
                files, manifest = self._rank_files(state, new_paths[-1])
        except Exception as err:  # reported after the ranks agree, so no rank hangs in a collective
            error = err
        if not _all_ranks_ok(state, error is None):
            raise self._failure(self.last_batch, error)
        follow_up = None
        if dist.get_global_rank() == 0:
            writers = manifest.writers if manifest is not None else 1
            follow_up = functools.partial(self._complete_when_stored, writers=writers)
        self.uploader.start(
            self.last_batch, functools.partial(self._store, write, records, files, manifest), follow_up
        )
        if final or not self.background:
            stored = self._settle(state, final=final)
            if stop_requested(state):
                self._report_stop(state, self.last_batch, stored=stored, reason=self._stop_reason)
        else:
            log.info(
                "checkpoint at batch %d taken; writing and storing it in the background", self.last_batch
            )

    def make_room(self, state: State, batch: int) -> bool:
        """Before the saver takes a save at `batch` (every rank): at most one save in flight per
        rank, so the previous one is settled first, waiting for it or, with
        `checkpoint.when_busy: skip`, skipping this save with one line (never the last save). On a
        signal with `preemption.notice_s`, no save is started that cannot be stored within the
        notice: the one in flight is let finish if it can, and False. False: no save now."""
        final = self._start_end(state)
        if stop_requested(state) and not self._stop_save_fits(state, batch):
            return False
        upload = self.uploader.pending
        if upload is not None and self.when_busy == "skip" and not final:
            if _any_rank(state, not upload.finished.is_set()):
                if dist.get_global_rank() == 0:
                    print(
                        f"[checkpoint] skipping the save at batch {batch}: the checkpoint at batch "
                        f"{upload.batch} is still being written or stored (checkpoint.when_busy=skip)",
                        file=sys.stderr,
                        flush=True,
                    )
                return False
        # One save in flight per rank: the previous one settles first (at the end: within the bound).
        if not self._settle(state, next_save=batch, final=final):
            self._report_stop(state, batch, stored=False, reason=self._stop_reason)
            return False
        return True

    def _stop_save_fits(self, state: State, batch: int) -> bool:
        """With a notice: whether a save started now (after the one in flight) is projected to be
        stored before the notice, less its margin, runs out; every rank must agree. If not, the
        upload in flight is waited for within the notice, and the preemption line says why."""
        if self.budget.notice_s is None:
            return True
        cb = preemption_callback(state)
        since = cb.received_at if cb is not None and cb.received_at is not None else time.monotonic()
        left = since + self.budget.storage_s - time.monotonic()
        upload = self.uploader.pending
        ahead = 0.0
        if upload is not None and not upload.finished.is_set():
            ahead = max(0.0, self.costs.background_s - (time.monotonic() - upload.started))
        projected = ahead + self.costs.projected_s
        if _all_ranks_ok(state, projected <= left):
            return True
        reason = (
            f"no save started: it would take about {projected:.1f} s at this run's rates "
            f"({'measured' if self.costs.measured else 'estimated'}), more than the {max(left, 0):.1f} s "
            f"the {self.budget.notice_s:g} s notice leaves (preemption.notice_s less preemption.margin_s "
            "and the shutdown)"
        )
        if upload is not None and not self._settle(state, final=True):
            reason += f"; and {self._stop_reason}"
        self._report_stop(state, batch, stored=False, reason=reason, started=False)
        return False

    def _start_end(self, state: State) -> bool:
        """Whether this save is the run's last (the end of training, or on a signal); if so, start
        the end's deadline: `checkpoint.upload_wait_s` from now, or from the signal."""
        elapsed = state.get_elapsed_duration()
        if elapsed is None or not elapsed >= 1.0:
            return False
        cb = preemption_callback(state)
        if cb is not None and cb.stop_signal is not None:
            self._start_signal_deadline(cb.received_at)
        else:
            self.deadline.start(self.wait_limit_s)
        return True

    def _start_signal_deadline(self, since: float | None) -> None:
        """The end's deadline after a signal: what the signal leaves for storage (`StopBudget`)."""
        if self.deadline.at is None and self.budget.notice_s is not None:
            self._bound_text = self.budget.storage_text()
        self.deadline.start(self.budget.storage_s, since=since)

    def _store(self, write, records, files: list[Path], manifest: cm.Manifest | None) -> None:
        """The upload thread's job: the snapshot's write (the saver's), the run's records (rank 0),
        then this rank's files and manifest."""
        started = time.monotonic()
        if write is not None:
            write()
        if records is not None:
            records()
        digests = self._upload_rank_files(files)
        # What the next save will take (and what rank 0's manifest keeps for a resumed run's `auto`).
        self.costs.record(background_s=time.monotonic() - started)
        if files:
            self._write_manifest(files, manifest, digests)

    def _settle(self, state: State, *, next_save: int | None = None, final: bool = False) -> bool:
        """Wait for the pending upload (at the end: until the deadline), agree with the other ranks
        that theirs finished too, and see it complete on rank 0. On failure the one-line
        StorageError, except on a signal: False (the preemption line says what the next run does)."""
        upload = self.uploader.pending
        if upload is None:
            return True
        if next_save is not None and not upload.stored.is_set():
            log.warning(
                "checkpoint at batch %d waits for the upload of batch %d, still in flight after %.1f s "
                "(writing and storing a save take longer than checkpoint.save_interval; "
                "checkpoint.when_busy=skip skips a save instead)",
                next_save,
                upload.batch,
                time.monotonic() - upload.started,
            )
        stored = self._wait(upload.stored, state, final)
        if _all_ranks_ok(state, stored and upload.error is None):
            upload.all_stored.set()  # rank 0's thread moves latest.json without asking the store
            # Every writer's manifest is stored: the checkpoint is complete (resume reads the
            # manifests, not latest.json), whatever becomes of rank 0's follow-up below.
            self.newest_complete = upload.batch
            if dist.get_global_rank() == 0 and not self._wait(upload.finished, state, final):
                self._abandoned = upload  # latest.json and retention still running: left to the next save
                log.info("latest.json was not moved to batch %d within %s", upload.batch, self._bound_text)
            elif dist.get_global_rank() == 0 and upload.error is not None:
                log.warning("could not move latest.json to batch %d: %s", upload.batch, upload.error)
            self.uploader.pending = None
            return True
        reason = upload.error or (
            f"its upload did not finish within {self._bound_text}"
            if not stored
            else "another rank failed to store its part"
        )
        upload.stop.set()
        self.uploader.pending = None
        if not upload.finished.is_set():
            self._abandoned = upload  # still running: nothing of this run's saves is removed now
        failure = (
            upload.error
            if isinstance(upload.error, DiskFull)
            else self._failure(upload.batch, upload.error, reason)
        )
        if final:  # the end stopped waiting for the storage: nothing may wait on it, or print, after
            close_storage(f"the run stopped waiting for it at the end ({failure})")
        if stop_requested(state) or signalled(state):
            cb = preemption_callback(state)
            before = (
                ""
                if cb is None or upload.batch == cb.stop_batch
                else f"the checkpoint at batch {upload.batch} before it: "
            )
            self._stop_reason = f"{before}{_short(reason)}"
            return False
        raise failure

    def _wait(self, event: threading.Event, state: State, final: bool) -> bool:
        """Wait for `event`: at the end until the end's deadline; else until it is set, but once this
        rank caught a signal only until what the signal leaves for storage (the ranks agree on the
        stop only at the next batch's end: a save that waits for an upload must not hold it)."""
        if final:
            return event.wait(self.deadline.left())
        while not event.wait(0.1):
            cb = preemption_callback(state)
            if cb is not None and cb.received_at is not None:
                self._start_signal_deadline(cb.received_at)
                return event.wait(self.deadline.left())
        return True

    def exit_report(self, wait_until: float | None) -> Stored:
        """Asked by the preemption watchdog (another thread) as it ends the process at once: let the
        upload in flight finish until `wait_until` (None: not at all), then store nothing more (no
        manifest is written after this), remove this run's unfinished saves from a local folder,
        and say what is stored."""
        upload = self.uploader.pending
        if upload is not None and wait_until is not None:
            upload.finished.wait(max(0.0, wait_until - time.monotonic()))
        with self._gate:
            self._exiting = True
            writing = self._manifest_writing
        newest = self.newest_complete
        alone = [batch for batch, writers in self._manifests.items() if writers == 1]
        if alone and (newest is None or max(alone) > newest):
            newest = max(alone)  # its manifest is stored: complete (latest.json is only a pointer)
        cut = (
            upload.batch
            if upload is not None and upload.batch != newest and upload.batch != writing
            else None
        )
        if writing is None and not self.store.is_remote and dist.get_global_rank() == 0:
            with contextlib.suppress(Exception):  # the next start removes what is left
                self._remove_interrupted_saves()
        return Stored(newest, cut, writing)

    def _report_stop(
        self, state: State, batch: int, *, stored: bool, reason: str, started: bool = True
    ) -> None:
        """Tell the preemption callback what became of the save on the signal."""
        cb = preemption_callback(state)
        if cb is not None:
            cb.save_outcome = StopSave(batch, stored, self.newest_complete, reason, started)

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
        the other ranks may be gone; wait within the end's bound for this rank's own upload (rank 0:
        and for the other ranks' manifests, which its thread looks for, to complete it)."""
        upload = self.uploader.pending
        if upload is None:
            return
        self.deadline.start(self.wait_limit_s)
        if upload.finished.wait(self.deadline.left()):
            self.uploader.pending = None
            return
        upload.stop.set()
        if not storage_closed():
            self._abandon(upload, self.wait_limit_s)
        else:
            self._abandoned = upload

    def _failure(self, batch: int, error: BaseException | None, reason: Any = None) -> StorageError:
        where = f"{self.store.root} (batch {batch})"
        reason = reason or error or "another rank failed to store its part"
        which = (
            f"batch {self.newest_complete}"
            if self.newest_complete is not None
            else "none yet: the next run starts from scratch"
        )
        failure = StorageError(
            f"could not store checkpoint {where}: {reason}. The previous complete checkpoint "
            f"remains the resume point ({which}); fix the storage and rerun the same command."
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

    def _upload_rank_files(self, files: list[Path]) -> dict[str, cm.FileDigest]:
        digests = {}
        for path in files:
            rel = path.relative_to(self.staging_root).as_posix()
            digests[rel] = cm.file_digest(path)
            self.store.upload(path, rel)
        return digests

    def _write_manifest(
        self, files: list[Path], manifest: cm.Manifest, digests: dict[str, cm.FileDigest]
    ) -> None:
        costs = self.costs.record_of() if manifest.rank == 0 else None
        manifest = dataclasses.replace(manifest, files=digests, saved_at=time.time(), save_costs=costs)
        # The manifest goes last: its presence says the files above are completely stored. Not once
        # the process is ending at once (`exit_report`): the line it prints says this save was cut short.
        with self._gate:
            if self._exiting:
                raise StorageError(
                    f"the process is ending: the checkpoint at batch {manifest.batch} was cut short"
                )
            self._manifest_writing = manifest.batch
        try:
            self.store.write_text(cm.manifest_name(manifest.batch, manifest.rank), manifest.to_json())
            self._manifests[manifest.batch] = manifest.writers
        finally:
            self._manifest_writing = None
        if self.store.is_remote:  # stored: kept as this node's copy, or deleted
            if self.copy is not None and not manifest.sharded:
                self.copy.keep(files, self.staging_root)
            for path in files:
                path.unlink(missing_ok=True)

    def _complete_when_stored(self, upload: Upload, writers: int) -> None:
        """Rank 0's upload thread, after its own manifest: once every writer's manifest is stored
        (it looks in the store, or the training thread says the ranks agreed they are), move
        latest.json and apply retention. Returns early when `upload.stop` is set."""
        waiting = list(range(1, writers))
        while not upload.stop.is_set():
            if not upload.all_stored.is_set():
                waiting = [r for r in waiting if not self.store.exists(cm.manifest_name(upload.batch, r))]
            if upload.all_stored.is_set() or not waiting:
                self._complete(upload)
                return
            upload.all_stored.wait(0.5)

    def _complete(self, upload: Upload) -> None:
        self._move_latest(upload.batch)
        self._retain()
        upload.completed = True
        self.completed.append(upload.batch)
        self.newest_complete = upload.batch
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


def saver_write(saver: CheckpointSaver):
    """The write of the saver's snapshot (`llm.checkpoint.saver.Saver.pending`), if it took one."""
    pending = getattr(saver, "pending", None)
    return pending.write if pending is not None else None


def _any_rank(state: State, flag: bool) -> bool:
    return not _all_ranks_ok(state, not flag)


def _all_ranks_ok(state: State, ok: bool) -> bool:
    flag = state.device.tensor_to_device(torch.tensor([1 if ok else 0], dtype=torch.int32))
    dist.all_reduce(flag, reduce_operation="MIN")
    return bool(flag.item())


def close_storage(reason: str) -> None:
    """Every later storage request of this process fails at once and quietly (`storage.s3`)."""
    OUTAGES.close(reason)


def storage_closed() -> bool:
    return OUTAGES.closed is not None


def _short(reason: Any) -> str:
    """The first clause of a failure's reason, for the preemption line."""
    return str(reason).split("; ")[0]
