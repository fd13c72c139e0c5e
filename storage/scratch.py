"""Folders a process keeps in a temp folder while it runs, and removing those of killed processes.

A process names each such folder `<prefix><pid>-<random>`: a conversion's spool and sketch files
(`convert/scratch.py`), a checkpoint's staging folder for an S3 save and the local copy of a
checkpoint being verified (`llm/checkpoint`). The process removes its own at exit; one killed by
SIGKILL cannot, and a 7B staging folder holds 10 GB per rank. So the next process that makes
such a folder first removes every one whose process is gone (its pid no longer runs here). A pid
reused by a live process keeps its folder: nothing that may still be in use is ever removed.
Python's `tempfile` names its folders at random, with nothing that says whose they are.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path


def make_process_folder(prefix: str, parent: str | os.PathLike | None = None) -> Path:
    """A new folder `<parent>/<prefix><pid>-<random>` of this process (parent: the temp folder)."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def remove_dead_process_folders(prefix: str, parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the folders `<parent>/<prefix><pid>-*` whose process no longer runs; return them.

    `prefix` is a regular expression for the part before the pid (e.g. `llm-ckpt-rank\\d+-`)."""
    name = re.compile(rf"^{prefix}(\d+)-")
    root = Path(parent or tempfile.gettempdir())
    removed = []
    for entry in root.iterdir() if root.is_dir() else []:
        match = name.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
