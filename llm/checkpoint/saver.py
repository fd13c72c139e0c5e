"""Composer's `CheckpointSaver`, with what the project adds to the local write of a checkpoint.

Composer decides when to save (`save_interval`, the end of training) and writes the file with
`torch.save` (a sharded save with torch.distributed.checkpoint). A full disk then surfaced as two
tracebacks (`OSError: [Errno 28] No space left on device`, then torch's zip writer's
`RuntimeError: ... unexpected pos`) and left the partial file behind. `Saver` catches that one
fault: it removes this rank's partial file and raises one `StorageError` line naming the folder,
the space a checkpoint needs and the space left, and the checkpoint the next run resumes from
(exit 1: free some space and rerun the same command).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import Logger
from composer.utils import checkpoint as composer_checkpoint

from llm.checkpoint.sizes import human_bytes
from storage import StorageError

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class Saver(CheckpointSaver):
    """`CheckpointSaver` whose write ends in one line when the disk is full (module docstring).

    `need_bytes`: this rank's part of one checkpoint (the size the start check asks room for);
    `publisher`: the `CheckpointPublisher` that follows it (it knows the newest complete checkpoint).
    """

    def __init__(self, *args: Any, need_bytes: int, publisher: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.need_bytes = need_bytes
        self.publisher = publisher

    def _save_checkpoint(self, state: State, logger: Logger) -> None:
        try:
            super()._save_checkpoint(state, logger)
        except Exception as err:
            if not disk_full(err):
                raise
            path = Path(
                composer_checkpoint.get_save_filename(
                    state, self.filename.format(state, keep_placeholders=True)
                )
            )
            raise self._disk_full(path, int(state.timestamp.batch)) from None

    def _disk_full(self, path: Path, batch: int) -> StorageError:
        path.unlink(missing_ok=True)  # the partial file: nothing half-written is kept
        folder = next(p for p in [path.parent, *path.parents] if p.exists())
        resume = getattr(self.publisher, "newest_complete", None)
        keeps = (
            f"the checkpoint at batch {resume} remains the resume point"
            if resume is not None
            else "no checkpoint is complete yet: the next run starts from scratch"
        )
        return StorageError(
            f"could not write the checkpoint at batch {batch} to {folder}: no space left on the device "
            f"(a checkpoint needs about {human_bytes(self.need_bytes)} on this rank, "
            f"{human_bytes(shutil.disk_usage(folder).free)} is free); the partial file was removed and "
            f"{keeps}; free some space or give checkpoint.save_folder (or checkpoint.staging_folder for "
            "an s3:// save) a larger disk, then rerun the same command"
        )


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
