"""Save a checkpoint when the process is told to stop (SIGTERM from a spot reclaim, or Ctrl-C), and
end the process within what the signal leaves.

Composer 0.32.1 turns SIGTERM/SIGINT into `sys.exit(128 + signal)` at once and saves nothing.
This callback replaces that handler while training runs:

- the handler only records the signal;
- at every `batch_end` all ranks agree (`all_reduce` MAX), so a signal seen by any rank stops all
  of them after the same batch; `state.stop_training()` then makes that batch the last one, and
  Composer's saver writes its end-of-training checkpoint there (the publisher stores it);
- at `fit_end` (this callback must be the last one; checked when the Trainer is built) one
  `[preemption]` line says what the publisher reported (`StopSave`): the checkpoint stored, or,
  when the storage could not take it in time (an outage, an upload still in flight), which
  checkpoint the next run resumes from and the batches it redoes; the process then exits with
  128 + the signal number: 143 for SIGTERM, 130 for SIGINT, the codes a shell and launchers expect;
- with `preemption.notice_s` (the time the platform leaves between SIGTERM and the kill), the
  publisher starts no save that cannot be stored in time: the save's projected seconds (this
  run's measured snapshot, write and upload, `llm.checkpoint.schedule.SaveCosts`, plus what is
  left of an upload in flight) must fit what the notice leaves for storage (`StopBudget`).

What a signal leaves is one budget (`StopBudget`): every wait on storage ends `storage_s` after
the signal, and the process has exited `exit_s` after it (with a notice: the notice less
`preemption.margin_s`; without one: `checkpoint.upload_wait_s` plus `SHUTDOWN_GRACE_S`).
The shutdown itself is budgeted: the close of the Trainer's callbacks and loggers (the last
records, the run lock's release) gets `SHUTDOWN_S` of the notice, and the process then leaves at
once (`os._exit` after its exit chores, `storage.scratch.run_exit_chores`) instead of through the
interpreter's shutdown, which took 3-4 s here with torch and Composer loaded and, before that,
waited for every boto3 transfer thread (an upload in flight held a preempted process 85 s).

When the process is a command's own (`own_the_process`: train.py), a watchdog thread started at
the first signal makes sure of it, whatever the training thread is blocked in:
- the training thread waits for the data of its batch (a frozen data remote) longer than
  `data_wait_s` after the signal: the state is at a batch boundary, so the process stops there,
  lets an upload in flight finish within the storage budget, and exits with the line naming the
  checkpoint the next run resumes from;
- the process has not exited `exit_s` after the signal (a wait the publisher does not bound, a
  shutdown that hangs): it stores nothing more and exits, with a line saying so unless the stop's
  line is out already (the shutdown after it is cut short: one line per stop);
- a second signal: it exits at once (within about a second), storing nothing more, with a line
  that says what is stored: a save cut short is never completed afterwards (no manifest is
  written once the publisher was asked, `CheckpointPublisher.exit_report`), and its local files
  are removed.
Called as a library (a test fitting in its own process), none of this runs: the second signal
goes to Composer's handler, and the end is Composer's `SystemExit`.

`stop_training()` lowers `state.max_duration`, which is not part of a Composer checkpoint: the
resumed run trains to the recipe's `max_duration`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from storage.scratch import run_exit_chores

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}
# What the end of a preempted run needs after its last wait on storage: the close of the Trainer's
# callbacks and loggers, the exit chores and the exit. Measured on a loaded 2-core machine with the
# test model: 0.26-0.39 s from the stop's line to the process's end (docs/resume.md).
SHUTDOWN_S = 1.0
# Without a notice nothing outside bounds the shutdown: after the storage's `upload_wait_s`, the
# watchdog gives it this long (a loaded machine's close, the trackers' last flush).
SHUTDOWN_GRACE_S = 10.0
# The most a stopping run waits for the data of its current batch, after the signal.
DATA_WAIT_S = 10.0

_owns_process = False


def own_the_process() -> None:
    """The caller is the whole process (train.py's command): after a signal the process may be
    ended from here (the watchdog, the fast exit). Not for a library caller."""
    global _owns_process
    _owns_process = True


@dataclass(frozen=True)
class StopBudget:
    """What a signal leaves (module docstring), from the recipe's `preemption.notice_s`,
    `preemption.margin_s` and `checkpoint.upload_wait_s`."""

    notice_s: float | None = None
    margin_s: float = 5.0
    upload_wait_s: float = 600.0

    @property
    def exit_s(self) -> float:
        """Seconds after the signal by which the process has exited."""
        if self.notice_s is None:
            return self.upload_wait_s + SHUTDOWN_GRACE_S
        return max(0.0, self.notice_s - self.margin_s)

    @property
    def storage_s(self) -> float:
        """Seconds after the signal by which every wait on storage has ended; the rest of `exit_s`
        is the shutdown's (at most half of it)."""
        if self.notice_s is None:
            return self.upload_wait_s
        return max(0.0, self.exit_s - min(SHUTDOWN_S, self.exit_s / 2))

    @property
    def data_wait_s(self) -> float:
        """The most the training thread waits for its batch's data after the signal."""
        return min(DATA_WAIT_S, self.storage_s / 2)

    def storage_text(self) -> str:
        if self.notice_s is None:
            return f"{self.upload_wait_s:g} s (checkpoint.upload_wait_s)"
        return (
            f"{self.storage_s:.3g} s (preemption.notice_s less preemption.margin_s and "
            f"{self.exit_s - self.storage_s:.3g} s for the shutdown)"
        )


@dataclass(frozen=True)
class StopSave:
    """What became of the checkpoint saved on the signal (the publisher reports it)."""

    batch: int  # the batch it was saved at
    stored: bool
    resume_batch: int | None  # the newest complete checkpoint the next run resumes from (None: none)
    reason: str = ""  # why it was not stored
    started: bool = True  # False: no save was started (it could not end within preemption.notice_s)


@dataclass(frozen=True)
class Stored:
    """What the storage holds when the process ends at once (`CheckpointPublisher.exit_report`)."""

    newest_complete: int | None  # the checkpoint the next run resumes from (None: none)
    cut_short: int | None = None  # a save whose storing was cut short: not complete, never will be
    uncertain: int | None = None  # a save whose manifest was being written: complete if it landed


class PreemptionCallback(Callback):
    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
        budget: StopBudget | None = None,
    ):
        self.signals = signals
        self.budget = budget or StopBudget()
        self.received: int | None = None  # the signal this process caught
        self.received_at: float | None = None
        self.stop_signal: int | None = None  # the signal all ranks agreed to stop on
        self.stop_batch: int | None = None
        self.second: int | None = None  # a second signal, which stops the process at once
        self.save_outcome: StopSave | None = None  # set by the publisher (no save_folder: None)
        # The publisher's: store nothing more and say what is stored (no save_folder: None).
        self.exit_report: Callable[[float | None], Stored] | None = None
        self.batch = 0  # the last batch trained: the state's batch boundary
        self.data_wait_since: float | None = None  # the training thread waits for a batch's data
        self.owns_process = _owns_process
        self.leave: Callable[[int], None] = leave  # how the process ends at once
        self._previous: dict[int, object] = {}
        self._watchdog: _Watchdog | None = None
        self._said = False  # the [preemption] line is out
        self._leaving = threading.Lock()

    def init(self, state: State, logger: Logger) -> None:
        # Composer's profiler (training.profile) appends its own callbacks after ours: not counted.
        ours = [cb for cb in state.callbacks if not type(cb).__module__.startswith("composer.profiler")]
        if ours[-1] is not self:  # Event.INIT runs inside Trainer(): fail there, not at fit_end
            raise RuntimeError(
                "callback order: PreemptionCallback must be the last callback, so that it exits only "
                "after every other callback's fit_end (build it with llm.checkpoint.plan_checkpointing)"
            )

    def fit_start(self, state: State, logger: Logger) -> None:
        self.batch = int(state.timestamp.batch)
        if threading.current_thread() is not threading.main_thread():
            log.warning("training runs outside the main thread: no checkpoint will be saved on SIGTERM")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            self.second = self.second or signum
            if self._watchdog is not None:
                self._watchdog.wake.set()  # it ends the process at once
                return
            self._chain(signum, frame)  # second signal: stop now, as Composer would
            return
        self.received = signum
        self.received_at = time.monotonic()
        self._watch()

    def _watch(self) -> None:
        """Start the watchdog (module docstring), once, when the process is a command's own."""
        if self.owns_process and self._watchdog is None:
            self._watchdog = _Watchdog(self)
            self._watchdog.start()

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self.data_wait_since = time.monotonic()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self.data_wait_since = None

    def batch_end(self, state: State, logger: Logger) -> None:
        self.batch = int(state.timestamp.batch)
        flag = state.device.tensor_to_device(torch.tensor([self.received or 0], dtype=torch.int32))
        dist.all_reduce(flag, reduce_operation="MAX")
        agreed = int(flag.item())
        if agreed and self.stop_signal is None:
            self.stop_signal = agreed
            self.stop_batch = self.batch
            if self.received_at is None:  # another rank got the signal
                self.received_at = time.monotonic()
                self._watch()
            log.warning(
                "%s received: stopping after batch %d and saving a checkpoint",
                signal.Signals(agreed).name,
                self.stop_batch,
            )
            state.stop_training()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.stop_signal is None:
            self._restore()
            return
        code = EXIT_CODES.get(self.stop_signal, 128 + self.stop_signal)
        # Printed, not logged: the launcher's log is what an operator reads after a preemption.
        self._say(self._describe(code))
        if not self.owns_process:
            self._restore()
            if threading.current_thread() is threading.main_thread():
                # Stored and on the way out: a further signal must not raise SystemExit inside the
                # close and atexit hooks (a traceback), only say that the exit is under way.
                for sig in self.signals:
                    signal.signal(sig, _already_exiting)
        # Our handler stays while the process owns it: a further signal ends the shutdown at once.
        sys.exit(code)

    def post_close(self) -> None:
        """The Trainer is closed (every callback's and logger's close ran): a stopped process leaves
        now, without the interpreter's shutdown (module docstring)."""
        if self.owns_process and self.stop_signal is not None:
            self._leave(EXIT_CODES.get(self.stop_signal, 128 + self.stop_signal))

    def _describe(self, code: int) -> str:
        name = signal.Signals(self.stop_signal).name
        seconds = time.monotonic() - (self.received_at or time.monotonic())
        outcome = self.save_outcome
        if outcome is None:  # no checkpoint.save_folder: nothing is saved
            return f"{name}: stopped after batch {self.stop_batch}, nothing saved; exiting with code {code}"
        if outcome.stored:
            return (
                f"{name}: checkpoint at batch {outcome.batch} stored {seconds:.2f} s after the signal; "
                f"exiting with code {code}"
            )
        then = _next_run(outcome.resume_batch, outcome.batch)
        if not outcome.started:
            return f"{name}: no checkpoint saved at batch {outcome.batch} ({outcome.reason}); {then}; exiting with code {code}"
        return (
            f"{name}: the checkpoint at batch {outcome.batch} was not stored within {seconds:.0f} s of the "
            f"signal ({outcome.reason}); {then}; exiting with code {code}"
        )

    def close(self, state: State, logger: Logger) -> None:
        if not self.owns_process:
            self._restore()
        if self.second is not None and self._watchdog is None:
            print(
                f"[preemption] second {signal.Signals(self.second).name}: stopped at once at batch "
                f"{int(state.timestamp.batch)} without storing a checkpoint; the newest complete "
                f"checkpoint stays the resume point; exiting with code {128 + self.second}",
                flush=True,
            )

    # --- ending the process at once (the watchdog's, or the main thread's after close) ------------

    def _say(self, text: str) -> None:
        self._said = True
        print(f"[preemption] {text}", flush=True)

    def _leave(self, code: int) -> None:
        if self._leaving.acquire(blocking=False):  # once, from whichever thread gets here first
            self.leave(code)

    def _stored(self, wait_until: float | None) -> Stored | None:
        return self.exit_report(wait_until) if self.exit_report is not None else None

    def end_waiting_for_data(self, waited: float) -> None:
        """The watchdog's: the data of the next batch did not come in time after the signal."""
        name = signal.Signals(self.received).name
        code = EXIT_CODES.get(self.received, 128 + self.received)
        stored = self._stored(self.received_at + self.budget.storage_s)
        why = [
            f"the data of batch {self.batch + 1} did not come within {self.budget.data_wait_s:.3g} s of the "
            f"signal (waited {waited:.1f} s in all): the data remote does not answer",
            *_cut(stored),
        ]
        self._say(f"{name}: stopped at batch {self.batch} without saving it ({'; '.join(why)}); "
                  f"{_next_run(_newest(stored), self.batch)}; exiting with code {code}")  # fmt: skip
        self._leave(code)

    def end_late(self) -> None:
        """The watchdog's: the process has not exited `exit_s` after the signal."""
        name = signal.Signals(self.received).name
        code = EXIT_CODES.get(self.received, 128 + self.received)
        stored = self._stored(None)
        why = [f"{self.budget.exit_s:.3g} s of the signal: {_exit_bound_text(self.budget)}", *_cut(stored)]
        if not self._said:  # else the stop's line is out (one line per stop): its shutdown is cut short
            self._say(f"{name}: stopped at batch {self.batch}: nothing more was stored within {'; '.join(why)}; "
                      f"{_next_run(_newest(stored), self.batch)}; exiting with code {code}")  # fmt: skip
        self._leave(code)

    def end_now(self) -> None:
        """The watchdog's: a second signal."""
        name = signal.Signals(self.second).name
        code = 128 + self.second
        stored = self._stored(None)
        if self._said and self.save_outcome is not None and self.save_outcome.stored:
            what = f"; the checkpoint at batch {self.save_outcome.batch} is stored (above)"
        elif stored is None:
            what = ", nothing saved"
        else:
            cut = _cut(stored)
            what = " without storing a checkpoint" + (f" ({'; '.join(cut)})" if cut else "")
        self._say(f"second {name}: stopped at once at batch {self.batch}{what}; "
                  f"{_next_run(_newest(stored), self.batch)}; exiting with code {code}")  # fmt: skip
        self._leave(code)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _chain(self, signum: int, frame) -> None:
        previous = self._previous.get(signum)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        sys.exit(128 + signum)


class _Watchdog(threading.Thread):
    """Ends a stopping process that its training thread cannot end in time (module docstring)."""

    def __init__(self, cb: PreemptionCallback):
        super().__init__(name="preemption-watchdog", daemon=True)
        self.cb = cb
        self.wake = threading.Event()
        self.exit_by = cb.received_at + cb.budget.exit_s

    def run(self) -> None:
        cb = self.cb
        while True:
            if cb.second is not None:
                return cb.end_now()
            now = time.monotonic()
            if now >= self.exit_by:
                return cb.end_late()
            since = cb.data_wait_since
            if since is not None and cb.stop_signal is None:
                waited = now - max(since, cb.received_at)
                if waited >= cb.budget.data_wait_s:
                    return cb.end_waiting_for_data(now - since)
            self.wake.wait(min(0.1, self.exit_by - now))


def leave(code: int) -> None:
    """End the process now with `code`: its exit chores (temp folders), the output flushed, then
    `os._exit`, skipping the interpreter's shutdown (seconds with torch and Composer loaded, and a
    wait for every thread pool's transfers)."""
    run_exit_chores()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream: nothing more to say
            pass
    os._exit(code)


def _newest(stored: Stored | None) -> int | None:
    return None if stored is None else stored.newest_complete


def _cut(stored: Stored | None) -> list[str]:
    """What became of the saves in flight, as clauses of the line."""
    if stored is None:
        return []
    parts = []
    if stored.cut_short is not None:
        parts.append(f"the save at batch {stored.cut_short} was cut short: it is not complete")
    if stored.uncertain is not None:
        parts.append(
            f"the manifest of the checkpoint at batch {stored.uncertain} was being written: the next run "
            "uses that checkpoint if it was stored"
        )
    return parts


def _next_run(resume: int | None, batch: int) -> str:
    """What the next run does: where it resumes and the batches it redoes."""
    if resume is None:
        return f"no checkpoint is complete: the next run starts from scratch and redoes {_batches(1, batch)}"
    if resume >= batch:
        return f"the next run resumes from the checkpoint at batch {resume}"
    return (
        f"the next run resumes from the checkpoint at batch {resume} and redoes {_batches(resume + 1, batch)}"
    )


def _batches(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first}-{last}"


def _exit_bound_text(budget: StopBudget) -> str:
    if budget.notice_s is None:
        return f"checkpoint.upload_wait_s and {SHUTDOWN_GRACE_S:g} s for the shutdown"
    return "preemption.notice_s less preemption.margin_s"


def _already_exiting(signum: int, frame) -> None:
    print(
        f"[preemption] {signal.Signals(signum).name} during shutdown: the process is already exiting",
        flush=True,
    )


def preemption_callback(state: State) -> PreemptionCallback | None:
    return next((cb for cb in state.callbacks if isinstance(cb, PreemptionCallback)), None)


def second_signal(state: State) -> bool:
    """Whether a second SIGTERM/SIGINT asked to stop at once (nothing more may be waited for)."""
    cb = preemption_callback(state)
    return cb is not None and cb.second is not None


def signalled(state: State) -> bool:
    """Whether this rank caught a SIGTERM/SIGINT (the ranks may not have agreed to stop yet)."""
    cb = preemption_callback(state)
    return cb is not None and cb.received is not None


def stop_requested(state: State) -> bool:
    """Whether all ranks agreed to stop early on SIGTERM/SIGINT (the batch now ending is the last).

    For other callbacks (e.g. generation skips its end-of-training samples before a preemption
    checkpoint, to exit quickly).
    """
    return any(isinstance(cb, PreemptionCallback) and cb.stop_signal is not None for cb in state.callbacks)


def exit_request(err: BaseException) -> SystemExit | None:
    """The `SystemExit` a signal raised, if `err` replaced it on the way out, else None.

    A second SIGTERM during a save raises `SystemExit` inside `torch.save`, whose zip writer then
    fails while closing ("unexpected pos ...") and raises a RuntimeError in its place; the exit
    the signal asked for is still in that error's context.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, SystemExit):
            return err
        seen.add(id(err))
        err = err.__context__
    return None
