"""Streaming's shared memory: stale registrations of our cache folders, and the prefix race.

streaming registers each live dataset's folders in shared memory under a numbered prefix
(`/dev/shm/000123_locals` ...). Three things go wrong with it that this module handles: a run killed
with its whole process group leaves its registrations behind (`clean_stale_shared_memory`), two
processes building datasets at the same instant can pick the same prefix (`with_shm_race_retry`),
and a process that ends with `os._exit` (a preempted run, llm/checkpoint/preemption.py) runs none
of streaming's `atexit` clean-ups, so Python's resource tracker unlinks the segments after it and
prints a warning below the run's last line (`release_shared_memory`).
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
_LOCALS_SHM = re.compile(r"^(\d{6})_locals$")


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
    from streaming.base.constant import SHM_TO_CLEAN

    wanted = {os.path.abspath(d) for d in local_dirs}
    freed: list[int] = []
    if not SHM_DIR.is_dir():  # not Linux: nothing we can inspect safely
        return freed
    ours = [
        match.group(1)
        for entry in sorted(SHM_DIR.iterdir())
        if (match := _LOCALS_SHM.match(entry.name)) and not wanted.isdisjoint(_registered_locals(entry))
    ]
    live = _mapped_by_a_running_process(set(ours)) if ours else set()
    for prefix in ours:
        if prefix in live:  # a dataset alive now: local shards may be read by several at once
            continue
        for name in SHM_TO_CLEAN:
            (SHM_DIR / f"{prefix}_{name}").unlink(missing_ok=True)
        freed.append(int(prefix))
    return freed


def _mapped_by_a_running_process(prefixes: set[str]) -> set[str]:
    """The prefixes whose segments a running process (this one included) still has mapped.

    A live dataset keeps its `*_locals` segment mapped; a killed run's are mapped by no one. Local
    shard folders (no remote) may be registered by several live datasets at once (an eval beside a
    training run, a sweep's runs on one machine, a benchmark's loops in one process): unlinking
    theirs would let the next dataset take the same prefix while they still attach to it by name.
    A process whose maps cannot be read (another user's, another PID namespace's) is not seen: with
    a /dev/shm shared across containers, only the stale case is handled."""
    live: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(encoding="utf-8", errors="replace")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        live |= {prefix for prefix in prefixes - live if f"{SHM_DIR}/{prefix}_" in text}
        if live == prefixes:
            break
    return live


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
    """Remember `dataset` (a StreamingDataset) for `release_shared_memory`."""
    _datasets.add(dataset)


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


def release_shared_memory() -> None:
    """Unlink the shared memory this process's datasets created, and take it off the resource
    tracker's list, without closing the mappings (another thread may still read them): what
    streaming's `atexit` clean-ups do, for a process about to end with `os._exit` (only then: after
    those hooks ran, a name would be taken off the list twice, a traceback in the tracker)."""
    from multiprocessing import resource_tracker

    from streaming.base.shared.memory import SharedMemory

    try:
        import _posixshmem  # what multiprocessing.shared_memory unlinks with on POSIX
    except ImportError:  # not POSIX: nothing we can release safely
        return

    # The tracker itself, not the module's `unregister`: streaming swaps that for a no-op while it
    # closes attached segments (in whichever thread collects a dataset).
    tracker = resource_tracker._resource_tracker
    for obj in _shared_memories(list(_datasets), SharedMemory):
        for shm in obj.created_shms:
            try:
                _posixshmem.shm_unlink(shm._name)
            except FileNotFoundError:  # released already (streaming cleaned it up and made it anew)
                continue
            tracker.unregister(shm._name, "shared_memory")
