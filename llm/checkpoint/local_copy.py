"""This node's copy of the newest checkpoint of a run saving to S3: kept, and reused at a restart.

A run resumed from an `s3://` save_folder downloads its checkpoint first (Composer then loads the
local file). When the node survived the stop (the process was killed or preempted and the job
restarted on the same machine), those bytes were on its disk a moment before: the saver wrote
them there to upload them. So, with `checkpoint.local_copy` (on by default):

- after this node's files of a save and their manifest are stored, the publisher moves the staged
  files here (`keep`: a rename on the same disk) instead of deleting them; the folder holds one
  checkpoint, the newest this node stored, and the one before is deleted then;
- a restart (`llm.checkpoint.resume`) first looks here for the checkpoint the store's manifests
  say is the newest complete one (`holds`: every file with the manifest's size) and loads it when
  its SHA-256 and its state check out, as a download's must; otherwise it downloads it here
  (`receive`), replacing what was here, so that the next restart on this node finds it;
- a run that reached its end deletes its copy (`remove`).

The folder is `<checkpoint.staging_folder or the machine's temp folder>/llm-ckpt-copy-<digest of
save_folder>/`, outside every process's own temp folder so that it outlives the process; one per
node (a monolithic checkpoint is one file that every rank loads): only the node's first rank
(LOCAL_RANK 0) writes it, every rank of the node may read it. A sharded checkpoint is read by
Composer straight from the store (each rank its shards), so it is not kept. A local save_folder
is read in place and needs no copy.

The copy is never trusted for what it is: the manifests in the store decide which checkpoint is
the newest, and a copy that differs from its manifest by a byte is downloaded again. A copy left by
a run that never resumed stays on the disk (`llm-ckpt-copy-*` in the temp folder; its size is one
checkpoint of the node's).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llm.checkpoint import manifest as cm
from llm.config import TrainConfig
from storage import open_store
from storage.scratch import machine_temp_folder

log = logging.getLogger(__name__)

COPY_PREFIX = "llm-ckpt-copy-"  # + a digest of the save folder's URL


@dataclass(frozen=True)
class NodeCopy:
    """The folder of this node's copy of a run's newest checkpoint (module docstring)."""

    root: Path
    writer: bool  # this rank keeps and downloads into it (the node's first rank); others only read

    def holds(self, ckpt: cm.Checkpoint) -> bool:
        """Whether every file of `ckpt` is here with the size its manifest records."""
        for rel, info in ckpt.files.items():
            path = self.root / rel
            if not path.is_file() or path.stat().st_size != info.size:
                return False
        return bool(ckpt.files)

    def path(self, ckpt: cm.Checkpoint) -> Path:
        return self.root / ckpt.load_path

    def clear(self) -> None:
        """Delete what the folder holds (the folder stays)."""
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def receive(self) -> Path:
        """The folder, emptied, for a download of the newest checkpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.clear()
        return self.root

    def keep(self, files: Iterable[Path], staging_root: Path) -> bool:
        """Move this node's stored files of a save (under `staging_root`) here, replacing the older
        copy; False (the files are deleted, as without a copy) where this rank does not write the
        copy or the disk would keep less free than the files take (the next save is written there)."""
        files = [Path(f) for f in files]
        size = sum(f.stat().st_size for f in files if f.exists())
        keep = self.writer and _room(self.root, size)
        if keep:
            self.root.mkdir(parents=True, exist_ok=True)
            self.clear()
            try:
                for f in files:
                    target = self.root / f.relative_to(staging_root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(f, target)
            except OSError as err:  # the copy is only a shortcut: without it, restarts download
                log.warning("could not keep this node's copy of the checkpoint in %s: %s", self.root, err)
                self.clear()
                keep = False
        for f in files:
            f.unlink(missing_ok=True)
        return keep

    def remove(self) -> None:
        """The run reached its end: its copy goes."""
        if self.writer:
            shutil.rmtree(self.root, ignore_errors=True)


def node_copy(cfg: TrainConfig) -> NodeCopy | None:
    """This node's copy folder of the run of `cfg`, or None: `checkpoint.local_copy` off, no
    save_folder, or a local one (read in place)."""
    ck = cfg.checkpoint
    if not ck.local_copy or not ck.save_folder:
        return None
    store = open_store(ck.save_folder)
    if not store.is_remote:
        return None
    parent = Path(ck.staging_folder) if ck.staging_folder else machine_temp_folder()
    digest = hashlib.sha256(store.url().encode()).hexdigest()[:16]
    return NodeCopy(parent / f"{COPY_PREFIX}{digest}", writer=os.environ.get("LOCAL_RANK", "0") == "0")


def _room(root: Path, size: int) -> bool:
    """Whether the disk of `root` keeps `size` bytes free besides the copy (the next save's)."""
    where = next((p for p in [root, *root.parents] if p.exists()), None)
    if where is None:
        return False
    return shutil.disk_usage(where).free >= size
