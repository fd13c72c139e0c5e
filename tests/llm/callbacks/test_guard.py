"""The guard: its rules (pure), its settings, and a non-finite step in a real run (never applied).

The rollbacks themselves, with real `train.py` processes (one rank and two under FSDP2), are in
tests/e2e/test_guard_rollback.py.
"""

from __future__ import annotations

import copy
import math
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
    cfg = GuardConfig(enabled=True, window=3, warmup=0)
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


def test_a_factor_of_zero_turns_its_rule_off():
    detector = SpikeDetector(GuardConfig(enabled=True, window=2, warmup=0, loss_factor=0, grad_factor=0))
    detector.judge(Step(1, 1.0, 1.0))
    assert detector.judge(Step(2, 100.0, 100.0)) is None
    assert detector.judge(Step(3, float("nan"), 1.0)) is not None  # non-finite values always count


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.save_folder=null"], "guard.enabled=true needs checkpoint.save_folder"),
        (
            ["guard.loss_factor=0.9"],
            "guard.loss_factor=0.9 must be above 1 (e.g. 1.5), or 0 to turn that rule off",
        ),
        (["guard.window=0"], "guard.window=0 must be at least 1"),
        (["guard.max_rollbacks=-1"], "guard.max_rollbacks=-1 must be at least 0"),
        (["model.z_loss=-1e-4"], "model.z_loss=-0.0001 must be 0 (off) or positive"),
    ],
)
def test_unusable_guard_settings_are_refused_in_one_line(tmp_path, train_data, overrides, message):
    recipe = write_recipe(tmp_path / "r.yaml", train_data, checkpoint={"save_folder": str(tmp_path / "ck")})
    with pytest.raises(ConfigError) as err:
        load(recipe, "guard.enabled=true", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- a real run: the non-finite step's update is never applied -----------------------------------


class Before(Callback):
    """Copies of the weights and the optimizer state at the start of batch `batch`."""

    def __init__(self, batch: int):
        self.batch = batch
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer: dict = {}

    def batch_start(self, state, logger) -> None:
        if int(state.timestamp.batch) + 1 == self.batch:
            self.weights = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
            self.optimizer = copy.deepcopy(state.optimizers[0].state_dict())


@dataclass
class Stopped:
    error: SpikeStop
    before: Before
    weights: dict[str, torch.Tensor]
    optimizer: dict
    run_dir: Path
    checkpoints: Path


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, train_data) -> Stopped:
    """Guard on with max_rollbacks=0: the NaN loss of batch 3 stops the run at once."""
    from llm.trainer import build_trainer

    root = tmp_path_factory.mktemp("guard-stop")
    recipe = write_recipe(
        root / "r.yaml",
        train_data,
        checkpoint={"save_folder": str(root / "ck"), "save_interval": "2ba"},
        guard={"enabled": True, "max_rollbacks": 0},
        training={
            "global_batch_size": 8,
            "device_microbatch_size": 4,
            "max_duration": "6ba",
            "log_interval": 1,
        },
    )
    before = Before(3)
    trainer = build_trainer(load(recipe), extra_callbacks=[before, LossSpike({3: float("nan")})])
    try:
        with pytest.raises(SpikeStop) as err:
            trainer.fit()
        state = trainer.state
        weights = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
        optimizer = copy.deepcopy(state.optimizers[0].state_dict())
    finally:
        trainer.close()
    return Stopped(err.value, before, weights, optimizer, root / "run", root / "ck")


def test_the_update_of_a_non_finite_step_is_never_applied(stopped):
    assert stopped.before.weights, "the probe saw batch 3 start"
    assert all(torch.isfinite(v).all() for v in stopped.weights.values())
    assert all(torch.equal(stopped.weights[k], v) for k, v in stopped.before.weights.items())
    # AdamW's moments and step counts did not move either (zeroing the gradients would move them).
    assert stopped.optimizer["state"].keys() == stopped.before.optimizer["state"].keys()
    for key, saved in stopped.before.optimizer["state"].items():
        for name, value in saved.items():
            assert torch.equal(stopped.optimizer["state"][key][name], value), (key, name)


def test_past_max_rollbacks_the_run_stops_with_one_line_and_its_last_good_checkpoint(stopped):
    message = str(stopped.error)
    assert "\n" not in message
    assert message.startswith("[guard] loss nan at batch 3 (median ")
    assert (
        "0 rollback(s) within the last 1000 batches (guard.max_rollbacks=0); stopping with exit code 3"
        in message
    )
    assert SpikeStop.EXIT_CODE == 3
    # Nothing was saved after the spike: the checkpoint at 2 is the newest.
    assert sorted(p.name for p in (stopped.checkpoints / "manifests").iterdir()) == [
        "ba0000000002-rank00000.json"
    ]
    rows = read_metrics(stopped.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (
        rows[-1]["guard/stopped"] == 1 and rows[-1]["guard/spike_batch"] == 3 and math.isnan(rows[-1]["loss"])
    )
