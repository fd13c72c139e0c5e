"""When to save: every N batches, every so much wall-clock time, or `auto`; and what a save costs.

`checkpoint.save_interval` takes
- a training duration (`500ba`, `1000000tok`, `1ep`): Composer's own interval scheduler, as before
  (the saver gets the string);
- wall-clock time (`90s`, `10m`, `1h`): a save once that much time has passed since the last one
  (or since this process began training);
- `auto`: the fewest batches between saves for which the stall (the training thread's part of a
  save: the snapshot, `llm.checkpoint.saver`) stays under `checkpoint.max_stall` of the training
  time and each save's background part (the write and the upload) ends before the next save
  (`SaveCosts.interval`), from what this run measured: the last save's stall and background
  seconds (`SaveCosts`, kept by the saver and the publisher) and the median time of recent steps
  without a save. A run resumed from a checkpoint whose manifest records what the run before it
  measured (`SaveCosts.record_of`, in rank 0's manifest) starts from those figures, step time
  included, so its first save comes at the steady interval, not after three new steps and a save
  measured anew; otherwise, before the first save, the costs are estimated from the checkpoint's
  size at the default rates of `llm.checkpoint.sizes`. The interval is printed at the first save
  and whenever it changes by more than 2x, with what a preemption without notice costs at it: half
  an interval and the save in flight of work, plus the restart (`SaveCosts.restart_s`: the run's
  last restart as it measured itself, carried in the manifests). The restart is paid once per
  preemption whatever the interval, so it does not move the interval (which the stall and the
  background part set); it moves what a preemption costs, which `llm inspect` projects the same
  way (`llm.memory_plan`).

Composer's `CheckpointSaver` takes a callable interval; `SaveSchedule` is one. Every save falls on
a batch boundary (Composer's BATCH_CHECKPOINT event), so a resume is exact whatever the interval.
Each rank reads its own clock and costs; for time and `auto` the ranks agree on every decision
(one `all_reduce` MAX per batch), so that all of them save the same batch. `SaveCosts` also gives
the preemption notice its projected save (`llm.checkpoint.preemption`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from composer.core import Event, State
from composer.utils import dist

from llm.checkpoint.sizes import stall_free_interval
from llm.config import TrainConfig, counted_in_time, wall_clock_seconds

STEP_WINDOW = 20  # the step time is the median of this many recent steps without a save
FIRST_STEPS = 3  # steps measured before `auto` may save


@dataclass
class SaveCosts:
    """What one save costs this rank: estimated until the first save is measured, then the last
    save's figures (the saver records the stall, the publisher the background part), and the step
    time `auto` last used (the schedule's); or, after a resume, what the run before measured
    (`from_record`, `carried_from`: the checkpoint's batch) until this run measures its own."""

    stall_s: float  # the training thread's part: the snapshot (without it, the local write)
    background_s: float  # the rest, off the training thread: the write from the snapshot, the upload
    measured: bool = False
    saves: int = 0
    step_s: float | None = None  # the median step without a save, as `auto` measured it
    carried_from: int | None = None  # measured before the restart, recorded at this checkpoint
    # The run's last restart, its process's start to its first step (`RestartTimings`), carried on
    # in the manifests: what a preemption costs besides the work (`auto`'s line says it).
    restart_s: float | None = None

    def record(self, *, stall_s: float | None = None, background_s: float | None = None) -> None:
        if stall_s is not None:
            self.stall_s = stall_s
        if background_s is not None:
            self.background_s = background_s
            self.measured = True
            self.saves += 1
            self.carried_from = None

    def record_of(self) -> dict[str, float] | None:
        """What a checkpoint's manifest keeps of these figures (None: nothing measured yet)."""
        if not self.measured:
            return None
        record = {"stall_s": round(self.stall_s, 6), "background_s": round(self.background_s, 6)}
        for key in ("step_s", "restart_s"):
            if getattr(self, key) is not None:
                record[key] = round(getattr(self, key), 6)
        return record

    @classmethod
    def from_record(cls, record: dict | None, batch: int) -> SaveCosts | None:
        """The figures a checkpoint's manifest kept (`record_of`), or None when it kept none or they
        are not positive finite numbers (a manifest written before them, or edited)."""
        record = record or {}
        numbers = [record.get(k) for k in ("stall_s", "background_s", "step_s")]
        given = [n for n in numbers if n is not None]
        if numbers[0] is None or numbers[1] is None or not all(_seconds(n) for n in given):
            return None
        step = float(numbers[2]) if numbers[2] is not None else None
        restart = record.get("restart_s")  # written since issue 42; optional
        restart = float(restart) if restart is not None and _seconds(restart) else None
        return cls(
            float(numbers[0]),
            float(numbers[1]),
            measured=True,
            step_s=step,
            carried_from=batch,
            restart_s=restart,
        )

    @property
    def projected_s(self) -> float:
        """A save from start to stored: what a SIGTERM save needs."""
        return self.stall_s + self.background_s

    def interval(self, step_s: float, max_stall: float) -> int:
        """The fewest batches between saves: the stall at most `max_stall` of the training time,
        and the background part done before the next save (`llm.checkpoint.sizes`, as the dry run)."""
        return stall_free_interval(self.stall_s, self.background_s, step_s, max_stall)


@dataclass
class SaveSchedule:
    """Composer's `save_interval` callable for wall-clock and `auto` intervals (module docstring)."""

    interval: str
    max_stall: float
    costs: SaveCosts
    seconds: float | None = None  # a wall-clock interval; None: auto
    last_save_batch: int | None = None
    last_save_at: float | None = None
    announced: int | None = None  # the auto interval last printed
    _steps: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    _tick: float | None = None
    _saved_at_tick: bool = False

    def __post_init__(self) -> None:
        self.seconds = wall_clock_seconds(self.interval)

    def __call__(self, state: State, event: Event) -> bool:
        elapsed = state.get_elapsed_duration()
        if (
            elapsed is not None
            and elapsed >= 1.0
            and event in (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT)
        ):
            return True  # the end of training saves, as Composer's own scheduler does
        if event != Event.BATCH_CHECKPOINT:
            return False
        now, batch = time.monotonic(), int(state.timestamp.batch)
        if self._tick is not None and not self._saved_at_tick:
            self._steps.append(now - self._tick)
            if len(self._steps) >= FIRST_STEPS:  # what the checkpoints record, whatever the interval
                self.costs.step_s = statistics.median(self._steps)
        if self.last_save_batch is None:  # the first batch of this process: count from its start
            self.last_save_batch, self.last_save_at = batch - 1, now
        due = _agree(state, self._due(batch, now))
        self._tick, self._saved_at_tick = time.monotonic(), due
        if due:
            self.last_save_batch, self.last_save_at = batch, now
        return due

    def _due(self, batch: int, now: float) -> bool:
        if self.seconds is not None:
            return now - self.last_save_at >= self.seconds
        every = self.auto_interval()
        return every is not None and batch - self.last_save_batch >= every

    @property
    def step_s(self) -> float | None:
        """The median of this process's recent steps, or before it has `FIRST_STEPS` of them, the
        step time carried over from before the restart (None: none)."""
        if len(self._steps) < FIRST_STEPS:
            return self.costs.step_s  # None in a fresh run; after a resume, the run before's
        return statistics.median(self._steps)

    def auto_interval(self) -> int | None:
        """`auto`'s interval in batches from the costs and step time known now (None: too early)."""
        step = self.step_s
        if step is None:
            return None
        every = self.costs.interval(step, self.max_stall)
        if self.announced is None or not self.announced / 2 <= every <= 2 * self.announced:
            self.announced = every
            if dist.get_global_rank() == 0:
                print(f"[checkpoint] {self.describe(every, step)}", file=sys.stderr, flush=True)
        return every

    def describe(self, every: int, step_s: float) -> str:
        c = self.costs
        if c.carried_from is not None:
            basis = f"measured before the restart (recorded with the checkpoint at batch {c.carried_from})"
        else:
            basis = "measured" if c.measured else "estimated from the checkpoint's size, no save measured yet"
        stall = c.stall_s / (c.stall_s + every * step_s)
        work = every * step_s / 2 + c.background_s  # half an interval and the save in flight
        restart = (
            f" + {c.restart_s:.1f} s of restart (the run's last, measured)"
            if c.restart_s is not None
            else " + the restart (none measured yet)"
        )
        return (
            f"save_interval auto: every {every} batch(es) ({every * step_s:.1f} s); a save stalls training "
            f"{c.stall_s:.3f} s ({100 * stall:.2f}% of the time, at most {100 * self.max_stall:g}%: "
            f"checkpoint.max_stall) and is written and stored in {c.background_s:.2f} s in the background; "
            f"a step takes {step_s:.3f} s; costs {basis}; a preemption without notice costs on average "
            f"{work:.1f} s of work (half an interval and the save in flight){restart}"
        )


def _seconds(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf")


def _agree(state: State, due: bool) -> bool:
    """True on every rank if it is true on any (each rank reads its own clock)."""
    if dist.get_world_size() == 1:
        return due
    flag = state.device.tensor_to_device(torch.tensor([1 if due else 0], dtype=torch.int32))
    dist.all_reduce(flag, reduce_operation="MAX")
    return bool(flag.item())


def save_interval(cfg: TrainConfig, costs: SaveCosts) -> str | SaveSchedule:
    """What Composer's saver gets for `checkpoint.save_interval`."""
    ck = cfg.checkpoint
    if not counted_in_time(ck.save_interval):
        return ck.save_interval
    return SaveSchedule(ck.save_interval.strip(), ck.max_stall, costs)
