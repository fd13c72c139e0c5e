"""One checkpoint's upload at a time per rank, in a thread, and the one bound on the end's waits.

`llm.checkpoint.publisher` hands each save's work (store this rank's files, then its manifest;
on rank 0 also wait for the other ranks' manifests and move `latest.json`) to `Uploader.start`,
and settles it at the next save and at the end. Nothing here talks to the other ranks: the
publisher agrees on the outcome with one collective on the training thread (collectives on a
second thread would race the training step's). The job always runs in its thread, also for a
synchronous save (`checkpoint.background_upload: false`, the training thread then waits for it
at once) and for the last save of a run or the one on SIGTERM: so every wait of the training
thread on storage is bounded, and a storage that hangs cannot hold the end of a run longer than
`checkpoint.upload_wait_s` (`Deadline`, shared with the run lock's release).

Why not Composer's own: `CheckpointSaver(remote_file_name=...)` uploads in the background through
`composer.utils.remote_uploader.RemoteUploader`, a pool of spawned processes using Composer's
object stores. Those bypass `storage` (its client, timeouts, retry policy, outage budget and
one-line errors), and report completion only in bulk at `fit_end` (`RemoteUploader.wait`), while
a manifest must be written right after this rank's files are stored, per checkpoint. A thread is
enough: uploading is socket I/O and hashing (`hashlib` releases the GIL on large buffers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Upload:
    """One checkpoint's upload on this rank: `stored` is set once this rank's files and manifest
    are stored (or failed: `error`); `finished` once the whole job, rank 0's follow-up (moving
    latest.json, retention) included, has returned."""

    batch: int
    started: float = field(default_factory=time.monotonic)
    stored: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)  # rank 0: stop waiting for others
    all_stored: threading.Event = field(default_factory=threading.Event)  # the ranks agreed they stored
    error: BaseException | None = None
    stored_at: float | None = None
    completed: bool = False  # rank 0: latest.json moved to it (the follow-up ran to its end)


class Uploader:
    """At most one `Upload` in flight; `start` refuses a second one (settle the first)."""

    def __init__(self) -> None:
        self.pending: Upload | None = None

    def start(
        self, batch: int, store_files: Callable[[], None], follow_up: Callable[[Upload], None] | None = None
    ) -> Upload:
        """Run `store_files()` (this rank's files and manifest), then `follow_up(upload)` (rank 0:
        wait for the other ranks' manifests, move latest.json; it returns early once `upload.stop`
        is set), in a thread of their own."""
        if self.pending is not None:
            raise RuntimeError(f"the upload of batch {self.pending.batch} is still pending: settle it first")
        upload = Upload(batch)
        self.pending = upload

        def job() -> None:
            try:
                store_files()
                upload.stored_at = time.monotonic()
            except BaseException as err:  # handed to the training thread by the publisher
                upload.error = err
            finally:
                upload.stored.set()
            try:
                if upload.error is None and follow_up is not None:
                    follow_up(upload)
            except BaseException as err:
                upload.error = err
            finally:
                upload.finished.set()

        threading.Thread(target=job, name=f"checkpoint-upload-ba{batch}", daemon=True).start()
        return upload


class Deadline:
    """The one bound on what the end of a run (its last save, or the save on SIGTERM) waits for
    storage: started once, at the first of those, and shared by everything the end stores (the
    checkpoint, the records, removing an interrupted save, releasing the run lock)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def start(self, seconds: float, since: float | None = None) -> None:
        if self.at is None:
            self.at = (since if since is not None else time.monotonic()) + seconds

    def left(self) -> float | None:
        """Seconds left (0 once it passed), or None before it started: no bound."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def run_bounded(fn: Callable[[], object], timeout: float | None) -> bool:
    """Run `fn` in a daemon thread and wait for it at most `timeout` seconds (None: no bound);
    False when it is still running (it is left to the process's exit, its outcome unreported);
    an error it raised in time is raised here."""
    if timeout is None:
        fn()
        return True
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=target, name=f"bounded-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False
    if errors:
        raise errors[0]
    return True
