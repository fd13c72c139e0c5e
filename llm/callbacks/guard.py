"""The guard: loss spikes and non-finite steps, detected, rolled back and skipped without a person.

The recipe's `guard:` section (`llm.config.GuardConfig`; docs/guard.md). Every rank runs the same
code on the same numbers and ends in the same decision; three events of each step:

- AFTER_TRAIN_BATCH: every micro-batch is done, the optimizer has not stepped (Composer's trainer
  passes the optimizer a closure that runs the micro-batches, ending with this event, and the
  update follows it). The guard measures the gradient norm over all parameters before clipping,
  and does `training.grad_clip_norm`'s clipping itself, with the very call of Composer's
  `GradientClipping` algorithm (`torch.nn.utils.clip_grad_norm_`), which the trainer then leaves
  out: Composer runs algorithms before callbacks, so a callback would only see the clipped norm.
  If the norm, or any micro-batch's loss (noted at AFTER_LOSS), is not finite on any rank
  (`all_reduce` MAX), every gradient is set to None. AdamW skips a parameter without a gradient,
  so the step moves neither the weights nor the moments nor the step count and applies no weight
  decay; zeroing the gradients would still do all three. A non-finite step is never applied.
- BATCH_END, first of all callbacks (checked at INIT): the step is judged (`SpikeDetector`) on the
  loss every rank agrees on (Composer's all-reduced `loss/train/total`), the norm above and the
  norm of all weights after the update, and the verdict is agreed once more (`all_reduce` MAX).
  The rules: a value not finite; after the warm-up, against the last `window` good steps, a loss
  above `loss_factor` x their median, or more than `loss_z` x the loss's own noise above it (and
  `loss_rise` above it), a gradient norm above `grad_factor` x its median, and a collapse: a weight
  norm above `weight_factor` x the previous step's, or `flat_steps` losses equal to 6 digits (then
  the rollback goes to before the first of them). A spike at batch S (the S-th batch; the step
  numbering of metrics.jsonl) then:
  1. stops the run (`SpikeStop`, exit 3) if `guard.max_rollbacks` rollbacks already happened within
     the last `guard.max_rollbacks_window` batches, or if there is nothing to roll back to yet:
     nothing is saved after the spike, so the newest checkpoint is the last good state;
  2. else restores model, optimizer, scheduler and RNG from the rollback point
     (`llm.checkpoint.rollback.RollbackPoint`: the state of the newest save at least
     `guard.rewind` batches before the spike, batch R, from its snapshot still in host memory, or
     else from its checkpoint in storage);
  3. adds the window [R, S + skip) to the skip windows (`SkipWindowsCallback`): the batches since
     R, the spike's own and `guard.skip` more are never trained on, and the batch counter moves
     over them, as in a run told `data.skip: [[R, S + skip]]` from the start (llm/data/skip.py);
  4. forgets the steps after R in its medians, prints one line
     (`[guard] loss 9.8 at batch 1200 (median 2.31): rolled back to batch 1150, skipping batches
     1150-1350 (from the snapshot in host memory)`, or the checkpoint's path), logs the event
     (`guard/*` metrics: metrics.jsonl's line of step S and every tracker) and trains on.
  It runs before the other callbacks' BATCH_END and before BATCH_CHECKPOINT, so no checkpoint
  ever holds the spike's state, and what the others record (the learning rate, a preemption's
  checkpoint) is the restored state.

Its checkpointed state (Composer stores callbacks' `state_dict`) is the good steps' history (loss,
gradient norm, weight norm: a record saved before the weight norm was kept has none) and the
rollbacks, so a resumed run judges its first steps against the same medians (no new warm-up) and
counts earlier rollbacks toward the limit. Both are stored as JSON text: a sharded checkpoint
(torch.distributed.checkpoint) flattens a list of dicts into one key per entry, and a resumed run,
whose fresh guard has none yet, would ask for keys the checkpoint does not have.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch
from composer.core import Callback, Precision, State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from llm.callbacks.skip_windows import SkipWindowsCallback
from llm.checkpoint.rollback import RollbackPoint
from llm.config import GuardConfig
from llm.errors import NonFiniteStop, SpikeStop
from llm.loggers import MetricsFile

# From the median absolute deviation to the standard deviation it estimates for normal noise.
MAD_TO_SIGMA = 1.4826
# Losses this close (relative) are "the same": batches of real text never agree to 6 digits, while a
# model that outputs one distribution for every input scores every batch alike (uniform: ln(vocab)).
FLAT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Step:
    """One judged step: its batch (the S-th), the all-rank loss, the gradient norm before clipping,
    and the norm of all weights after its update (None in a checkpoint saved before it was kept)."""

    batch: int
    loss: float
    grad_norm: float
    weight_norm: float | None = None


@dataclass(frozen=True)
class Scores:
    """How one step compares with the good steps before it, as the rules measure it (None: nothing
    to compare with yet). The benchmark of the defaults (bench/guard.py) reads these."""

    loss_ratio: float | None  # the loss / the window's median loss
    loss_z: float | None  # (the loss - that median) / the loss's noise over the window (`_noise`)
    grad_ratio: float | None  # the gradient norm / the window's median gradient norm
    weight_ratio: float | None  # the weight norm / the previous good step's
    flat: int  # losses in a row, this one included, equal to this one within FLAT_TOLERANCE
    flat_since: int  # the batch of the first of them


@dataclass(frozen=True)
class Spike:
    """Why a step is a spike: which value, the value, and its running median (None: none yet);
    `context` replaces "median ..." in the guard's line when another rule than a factor of the
    median fired; `onset` is the first batch whose state is suspect when that is before `batch` (a
    collapse seen by its flat losses): the rollback goes to a state before it."""

    batch: int
    what: str  # "loss" | "gradient norm" | "weight norm"
    value: float
    median: float | None
    context: str | None = None
    onset: int | None = None

    def describe(self) -> str:
        median = "-" if self.median is None else f"{self.median:.4g}"
        return f"{self.what} {self.value:.4g} at batch {self.batch} ({self.context or f'median {median}'})"


class SpikeDetector:
    """The rules of `GuardConfig` over the good steps seen (pure: no Composer, no ranks).

    `history` keeps the last `window` good steps plus `keep` more, so that a rollback up to `keep`
    batches back (`rewind`) leaves exactly the window a run that never took those steps would have.
    `last` is the `Scores` of the step judged last (not kept in checkpoints).
    """

    def __init__(self, cfg: GuardConfig, keep: int = 0):
        self.cfg = cfg
        self.history: deque[Step] = deque(maxlen=cfg.window + max(0, keep))
        self.seen = 0  # good steps judged so far (kept across resumes, less those rolled back)
        self.last: Scores | None = None

    def medians(self) -> tuple[float | None, float | None]:
        recent = list(self.history)[-self.cfg.window :]
        if not recent:
            return None, None
        return statistics.median(s.loss for s in recent), statistics.median(s.grad_norm for s in recent)

    def scores(self, step: Step) -> Scores:
        """`step` against the window of good steps before it (the rules: module docstring)."""
        recent = list(self.history)[-self.cfg.window :]
        flat, since = 1, step.batch
        for earlier in reversed(self.history):
            if not _same(earlier.loss, step.loss):
                break
            flat, since = flat + 1, earlier.batch
        if not recent:
            return Scores(None, None, None, None, flat, since)
        losses = [s.loss for s in recent]
        median = statistics.median(losses)
        noise = _noise(losses)
        rise = step.loss - median
        z = rise / noise if noise > 0 else (math.inf if rise > 0 else 0.0)
        grad_median = statistics.median(s.grad_norm for s in recent)
        previous = recent[-1].weight_norm
        return Scores(
            loss_ratio=_ratio(step.loss, median),
            loss_z=z,
            grad_ratio=_ratio(step.grad_norm, grad_median),
            weight_ratio=None
            if previous is None or step.weight_norm is None
            else _ratio(step.weight_norm, previous),
            flat=flat,
            flat_since=since,
        )

    def judge(self, step: Step) -> Spike | None:
        """The spike `step` is, or None (then it joins the history)."""
        self.last = scores = self.scores(step)
        spike = self._verdict(step, scores)
        if spike is None:
            self.history.append(step)
            self.seen += 1
        return spike

    def _verdict(self, step: Step, scores: Scores) -> Spike | None:
        cfg = self.cfg
        loss_median, norm_median = self.medians()
        if not math.isfinite(step.loss):
            return Spike(step.batch, "loss", step.loss, loss_median)
        if not math.isfinite(step.grad_norm):
            return Spike(step.batch, "gradient norm", step.grad_norm, norm_median)
        if step.weight_norm is not None and not math.isfinite(step.weight_norm):
            return Spike(step.batch, "weight norm", step.weight_norm, None, "the weights are not finite")
        if self.seen < cfg.warmup or loss_median is None:
            return None
        if cfg.loss_factor and scores.loss_ratio > cfg.loss_factor:
            return Spike(step.batch, "loss", step.loss, loss_median)
        if cfg.loss_z and scores.loss_z > cfg.loss_z and scores.loss_ratio > 1 + cfg.loss_rise:
            context = f"median {loss_median:.4g}, {scores.loss_z:.3g} x the loss's noise above it"
            return Spike(step.batch, "loss", step.loss, loss_median, context)
        if cfg.grad_factor and scores.grad_ratio > cfg.grad_factor:
            return Spike(step.batch, "gradient norm", step.grad_norm, norm_median)
        if cfg.weight_factor and scores.weight_ratio is not None and scores.weight_ratio > cfg.weight_factor:
            context = f"{scores.weight_ratio:.3g} x the previous step's {self.history[-1].weight_norm:.4g}"
            return Spike(step.batch, "weight norm", step.weight_norm, None, context)
        if cfg.flat_steps and scores.flat >= cfg.flat_steps:
            # The state after batch flat_since - 1 gave the first of the equal losses: suspect from there.
            context = f"the same loss to 6 digits since batch {scores.flat_since}: a collapsed model"
            return Spike(step.batch, "loss", step.loss, loss_median, context, onset=scores.flat_since - 1)
        return None

    def rewind(self, batch: int) -> None:
        """Forget the steps after `batch` (a rollback to the state after it)."""
        kept = [s for s in self.history if s.batch <= batch]
        self.seen = max(0, self.seen - (len(self.history) - len(kept)))
        self.history = deque(kept, maxlen=self.history.maxlen)

    def state_dict(self) -> dict[str, Any]:
        return {"history": json.dumps([asdict(s) for s in self.history]), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = _records(state.get("history"))  # a record saved before weight_norm was kept lacks it
        self.history = deque((Step(**s) for s in history), maxlen=self.history.maxlen)
        self.seen = int(state.get("seen", len(self.history)))


def _noise(losses: list[float]) -> float:
    """The standard deviation of one loss about the loss's level, robustly and without the trend:
    from the differences of consecutive losses (each holds the noise twice and the trend once: the
    median absolute deviation of the differences, less their median, the trend's step), 1.4826 x
    that MAD / sqrt(2). A spread about the window's median would count the fall of the loss over
    the window as noise, and early in training, while the loss falls fast, take a rise of a third
    for noise (tests/e2e/test_guard_poison.py's window: 0.26 against 0.10)."""
    steps = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    if not steps:
        return 0.0
    trend = statistics.median(steps)
    return MAD_TO_SIGMA * statistics.median(abs(d - trend) for d in steps) / math.sqrt(2)


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else (math.inf if value > 0 else 1.0)


def _same(a: float, b: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= FLAT_TOLERANCE * abs(b)


def _weight_norm(state: State) -> float:
    """The norm of all weights (every rank the same number: under FSDP2 the shards' norms are
    reduced, as for the gradient norm), after this step's update."""
    norm = torch.nn.utils.get_total_norm([p.detach() for p in state.model.parameters()])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(norm.item())


def _records(value: str | list | None) -> list[dict]:
    """A list of records stored as JSON text (or, in checkpoints saved before, as the list itself)."""
    if value is None:
        return []
    return json.loads(value) if isinstance(value, str) else list(value)


@dataclass(frozen=True)
class Rollback:
    """One rollback: the spike's batch, the batch rolled back to, the window skipped."""

    spike_batch: int
    rolled_back_to: int
    skip_from: int
    skip_to: int


class SpikeGuard(Callback):
    """The guard (module docstring). `clip`: `training.grad_clip_norm` (0: no clipping); `keep`:
    how far back a rollback may go with exact medians (the trainer passes two save intervals)."""

    def __init__(
        self,
        cfg: GuardConfig,
        point: RollbackPoint,
        skips: SkipWindowsCallback,
        *,
        clip: float = 0.0,
        keep: int = 0,
    ):
        self.cfg = cfg
        self.point = point
        self.skips = skips
        self.clip = clip
        self.detector = SpikeDetector(cfg, keep)
        self.rollbacks: list[Rollback] = []
        self._bad_loss: torch.Tensor | None = None  # any micro-batch loss of this step not finite
        self._grad_norm = float("nan")
        self._dropped = False  # this step's gradients were dropped: its update was not applied

    def init(self, state: State, logger: Logger) -> None:
        others = [cb for cb in state.callbacks if not isinstance(cb, LoggerDestination)]
        if others[0] is not self:  # Event.INIT runs inside Trainer(): a wrong order fails there
            raise RuntimeError(
                f"callback order: SpikeGuard must be the first callback, not after "
                f"{type(others[0]).__name__}: its rollback must precede what the others record"
            )

    def batch_start(self, state: State, logger: Logger) -> None:
        self._bad_loss, self._grad_norm, self._dropped = None, float("nan"), False

    def after_loss(self, state: State, logger: Logger) -> None:
        loss = state.loss["total"] if isinstance(state.loss, dict) else state.loss
        bad = ~torch.isfinite(loss.detach()).all()
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def after_train_batch(self, state: State, logger: Logger) -> None:
        params = list(state.model.parameters())
        if self.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self.clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        bad_loss = self._bad_loss if self._bad_loss is not None else torch.tensor(False)
        flag = torch.tensor([int(bool(bad_loss)) or int(not torch.isfinite(norm).item())], dtype=torch.int32)
        flag = state.device.tensor_to_device(flag)
        dist.all_reduce(flag, reduce_operation="MAX")
        self._grad_norm = float(norm.item())
        if flag.item():
            self._dropped = True
            if state.precision == Precision.AMP_FP16:
                # Composer steps through a GradScaler, which skips a step with non-finite gradients
                # itself (and fails on an optimizer without any): leave them to it.
                return
            for p in params:
                p.grad = None  # AdamW skips these parameters: no update, no moments, no decay

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        loss = state.total_loss_dict.get("loss/train/total", float("nan"))
        step = Step(batch, float(loss), self._grad_norm, _weight_norm(state))
        spike = self.detector.judge(step)
        if spike is None and self._dropped:
            spike = Spike(batch, "loss", float("nan"), self.detector.medians()[0])
        flag = state.device.tensor_to_device(torch.tensor([0 if spike is None else 1], dtype=torch.int32))
        dist.all_reduce(flag, reduce_operation="MAX")
        if not flag.item():
            return
        if spike is None:  # another rank saw one: the same numbers should have shown it here too
            spike = Spike(batch, "loss", step.loss, self.detector.medians()[0])
        self._handle(state, logger, spike)

    def _handle(self, state: State, logger: Logger, spike: Spike) -> None:
        since = spike.batch - self.cfg.max_rollbacks_window
        recent = [r for r in self.rollbacks if r.spike_batch > since]
        if len(recent) >= self.cfg.max_rollbacks:
            self._stop(
                state,
                logger,
                spike,
                f"{len(recent)} rollback(s) within the last {self.cfg.max_rollbacks_window} batches "
                f"(guard.max_rollbacks={self.cfg.max_rollbacks}); stopping with exit code "
                f"{SpikeStop.EXIT_CODE}, the newest checkpoint is the last good state: look at the "
                "data and the learning rate before resuming",
            )
        at_most = spike.batch - self.cfg.rewind
        if spike.onset is not None:  # a collapse: back to a state before its first suspect one
            at_most = min(at_most, spike.onset - 1)
        restored = self.point.restore(state, logger, at_most=at_most)
        if restored is None:
            self._stop(
                state,
                logger,
                spike,
                f"no checkpoint to roll back to yet; stopping with exit code {SpikeStop.EXIT_CODE}. "
                f"To start over without this batch and the {self.cfg.skip} after it: "
                f"data.skip=[[{(spike.batch if spike.onset is None else spike.onset) - 1},"
                f"{spike.batch + self.cfg.skip}]]",
            )
        rollback = Rollback(spike.batch, restored.batch, restored.batch, spike.batch + self.cfg.skip)
        self.rollbacks.append(rollback)
        self.skips.add(rollback.skip_from, rollback.skip_to)
        self.detector.rewind(restored.batch)
        if dist.get_global_rank() == 0:
            print(
                f"[guard] {spike.describe()}: rolled back to batch {restored.batch}, "
                f"skipping batches {rollback.skip_from}-{rollback.skip_to} (from {restored.source})",
                flush=True,
            )
        logger.log_metrics({f"guard/{k}": v for k, v in asdict(rollback).items()})
        logger.log_metrics({"guard/rollbacks": len(self.rollbacks)})

    def _stop(self, state: State, logger: Logger, spike: Spike, why: str) -> NoReturn:
        logger.log_metrics({"guard/spike_batch": spike.batch, "guard/stopped": 1})
        for destination in logger.destinations:
            if isinstance(destination, MetricsFile):  # its line is written at BATCH_CHECKPOINT: not reached
                destination.flush(state)
        raise SpikeStop(f"[guard] {spike.describe()}: {why}")

    def state_dict(self) -> dict[str, Any]:
        return {**self.detector.state_dict(), "rollbacks": json.dumps([asdict(r) for r in self.rollbacks])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state)
        self.rollbacks = [Rollback(**r) for r in _records(state.get("rollbacks"))]


class NonFiniteLoss(Callback):
    """With the guard off (`guard.enabled: false`): a step whose loss is not finite stops the run
    with one line and exit 3 at its batch end, before Composer's saver can save its state (a run
    with `model.z_loss=1e300` trained on NaN and saved it). Composer all-reduces the loss and reads
    it on the host every step, so the check costs nothing; the weights an update left non-finite
    behind a finite loss are the saver's to refuse (`llm.checkpoint.saver`, at each save)."""

    def batch_end(self, state: State, logger: Logger) -> None:
        loss = state.total_loss_dict.get("loss/train/total")
        if loss is None or math.isfinite(loss):
            return
        for destination in logger.destinations:
            if isinstance(destination, MetricsFile):  # its line is written at BATCH_CHECKPOINT: not reached
                destination.flush(state)
        raise NonFiniteStop(
            f"[guard] loss {loss} at batch {int(state.timestamp.batch)} with guard.enabled=false: stopping "
            f"with exit code {NonFiniteStop.EXIT_CODE} before anything of this step is saved; the newest "
            "checkpoint is the last good state. Lower optimizer.lr or model.z_loss, or set "
            "guard.enabled=true to skip non-finite steps and roll back spikes"
        )
