"""One checkpoint's upload at a time per rank, in a thread, while training goes on.

`llm.checkpoint.publisher` hands each save's work (store this rank's files, then its manifest;
on rank 0 also wait for the other ranks' manifests and move `latest.json`) to `Uploader.start`,
and asks `Uploader.settle` at the next save and at the end whether it finished and how.
Nothing here talks to the other ranks: the publisher agrees on the outcome with one collective
on the training thread (collectives on a second thread would race the training step's).

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
    are stored (or failed: `error`); `finished` once the whole job, rank 0's follow-up included,
    has returned."""

    batch: int
    started: float = field(default_factory=time.monotonic)
    stored: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)  # rank 0: stop waiting for others
    error: BaseException | None = None
    stored_at: float | None = None


class Uploader:
    """At most one `Upload` in flight; `start` refuses a second one (settle the first)."""

    def __init__(self) -> None:
        self.pending: Upload | None = None

    def start(
        self,
        batch: int,
        store_files: Callable[[], None],
        follow_up: Callable[[Upload], None] | None = None,
        *,
        background: bool = True,
    ) -> Upload:
        """Run `store_files()` (this rank's files and manifest), then `follow_up(upload)` (rank 0:
        wait for the other ranks' manifests, move latest.json; it returns early once `upload.stop`
        is set). `background=False` runs `store_files()` here, as a synchronous save does, and no
        follow-up: the caller settles the upload at once."""
        if self.pending is not None:
            raise RuntimeError(f"the upload of batch {self.pending.batch} is still pending: settle it first")
        upload = Upload(batch)
        self.pending = upload

        def job() -> None:
            try:
                store_files()
                upload.stored_at = time.monotonic()
            except BaseException as err:  # handed to the training thread by settle()
                upload.error = err
            finally:
                upload.stored.set()
            try:
                if upload.error is None and follow_up is not None and background:
                    follow_up(upload)
            except BaseException as err:
                upload.error = err
            finally:
                upload.finished.set()

        if background:
            threading.Thread(target=job, name=f"checkpoint-upload-ba{batch}", daemon=True).start()
        else:
            job()
        return upload

    def wait_stored(self, timeout: float | None = None) -> Upload | None:
        """Wait (up to `timeout` s) for the pending upload's own files; the upload, or None."""
        if self.pending is not None:
            self.pending.stored.wait(timeout)
        return self.pending

    def finish(self, timeout: float | None = None) -> bool:
        """Stop the pending job's follow-up waiting and wait for it to return; False on timeout
        (the upload stays pending)."""
        upload = self.pending
        if upload is None:
            return True
        upload.stop.set()
        if not upload.finished.wait(timeout):
            return False
        self.pending = None
        return True
