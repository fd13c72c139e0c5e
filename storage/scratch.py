"""Folders a process keeps in a temp folder while it runs, and removing those of killed processes.

A process names each such folder `<prefix><pid>-<random>`: a conversion's spool and sketch files
(`convert/scratch.py`), a checkpoint's staging folder for an S3 save and the local copy of a
checkpoint being verified (`llm/checkpoint`). The process removes its own at exit; one killed by
SIGKILL cannot, and a 7B staging folder holds 10 GB per rank. So the next process that makes
such a folder first removes every one whose process is gone (its pid no longer runs here). A pid
reused by a live process keeps its folder: nothing that may still be in use is ever removed.
Python's `tempfile` names its folders at random, with nothing that says whose they are.

A training process also makes one such folder its temp folder (`use_own_temp_folder`: TMPDIR and
`tempfile`), so that what libraries leave there, which has no owner's name (mosaicml-streaming's
file locks, a pair per dataset, never removed; torch's and Composer's temp folders of a process
killed in a save or a load), goes with the process at exit or with the next start. The ranks a
launcher started on one node share one such folder, named by the launcher's pid: streaming's file
locks guard the shared memory all of them use, and ranks locking files of their own would race on
it (its barrier then never opens). That folder goes with the next start after the launcher's end.

`on_exit(chore)`: what the process removes when it exits, run at a normal exit (`atexit`) and at a
fast one (`run_exit_chores`, before `os._exit`: a preempted process skips the interpreter's
seconds-long shutdown), newest first, each once; `fast_only` for what a library's own atexit hook
does at a normal exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

OWN_TEMP_PREFIX = "llm-tmp-"  # + "<pid>-<random>": a process's own temp folder
_own_temp: Path | None = None
_chores: list[Callable[[], object]] = []
_chores_lock = threading.Lock()
_exit_lock = threading.RLock()  # held by the thread running the exit chores


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


def on_exit(chore: Callable[[], object], *, fast_only: bool = False) -> None:
    """Run `chore` once when the process exits (normally, or through `run_exit_chores`); with
    `fast_only`, only through `run_exit_chores`: what a normal exit does by other means (a
    library's own atexit hook) and must not do twice."""
    with _chores_lock:
        _chores.append(chore)
    if not fast_only:
        atexit.register(_run_one, chore)


def remove_at_exit(folder: str | os.PathLike) -> None:
    """Remove `folder` (and what it holds) when the process exits."""
    on_exit(functools.partial(shutil.rmtree, folder, ignore_errors=True))


def run_exit_chores(wait_s: float = 1.0) -> None:
    """Run the chores not run yet, newest first (a fast exit: `os._exit` runs no atexit hooks).

    When another thread is running them already (a preemption's watchdog and the main thread both
    leaving), wait up to `wait_s` for it to finish rather than return at once: an `os._exit` in the
    middle of a chore would cut it short (shared memory unlinked but still on the resource tracker's
    list, which then warns below the run's last line)."""
    if not _exit_lock.acquire(timeout=wait_s):
        return
    try:
        with _chores_lock:
            pending = list(reversed(_chores))
        for chore in pending:
            _run_one(chore)
    finally:
        _exit_lock.release()


def _run_one(chore: Callable[[], object]) -> None:
    with _chores_lock:
        if chore not in _chores:
            return
        _chores.remove(chore)
    with contextlib.suppress(Exception):  # a chore at exit has nobody left to report to
        chore()


def use_own_temp_folder() -> Path:
    """Make a folder of this process (`llm-tmp-<pid>-<random>` in the temp folder) the temp folder
    of everything the process does (`tempfile`, and TMPDIR for what it starts), removed when it
    exits; first remove those of processes that are gone. Once per process: later calls return it.
    A rank of a multi-process launch (LOCAL_WORLD_SIZE > 1) shares its launcher's folder with the
    node's other ranks (`llm-tmp-<launcher pid>-ranks`), which is left for the next start to remove.

    torch's compiled-kernel cache, which lives in the temp folder unless told otherwise, stays
    where it was (TORCHINDUCTOR_CACHE_DIR), so that a restart does not compile again."""
    global _own_temp
    if _own_temp is not None and _own_temp.is_dir():
        return _own_temp
    parent = tempfile.gettempdir()
    remove_dead_process_folders(re.escape(OWN_TEMP_PREFIX), parent)
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(parent, "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())),
    )
    if int(os.environ.get("LOCAL_WORLD_SIZE") or 1) > 1:
        folder = Path(parent) / f"{OWN_TEMP_PREFIX}{os.getppid()}-ranks"
        folder.mkdir(exist_ok=True)
    else:
        folder = make_process_folder(OWN_TEMP_PREFIX, parent)
        remove_at_exit(folder)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    _own_temp = folder
    return folder


def machine_temp_folder() -> Path:
    """The temp folder every process of this machine shares: the parent of this process's own
    (`use_own_temp_folder`), or the temp folder itself before it has one. What must outlive the
    process goes here (this node's checkpoint copy, `llm.checkpoint.local_copy`)."""
    if _own_temp is not None:
        return _own_temp.parent
    return Path(tempfile.gettempdir())
