"""The guard: its rules (pure), its settings, and a non-finite step in a real run (never applied).

The rollbacks themselves, with real `train.py` processes (one rank and two under FSDP2), are in
tests/e2e/test_guard_rollback.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from composer.core import Callback

from llm.callbacks.guard import SpikeDetector, Step
from llm.config import GuardConfig
from llm.errors import ConfigError, SpikeStop
from scenarios.resume_driver import LossSpike
from tests.support.training import load, read_metrics, write_recipe


def _steps(losses, norms=None, start=1):
    norms = norms or [1.0] * len(losses)
    return [Step(start + i, loss, norm) for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))]


def test_non_finite_values_are_spikes_from_the_first_step_the_factor_rules_after_warmup():
    detector = SpikeDetector(GuardConfig(enabled=True, window=4, warmup=3, loss_factor=1.5, grad_factor=10))
    assert detector.judge(Step(1, float("nan"), 1.0)).describe() == "loss nan at batch 1 (median -)"
    assert detector.judge(Step(1, 3.0, float("inf"))).what == "gradient norm"
    assert detector.judge(Step(1, 9.0, 1.0)) is None  # warmup: not judged by the factors yet
    assert [detector.judge(s) for s in _steps([3.0, 2.0], start=2)] == [None, None]
    spike = detector.judge(Step(4, 9.0, 1.0))  # 9 > 1.5 x median(9, 3, 2) = 4.5
    assert (spike.what, spike.value, spike.median) == ("loss", 9.0, 3.0)
    assert detector.judge(Step(4, 4.4, 1.0)) is None
    spike = detector.judge(Step(5, 3.0, 50.0))
    assert (spike.what, spike.median) == ("gradient norm", 1.0)
    assert detector.seen == 4 and [s.batch for s in detector.history] == [1, 2, 3, 4]


def test_the_medians_cover_the_last_window_good_steps_and_a_rollback_forgets_the_steps_after_it():
    cfg = GuardConfig(enabled=True, window=3, warmup=0, loss_z=0)  # the factor of the median alone
    detector = SpikeDetector(cfg, keep=4)
    for step in _steps([5.0, 4.0, 3.0, 2.0, 2.0, 2.0]):
        detector.judge(step)
    assert detector.medians() == (2.0, 1.0)
    detector.rewind(3)  # back to the state after batch 3: steps 4-6 never happened
    assert [s.batch for s in detector.history] == [1, 2, 3] and detector.seen == 3
    assert detector.medians() == (4.0, 1.0)
    # What a run that never took steps 4-6 has: the same history, the same verdicts from here on.
    fresh = SpikeDetector(cfg, keep=4)
    for step in _steps([5.0, 4.0, 3.0]):
        fresh.judge(step)
    assert fresh.state_dict() == detector.state_dict()
    restored = SpikeDetector(cfg, keep=4)
    restored.load_state_dict(detector.state_dict())
    assert restored.judge(Step(4, 6.1, 1.0)) is not None and restored.judge(Step(4, 5.9, 1.0)) is None


def test_the_guards_state_resumes_from_a_sharded_checkpoint_into_a_fresh_guard(tmp_path):
    """torch.distributed.checkpoint loads into the fresh guard's own state dict: its keys have to
    be the ones the saved guard had (a list of records is stored as one value, not one per entry)."""
    import torch.distributed.checkpoint as dcp

    from llm.callbacks.guard import Rollback, SpikeGuard

    cfg = GuardConfig(enabled=True, window=3, warmup=0)
    saved = SpikeGuard(cfg, point=None, skips=None, keep=2)
    for step in _steps([5.0, 4.0, 3.0, 2.0]):
        saved.detector.judge(step)
    saved.rollbacks.append(Rollback(9, 4, 4, 12))
    dcp.save({"guard": saved.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    fresh = SpikeGuard(cfg, point=None, skips=None, keep=2)
    into = {"guard": fresh.state_dict()}
    dcp.load(into, checkpoint_id=tmp_path, no_dist=True)
    fresh.load_state_dict(into["guard"])
    assert [s.batch for s in fresh.detector.history] == [1, 2, 3, 4] and fresh.detector.seen == 4
    assert fresh.rollbacks == [Rollback(9, 4, 4, 12)] and fresh.state_dict() == saved.state_dict()


def test_a_factor_of_zero_turns_its_rule_off():
    off = {"loss_factor": 0, "grad_factor": 0, "loss_z": 0, "weight_factor": 0, "flat_steps": 0}
    detector = SpikeDetector(GuardConfig(enabled=True, window=2, warmup=0, **off))
    detector.judge(Step(1, 1.0, 1.0, 1.0))
    assert detector.judge(Step(2, 100.0, 100.0, 100.0)) is None
    assert [detector.judge(Step(b, 100.0, 1.0, 100.0)) for b in range(3, 9)] == [None] * 6  # flat: off
    assert detector.judge(Step(9, float("nan"), 1.0)) is not None  # non-finite values always count
    assert detector.judge(Step(9, 1.0, 1.0, float("inf"))).describe() == (
        "weight norm inf at batch 9 (the weights are not finite)"
    )


# A loss around 7.0 with the noise of small batches (a standard deviation of 0.05), falling a little.
_RNG = random.Random(7)
NOISY = [7.0 - 0.002 * i + _RNG.gauss(0, 0.05) for i in range(40)]


def test_a_rise_well_outside_the_losss_own_noise_is_a_spike_though_under_the_factor():
    detector = SpikeDetector(GuardConfig(enabled=True, window=40, warmup=10))
    for step in _steps(NOISY):
        assert detector.judge(step) is None
    median = statistics.median(NOISY)
    # A third above the median (the poisoned batches: 9.6 against 7.0, 1.37): far under
    # loss_factor's 1.5, tens of times the loss's noise above the median.
    spike = detector.judge(Step(41, 9.3, 1.0))
    assert spike.describe().startswith(f"loss 9.3 at batch 41 (median {median:.4g}, ")
    assert spike.describe().endswith(" x the loss's noise above it)")
    assert detector.last.loss_ratio == pytest.approx(9.3 / median) and detector.last.loss_z > 20
    # Inside the noise: let through; and so is a rise under loss_rise (10 %), whatever its z.
    assert detector.judge(Step(41, median + 0.1, 1.0)) is None and detector.last.loss_z < 3
    assert detector.judge(Step(42, median * 1.09, 1.0)) is None and detector.last.loss_z > 6


def test_the_noise_is_the_losss_own_not_its_fall_nor_a_wide_spread():
    """Early in training the loss falls fast: its spread about the median is mostly the fall, and a
    rise of a third would pass for noise; the noise comes from consecutive differences instead."""
    rng = random.Random(8)
    falling = [9.0 - 0.05 * i + rng.gauss(0, 0.05) for i in range(40)]
    detector = SpikeDetector(GuardConfig(enabled=True, window=40, warmup=10))
    for step in _steps(falling):
        assert detector.judge(step) is None  # each below the median: never a spike
    spread = 1.4826 * statistics.median(abs(x - statistics.median(falling)) for x in falling)
    assert spread > 0.5 and detector.judge(Step(41, 7.0 * 1.33, 1.0)) is not None
    # A loss that moves a lot from batch to batch: the same rise is noise there.
    wide = [7.0 + rng.gauss(0, 0.6) for _ in range(40)]
    detector = SpikeDetector(GuardConfig(enabled=True, window=40, warmup=10))
    for step in _steps(wide):
        detector.judge(step)
    assert (
        detector.judge(Step(41, statistics.median(wide) * 1.33, 1.0)) is None and 1 < detector.last.loss_z < 6
    )


def test_a_gradient_norm_alone_rolls_back_only_where_its_rule_is_set():
    """A clean run's gradient norm reached 28 x its median with its loss and weights unmoved (the
    tiny model in bench/guard.py, clipped at 1.0): off by default, a rollback with grad_factor."""
    steps = _steps(NOISY[:20], norms=[2.0 + 0.1 * (i % 3) for i in range(20)])
    for cfg in (
        GuardConfig(enabled=True, window=20, warmup=5),
        GuardConfig(enabled=True, window=20, warmup=5, grad_factor=10),
    ):
        detector = SpikeDetector(cfg)
        for step in steps:
            detector.judge(step)
        verdict = detector.judge(Step(21, NOISY[20], 61.1, None))
        assert (verdict is None) == (cfg.grad_factor == 0) and detector.last.grad_ratio > 28


def test_a_jump_of_the_weight_norm_is_a_collapse_caught_at_the_step_that_made_it():
    detector = SpikeDetector(GuardConfig(enabled=True, window=4, warmup=3))
    for batch in range(1, 6):
        assert detector.judge(Step(batch, 7.0 - 0.1 * batch, 1.0, 100.0 + batch)) is None
    spike = detector.judge(Step(6, 6.4, 1.0, 1.5e9))  # the update of a learning rate x1e8
    assert spike.describe() == "weight norm 1.5e+09 at batch 6 (1.43e+07 x the previous step's 105)"
    assert spike.onset is None  # the state before this step's update is good: the rollback's usual
    assert detector.judge(Step(6, 6.4, 1.0, 150.0)) is None  # 1.43 x: under weight_factor 1.5
    # A step judged after a resume from a checkpoint that kept no weight norms: nothing to compare.
    older = SpikeDetector(GuardConfig(enabled=True, window=4, warmup=0))
    older.load_state_dict({"history": json.dumps([{"batch": 1, "loss": 7.0, "grad_norm": 1.0}]), "seen": 1})
    assert older.history[0].weight_norm is None
    assert older.judge(Step(2, 7.0, 1.0, 1e9)) is None and older.last.weight_ratio is None
    assert older.judge(Step(3, 7.0, 1.0, 1e12)) is not None


def test_losses_equal_to_six_digits_are_a_collapsed_model_rolled_back_to_before_the_first():
    detector = SpikeDetector(GuardConfig(enabled=True, window=100, warmup=5))
    for step in _steps([x + 1.2 for x in NOISY[:20]]):  # about 8.2: a loss still high, as early on
        detector.judge(step)
    uniform = math.log(4096)  # every later loss of a model that outputs the uniform distribution
    verdicts = [detector.judge(Step(b, uniform * (1 + 1e-7 * (b % 2)), 0.01)) for b in range(21, 26)]
    assert verdicts[:4] == [None] * 4
    spike = verdicts[4]
    assert spike.describe() == (
        "loss 8.318 at batch 25 (the same loss to 6 digits since batch 21: a collapsed model)"
    )
    assert spike.onset == 20  # the state after batch 20 gave the first equal loss
    assert (detector.last.flat, detector.last.flat_since) == (5, 21)
    # Not during the warm-up: a fresh model's losses can sit at ln(vocab) for a while.
    fresh = SpikeDetector(GuardConfig(enabled=True, window=100, warmup=10))
    assert [fresh.judge(Step(b, uniform, 1.0)) for b in range(1, 9)] == [None] * 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.save_folder=null"], "guard.enabled=true needs checkpoint.save_folder"),
        (
            ["guard.loss_factor=0.9"],
            "guard.loss_factor=0.9 must be above 1 (e.g. 1.5), or 0 to turn that rule off",
        ),
        (["guard.window=0"], "guard.window=0 must be at least 1"),
        (
            ["guard.weight_factor=0.5"],
            "guard.weight_factor=0.5 must be above 1 (e.g. 1.5), or 0 to turn that rule off",
        ),
        (["guard.flat_steps=1"], "guard.flat_steps=1 must be at least 2, or 0 to turn that rule off"),
        (["guard.loss_z=-1"], "guard.loss_z=-1"),
        (["guard.max_rollbacks=-1"], "guard.max_rollbacks=-1 must be 0 or more"),
        (["model.z_loss=-1e-4"], "model.z_loss=-0.0001 must be 0 (off) up to 1"),
    ],
)
def test_unusable_guard_settings_are_refused_in_one_line(tmp_path, train_data, overrides, message):
    recipe = write_recipe(tmp_path / "r.yaml", train_data, checkpoint={"save_folder": str(tmp_path / "ck")})
    with pytest.raises(ConfigError) as err:
        load(recipe, "guard.enabled=true", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- a real run: a rollback from S3, then the limit; the non-finite step never applied ------------


class Before(Callback):
    """Copies of the weights and the optimizer state at the start of batch `batch`; the state."""

    def __init__(self, batch: int):
        self.batch = batch
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer: dict = {}
        self.state = None

    def batch_start(self, state, logger) -> None:
        self.state = state
        if int(state.timestamp.batch) + 1 == self.batch:
            self.weights = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
            self.optimizer = copy.deepcopy(state.optimizers[0].state_dict())


@dataclass
class Capped:
    code: int
    stdout: str
    stderr: str
    before: Before
    run_dir: Path
    save_folder: str


@pytest.fixture(scope="module")
def capped(tmp_path_factory, train_data, s3_server) -> Capped:
    """`train.py` in this process, checkpoints on S3 every 4 batches, guard.rewind=5 and
    max_rollbacks=1: batch 9's loss x 50 rolls back past the checkpoint at 8 to the one at 4
    (skipping 4-11), batch 12's NaN loss is one spike too many."""
    import train

    root = tmp_path_factory.mktemp("guard-capped")
    save_folder = f"s3://{s3_server.create_bucket('guard-capped')}/ckpt"
    recipe = write_recipe(
        root / "r.yaml",
        train_data,
        checkpoint={"save_folder": save_folder, "save_interval": "4ba"},
        guard={"enabled": True, "max_rollbacks": 1, "rewind": 5, "window": 4, "warmup": 3, "skip": 2},
        training={
            "global_batch_size": 8,
            "device_microbatch_size": 4,
            "max_duration": "12ba",
            "log_interval": 1,
        },
    )
    before = Before(12)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = train.main([str(recipe)], extra_callbacks=[before, LossSpike({9: 50.0, 12: float("nan")})])
    return Capped(code, stdout.getvalue(), stderr.getvalue(), before, root / "run", save_folder)


@pytest.mark.s3
def test_the_update_of_a_non_finite_step_is_never_applied(capped):
    before, state = capped.before, capped.before.state
    assert before.weights, "the probe saw batch 12 start"
    weights = state.model.state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert all(torch.equal(weights[k], v) for k, v in before.weights.items())
    # AdamW's moments and step counts did not move either (zeroing the gradients would move them).
    optimizer = state.optimizers[0].state_dict()
    assert optimizer["state"].keys() == before.optimizer["state"].keys()
    for key, saved in before.optimizer["state"].items():
        for name, value in saved.items():
            assert torch.equal(optimizer["state"][key][name], value), (key, name)


@pytest.mark.s3
def test_a_loss_spike_rolls_back_and_past_max_rollbacks_the_run_stops_with_exit_3(capped):
    from llm.checkpoint import manifest as cm
    from storage import open_store

    assert capped.code == SpikeStop.EXIT_CODE == 3, capped.stderr[-3000:]
    (rollback,) = [line for line in capped.stdout.splitlines() if line.startswith("[guard]")]
    # guard.rewind=5: the newest checkpoint at or before batch 4, not the one at 8.
    assert rollback.startswith("[guard] loss ") and " at batch 9 (median " in rollback
    # The snapshot in memory is the save at 8: too new, so the checkpoint at 4 comes from S3.
    assert rollback.endswith(
        f"rolled back to batch 4, skipping batches 4-11 (from the checkpoint {capped.save_folder}/ep0-ba4-rank0.pt)"
    )
    stop = capped.stderr.strip().splitlines()[-1]
    assert stop.startswith("[guard] loss nan at batch 12 (median ")
    assert stop.endswith(
        "1 rollback(s) within the last 1000 batches (guard.max_rollbacks=1); stopping with exit code 3, "
        "the newest checkpoint is the last good state: look at the data and the learning rate before resuming"
    )
    assert "Traceback" not in capped.stderr
    # Nothing is saved after a spike: the checkpoints of 4 and 8 stay, 8 the newest.
    checkpoints, _ = cm.scan(open_store(capped.save_folder))
    assert sorted(c.batch for c in checkpoints if c.complete) == [4, 8]
    rows = read_metrics(capped.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [*range(1, 10), 12]
    assert rows[8]["guard/rolled_back_to"] == 4 and rows[8]["guard/skip_to"] == 11 and rows[8]["loss"] > 50
    assert rows[-1]["guard/stopped"] == 1 and rows[-1]["guard/spike_batch"] == 12
    assert math.isnan(rows[-1]["loss"])


# --- the guard off: a non-finite step still never reaches a checkpoint --------------------------


@dataclass
class Unguarded:
    code: int
    stderr: str
    ckpt: Path


def _unguarded(root: Path, train_data, spike: Callback) -> Unguarded:
    """`train.py` in this process with the guard off (the default), a local checkpoint every 4
    batches, and `spike` derailing one batch."""
    import train

    recipe = write_recipe(
        root / "r.yaml",
        train_data,
        checkpoint={"save_folder": str(root / "ckpt"), "save_interval": "4ba"},
        training={
            "global_batch_size": 8,
            "device_microbatch_size": 8,
            "max_duration": "12ba",
            "log_interval": 1,
        },
    )
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        code = train.main([str(recipe)], extra_callbacks=[spike])
    return Unguarded(code, stderr.getvalue(), root / "ckpt")


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory, train_data) -> tuple[Unguarded, Unguarded]:
    """Two runs: batch 6's loss is NaN (as from model.z_loss=1e300), and batch 4's update is
    non-finite with a finite loss (its learning rate x inf), on a save batch."""
    from scenarios.resume_driver import LearningRateSpike

    nan_loss = _unguarded(tmp_path_factory.mktemp("unguarded-loss"), train_data, LossSpike({6: math.nan}))
    bad_update = _unguarded(
        tmp_path_factory.mktemp("unguarded-update"), train_data, LearningRateSpike(3, 4, math.inf)
    )
    return nan_loss, bad_update


def _manifest_batches(ckpt: Path) -> list[int]:
    return sorted(int(p.name[2:12]) for p in (ckpt / "manifests").glob("ba*.json"))


def test_with_the_guard_off_a_non_finite_loss_stops_the_run_before_its_step_is_saved(unguarded):
    # Issue 39 item 5: loss nan from step 2, checkpoints of NaN weights, rc 0.
    run = unguarded[0]
    assert run.code == SpikeStop.EXIT_CODE == 3, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("[guard]")]
    assert line.startswith("[guard] loss nan at batch 6 with guard.enabled=false: stopping with exit code 3")
    assert "the newest checkpoint is the last good state" in line and "guard.enabled=true" in line
    assert "Traceback" not in run.stderr
    assert _manifest_batches(run.ckpt) == [4]  # nothing of batch 6 or later


def test_with_the_guard_off_non_finite_weights_after_a_finite_loss_are_never_saved(unguarded):
    run = unguarded[1]
    assert run.code == 3, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("[guard]")]
    assert line.startswith("[guard] the weights after batch 4 are not finite (its loss was ")
    assert "not saved; stopping with exit code 3" in line
    assert _manifest_batches(run.ckpt) == []
    assert not list(run.ckpt.glob("ep*"))  # no file of the refused save either
