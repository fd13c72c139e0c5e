"""Worker processes for a conversion: one pool per run, results in input order, clear failures.

concurrent.futures provides the pool, and a worker that dies usually breaks it at once
(BrokenProcessPool). What it lacks, added here: the start method (fork where it is safe), a
forked worker that ends with its parent even when the parent is SIGKILLed, one ConvertError that
says what to do when a worker dies, results in input order with a bounded number of tasks in
flight (`ordered`; `Executor.map` submits every task up front), and a liveness check of its own:
a worker killed while it sends a large result leaves the pool's result thread blocked on the
rest of that message (the main process holds the pipe's write end too, so no end-of-file comes)
and the pool never notices. Waiting on a result therefore also watches the workers' exit codes;
on a death it kills the other workers and closes the main process's write end, which unblocks
that thread, and raises the ConvertError. That reaches two private attributes of
`ProcessPoolExecutor` (`_processes`, `_result_queue`), stable since Python 3.9.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from convert.errors import ConvertError

# fork: a worker is ready in milliseconds with numpy, SentencePiece and this package already
# imported (spawn takes ~0.4 s per worker). The main process starts no threads before the pool
# (progress bars run without tqdm's monitor thread) and S3 clients are per process id. Where
# fork is not the safe default (macOS, Windows) workers are spawned.
_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


_POLL_SECONDS = 0.5  # how often a wait for a result checks that every worker is alive


class Executor:
    """Runs tasks in a pool of worker processes; a dead worker becomes one clear ConvertError."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool = pool

    def submit(self, fn: Callable, arg) -> Task:
        try:
            return Task(self.pool.submit(fn, arg), executor=self)
        except BrokenProcessPool:  # a worker died while this process was busy elsewhere
            raise _worker_died() from None

    def check_workers(self) -> None:
        """ConvertError if a worker has exited; the pool is torn down first so nothing hangs."""
        processes = list((self.pool._processes or {}).values())
        if not any(p.exitcode is not None for p in processes):
            return
        for p in processes:
            if p.exitcode is None:
                p.kill()
        queue = getattr(self.pool, "_result_queue", None)
        if queue is not None:
            queue._writer.close()  # end-of-file for the result thread blocked on a torn message
        raise _worker_died()


class Task:
    """A submitted task (or a result at hand); `get()` returns its result."""

    def __init__(self, future: Future | None = None, value=None, executor: Executor | None = None) -> None:
        self.future, self.value, self.executor = future, value, executor

    def get(self):
        if self.future is None:
            return self.value
        while True:
            try:
                return self.future.result(timeout=_POLL_SECONDS)
            except BrokenProcessPool:
                raise _worker_died() from None
            except FuturesTimeout:
                if self.executor is not None:
                    self.executor.check_workers()


def _worker_died() -> ConvertError:
    return ConvertError(
        "a conversion worker process died (killed, e.g. for lack of memory); nothing was "
        "marked complete: re-run the same command to continue (finished parts are reused), "
        "with fewer --workers if memory is short"
    )


@contextmanager
def start_workers(workers: int, initializer: Callable, *initargs) -> Iterator[Executor]:
    """A pool of `workers` processes, each set up by `initializer(*initargs)`, for the whole run.

    Even one worker is its own process: the main process reads, de-duplicates and hands out
    work on another core, so `--workers N` means N cores of tokenizing (and cleaning, unless
    the main process has a core to spare for it). Spawned workers import only numpy,
    sentencepiece and this package's light modules.
    """
    context = multiprocessing.get_context(_START_METHOD)
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start, initargs=(os.getpid(), initializer, initargs)
    )
    try:
        yield Executor(pool)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _start(parent: int, initializer: Callable, initargs: tuple) -> None:
    if _START_METHOD == "fork":
        die_with(parent)
    initializer(*initargs)


def die_with(parent: int) -> None:
    """Make this forked worker end when the main process does, even by SIGKILL.

    A forked worker holds copies of the pool's pipe ends, so it never reads end-of-file when
    its parent is killed and would wait forever; Linux's parent-death signal ends it instead.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux after all
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def ordered(executor: Executor | None, fn: Callable, items: Iterable, window: int, shortcut=None) -> Iterator:
    """fn(item) for each item, results in input order, at most `window` in flight (bounded memory).

    `shortcut(item)` may return a ready result, skipping the task (resumed parts). Without an
    executor each task runs here, at once.
    """
    pending: deque[Task] = deque()
    for item in items:
        ready = shortcut(item) if shortcut else None
        if ready is None and executor is None:
            ready = fn(item)
        pending.append(Task(value=ready) if ready is not None else executor.submit(fn, item))
        while len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
