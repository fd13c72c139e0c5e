"""Save a checkpoint when the process is told to stop (SIGTERM from a spot reclaim, or Ctrl-C).

Composer 0.32.1 turns SIGTERM/SIGINT into `sys.exit(128 + signal)` at once and saves nothing.
This callback replaces that handler while training runs:

- the handler only records the signal (a second signal exits at once, through Composer's handler:
  if that cuts a save short, the publisher deletes the partial file at close, and `exit_request`
  lets the command exit with 128 + signal even where torch.save turned the exit into an error);
- at every `batch_end` all ranks agree (`all_reduce` MAX), so a signal seen by any rank stops all
  of them after the same batch; `state.stop_training()` then makes that batch the last one, and
  Composer's saver writes its end-of-training checkpoint there (the publisher stores it);
- at `fit_end` (this callback must be the last one; checked when the Trainer is built) the process exits with 128 + the signal
  number: 143 for SIGTERM, 130 for SIGINT, the codes a shell and launchers expect, after one
  `[preemption]` line saying what the publisher reported (`StopSave`): the checkpoint stored, or,
  when the storage could not take it within `checkpoint.upload_wait_s` of the signal (an outage, an
  upload still in flight), which checkpoint the next run resumes from and the batches it redoes.
  A preemption notice is short: the signal is never held for the storage's whole outage budget.
- with `preemption.notice_s` (the time the platform leaves between SIGTERM and the kill), the
  publisher starts no save that cannot be stored in time: the save's projected seconds (this
  run's measured snapshot, write and upload, `llm.checkpoint.schedule.SaveCosts`, plus what is
  left of an upload in flight) must fit the notice less `preemption.margin_s`; if not, the upload
  in flight is let finish within that time and the line names the checkpoint the next run resumes
  from and the batches it redoes. The waits after the signal end with the notice less its margin.

`stop_training()` lowers `state.max_duration`, which is not part of a Composer checkpoint: the
resumed run trains to the recipe's `max_duration`.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


@dataclass(frozen=True)
class StopSave:
    """What became of the checkpoint saved on the signal (the publisher reports it)."""

    batch: int  # the batch it was saved at
    stored: bool
    resume_batch: int | None  # the newest complete checkpoint the next run resumes from (None: none)
    reason: str = ""  # why it was not stored
    started: bool = True  # False: no save was started (it could not end within preemption.notice_s)


class PreemptionCallback(Callback):
    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: int | None = None  # the signal this process caught
        self.received_at: float | None = None
        self.stop_signal: int | None = None  # the signal all ranks agreed to stop on
        self.stop_batch: int | None = None
        self.second: int | None = None  # a second signal, which stops the process at once
        self.save_outcome: StopSave | None = None  # set by the publisher (no save_folder: None)
        self._previous: dict[int, object] = {}

    def init(self, state: State, logger: Logger) -> None:
        # Composer's profiler (training.profile) appends its own callbacks after ours: not counted.
        ours = [cb for cb in state.callbacks if not type(cb).__module__.startswith("composer.profiler")]
        if ours[-1] is not self:  # Event.INIT runs inside Trainer(): fail there, not at fit_end
            raise RuntimeError(
                "callback order: PreemptionCallback must be the last callback, so that it exits only "
                "after every other callback's fit_end (build it with llm.checkpoint.plan_checkpointing)"
            )

    def fit_start(self, state: State, logger: Logger) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("training runs outside the main thread: no checkpoint will be saved on SIGTERM")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            self.second = signum
            self._chain(signum, frame)  # second signal: stop now, as Composer would
            return
        self.received = signum
        self.received_at = time.monotonic()

    def batch_end(self, state: State, logger: Logger) -> None:
        flag = state.device.tensor_to_device(torch.tensor([self.received or 0], dtype=torch.int32))
        dist.all_reduce(flag, reduce_operation="MAX")
        agreed = int(flag.item())
        if agreed and self.stop_signal is None:
            self.stop_signal = agreed
            self.stop_batch = int(state.timestamp.batch)
            if self.received_at is None:  # another rank got the signal
                self.received_at = time.monotonic()
            log.warning(
                "%s received: stopping after batch %d and saving a checkpoint",
                signal.Signals(agreed).name,
                self.stop_batch,
            )
            state.stop_training()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._restore()
        if self.stop_signal is None:
            return
        code = EXIT_CODES.get(self.stop_signal, 128 + self.stop_signal)
        # Printed, not logged: the launcher's log is what an operator reads after a preemption.
        print(f"[preemption] {self._describe(code)}", flush=True)
        sys.stdout.flush()
        if threading.current_thread() is threading.main_thread():
            # Stored and on the way out: a further signal must not raise SystemExit inside the
            # close and atexit hooks (a traceback), only say that the exit is under way.
            for sig in self.signals:
                signal.signal(sig, _already_exiting)
        sys.exit(code)

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
        since = outcome.resume_batch or 0
        resume = (
            f"the next run resumes from the checkpoint at batch {since}"
            if outcome.resume_batch is not None
            else "no checkpoint is complete: the next run starts from scratch"
        )
        redo = f"batch {since + 1}" if outcome.batch == since + 1 else f"batches {since + 1}-{outcome.batch}"
        if not outcome.started:
            return (
                f"{name}: no checkpoint saved at batch {outcome.batch} ({outcome.reason}); {resume} and "
                f"redoes {redo}; exiting with code {code}"
            )
        return (
            f"{name}: the checkpoint at batch {outcome.batch} was not stored within {seconds:.0f} s of the "
            f"signal ({outcome.reason}); {resume} and redoes {redo}; exiting with code {code}"
        )

    def close(self, state: State, logger: Logger) -> None:
        self._restore()
        if self.second is not None:
            print(
                f"[preemption] second {signal.Signals(self.second).name}: stopped at once at batch "
                f"{int(state.timestamp.batch)} without storing a checkpoint; the newest complete "
                f"checkpoint stays the resume point; exiting with code {128 + self.second}",
                flush=True,
            )

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
