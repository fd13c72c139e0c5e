"""Streaming's shared memory: stale registrations of our cache folders, and the prefix race.

streaming registers each live dataset's folders in shared memory under a numbered prefix
(`/dev/shm/000123_locals` ...). Three things go wrong with it that this module handles: a run killed
with its whole process group leaves its registrations behind (`clean_stale_shared_memory`; each of
our live datasets holds a lock on its prefix, `track`, so that only the dead ones' are cleaned), two
processes building datasets at the same instant can pick the same prefix (`with_shm_race_retry`),
and a process that ends with `os._exit` (a preempted run, llm/checkpoint/preemption.py) runs none
of streaming's `atexit` clean-ups, so Python's resource tracker unlinks the segments after it and
prints a warning below the run's last line (`release_shared_memory`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
_PREFIXED = re.compile(r"^(\d{6})_(\w+)$")  # streaming's segments: /dev/shm/<prefix>_<name>

def clean_stale_shared_memory(local_dirs: Iterable[str]) -> list[int]:
    """Unlink streaming's shared memory still registered for our cache folders; return the prefixes.

    Streaming registers each live dataset's local folders in shared memory, and a run killed with
    its whole process group (container OOM, node preemption) never unregisters them. With a fresh
    /tmp but the same /dev/shm (e.g. `docker --ipc=host`, per-job TMPDIR), the next start then
    fails with "Reused local directory". Call once, before the first dataset, on one rank per node.

    Unlike `streaming.base.util.clean_stale_shared_memory()`, this frees only registrations of
    *our* folders: that function unlinks every dataset's memory on the machine (also those of other
    live jobs) and stops at the first unused prefix, so it can miss the stale one.
    """
    from streaming.base.constant import EPOCH_DATA, EPOCH_SHAPE, LOCALS, RESUME, SHM_TO_CLEAN

    # What streaming's SHM_TO_CLEAN leaves out: the resume state a checkpoint's load writes, and
    # the epoch's sample order.
    left_out = (RESUME, EPOCH_SHAPE, EPOCH_DATA)
    wanted = {os.path.abspath(d) for d in local_dirs}
    freed: list[int] = []
    if not SHM_DIR.is_dir():  # not Linux: nothing we can inspect safely
        return freed
    segments = [(m.group(1), m.group(2), e) for e in sorted(SHM_DIR.iterdir()) if (m := _PREFIXED.match(e.name))]
    registered = {prefix: entry for prefix, name, entry in segments if name == LOCALS}
    ours = [prefix for prefix, entry in registered.items() if not wanted.isdisjoint(_registered_locals(entry))]
    # A free prefix (no `_locals`) whose resume state or epoch order a dead dataset left: the next
    # dataset to take that prefix would start from another run's position in another run's order.
    orphans = sorted({prefix for prefix, name, _ in segments if name in left_out} - set(registered))
    # Of an orphan, only what was left: a dataset may be taking the free prefix this moment (its
    # registration comes before its lock; its resume state and epoch order only after).
    jobs = [(prefix, (*SHM_TO_CLEAN, *left_out)) for prefix in ours] + [(p, left_out) for p in orphans]
    for prefix, names in jobs:
        with _unheld(prefix) as stale:
            if not stale:  # a live dataset holds it: local shards may be read by several at once
                continue
            for name in names:
                with contextlib.suppress(PermissionError):  # another user's: not ours to remove
                    (SHM_DIR / f"{prefix}_{name}").unlink(missing_ok=True)
            if prefix in registered:
                freed.append(int(prefix))
    return freed


def _lock(prefix: str, how: int) -> int | None:
    """A descriptor of `prefix`'s lock file locked `how` (flock), or None when it cannot be had.
    The file sits beside the segments (shared wherever /dev/shm is) and is never removed: a dataset
    opening it while a cleaner removed it would lock a file no later cleaner sees."""
    try:
        fd = os.open(SHM_DIR / f"llm-{prefix}.lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:  # not ours to open (another user's)
        return None
    try:
        fcntl.flock(fd, how)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _unheld(prefix: str):
    """Yield whether no live dataset holds `prefix` (then it stays unheld until the block ends).

    Local shard folders (no remote) may be registered by several live datasets at once (an eval
    beside a run, a sweep's runs on one machine, a benchmark's loops beside its trainer): unlinking
    theirs would let the next dataset take the same prefix while they still attach to it by name.
    Whether a process maps the segments does not tell: streaming's start maps every segment it
    walks past until its process ends. Each of our datasets holds a shared `flock` on the prefix's
    lock file for its lifetime (`track`); the kernel drops it when the process dies, SIGKILL too.
    A registration without our lock (another tool's dataset) counts as unheld, as before."""
    fd = _lock(prefix, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:  # held, or another user's (not ours to clean either)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)  # releases the lock


_locks: dict[int, int] = {}  # id(dataset) -> the descriptor of its prefix's lock, closed with it


def _hold(dataset: object) -> None:
    """A shared lock on `dataset`'s prefix for as long as it lives (or until `release_shared_memory`)."""
    prefix = getattr(dataset, "_shm_prefix_int", None)
    if prefix is None or not SHM_DIR.is_dir():
        return
    fd = _lock(f"{prefix:06d}", fcntl.LOCK_SH)  # waits out a cleaner's moment of LOCK_EX
    if fd is not None:
        _locks[id(dataset)] = fd
        weakref.finalize(dataset, _let_go, id(dataset))


def _let_go(key: int) -> None:
    fd = _locks.pop(key, None)
    if fd is not None:
        os.close(fd)


def _forget_in_child() -> None:
    """A forked child (a fork server, a loader's worker) closes its copies of the locks: they are
    the parent's to hold, and a long-lived child would otherwise hold them after the parent's
    datasets are gone (a lock lasts while any copy of its descriptor is open)."""
    for fd in _locks.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _registered_locals(path: Path) -> list[str]:
    """The folders a streaming `*_locals` segment lists (int32 size, then NUL-separated paths)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    if len(data) < 4:
        return []
    size = int(np.frombuffer(data[:4], np.int32)[0])
    return data[4:size].decode("utf-8", "replace").split("\0")[:-1]


_SHM_RACE_ATTEMPTS = 8


def with_shm_race_retry(make):
    """`make()`, again after a short random pause if another process took the same shared-memory
    prefix at the same moment.

    streaming 0.13 picks the first free prefix (`/000123_locals`) and then creates it: two
    processes on one machine that build datasets at the same instant (two jobs started together,
    a test suite's workers) can pick the same one, and the second fails with FileExistsError.
    Only retried in a world of one rank (Composer sets up a process group even for one process):
    with several ranks the prefix is agreed between barriers, which a retry on one rank would put
    out of step."""
    import random
    import time

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return make()
    for attempt in range(_SHM_RACE_ATTEMPTS):
        try:
            return make()
        except FileExistsError as err:
            if attempt == _SHM_RACE_ATTEMPTS - 1 or not re.search(r"/\d+_\w+", str(err.filename or err)):
                raise
            time.sleep(random.uniform(0.05, 0.3))
    raise AssertionError("unreachable")


_datasets: weakref.WeakSet = weakref.WeakSet()  # this process's datasets (`track`)


def track(dataset: object) -> None:
    """Remember `dataset` (a StreamingDataset, built) for `release_shared_memory`, and hold its
    prefix so that no start takes its shared memory for a dead run's (`clean_stale_shared_memory`)."""
    _datasets.add(dataset)
    _hold(dataset)


def _shared_memories(roots: list, kind: type, depth: int = 3) -> list:
    """streaming's SharedMemory objects reachable from `roots` through the attributes of
    streaming's own objects (a dataset's barrier, scalars and arrays), `depth` levels down.

    Not `gc.get_objects()`: that takes a reference to every object of the process, tensors among
    them, and a tensor whose Python object torch's C++ side owns, released by another thread (a
    preempted run's upload) while that list holds it, makes torch print a warning at exit."""
    found, seen = [], set()

    def walk(obj: object, left: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if type(obj) is kind:  # not isinstance: it asks some lazy objects for their class
            found.append(obj)
            return
        attrs = getattr(obj, "__dict__", None)
        if left == 0 or not isinstance(attrs, dict):
            return
        for value in list(attrs.values()):
            if type(value).__module__.startswith("streaming."):
                walk(value, left - 1)

    for root in roots:
        walk(root, depth)
    return found


def release_shared_memory(datasets: Iterable[object] | None = None) -> None:
    """Unlink the shared memory `datasets` (None: all of this process's) created, and take it off
    the resource tracker's list, without closing the mappings (another thread may still read them).

    What streaming's `atexit` clean-ups do, for a process about to end with `os._exit`, and for a
    run that has ended (`ReleaseDatasets`, at `Trainer.close`) in a process that goes on (a
    notebook, a test worker): its prefix is free again, and a start cleans only registrations no live
    dataset holds. Those hooks, when they run later, are given nothing to unlink: they go by name,
    which another dataset may have taken meanwhile (its memory would go, and the name would be
    taken off the tracker's list twice: a traceback in the tracker)."""
    from multiprocessing import resource_tracker

    from streaming.base.shared.memory import SharedMemory

    try:
        import _posixshmem  # what multiprocessing.shared_memory unlinks with on POSIX
    except ImportError:  # not POSIX: nothing we can release safely
        return

    # The tracker itself, not the module's `unregister`: streaming swaps that for a no-op while it
    # closes attached segments (in whichever thread collects a dataset).
    tracker = resource_tracker._resource_tracker
    roots = list(_datasets) if datasets is None else list(datasets)
    for dataset in roots:  # the names go: nothing left to hold
        _let_go(id(dataset))
    for obj in _shared_memories(roots, SharedMemory):
        for shm in obj.created_shms:
            try:
                _posixshmem.shm_unlink(shm._name)
            except FileNotFoundError:  # released already (streaming cleaned it up and made it anew)
                continue
            tracker.unregister(shm._name, "shared_memory")
        # streaming's atexit hook unlinks by name: by then another dataset may have taken the name.
        obj.created_shms = []
