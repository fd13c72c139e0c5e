"""The guard's demo (scenarios/guard_demo.py) at a small size: the derailed run, guard off and on.

Three real training processes on the suite's shards of real text; the README's figures come from
`make demo-guard`, the same code at the demo's size.
"""

from __future__ import annotations

import pytest

from scenarios.guard_demo import DemoSettings, run_demo
from tests.support.training import read_metrics

pytestmark = pytest.mark.slow

SMALL = DemoSettings(
    dim=32,
    n_layers=2,
    n_heads=4,
    batch_size=8,
    max_batches=60,
    save_interval=10,
    spike_from=40,
    spike_batches=3,
    guard_skip=5,
    guard_warmup=10,
    eval_batches=4,
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, train_data):
    out = tmp_path_factory.mktemp("guard-demo")
    return run_demo(train_data.train.parent, train_data.tokenizer, out, SMALL)


def test_with_the_guard_on_the_run_rolls_back_skips_the_window_and_ends_near_the_clean_run(demo):
    assert [r.returncode for r in demo.runs] == [0, 0, 0], demo.on.guard_lines
    assert demo.clean.guard_lines == demo.off.guard_lines == []
    (line,) = demo.on.guard_lines
    # The oversized update of batch 41 jumps the weight norm at once (its loss shows only in batch
    # 42's): back to the save at 40, before any loss saw it.
    assert line.startswith("[guard] weight norm ") and " at batch 41 (" in line
    assert line.endswith("rolled back to batch 40, skipping batches 40-46 (from the snapshot in host memory)")
    assert demo.on.skipped == [[40, 46]] and demo.off.skipped == []
    clean, off, on = demo.clean.eval_loss, demo.off.eval_loss, demo.on.eval_loss
    assert off > clean + 0.3, (clean, off, on)  # derailed and not recovered by the end
    assert abs(on - clean) < 0.1, (clean, off, on)
    # Before the window the guard changes nothing: its clipping is Composer's GradientClipping.
    before = [read_metrics(r.run_dir / "metrics.jsonl") for r in (demo.off, demo.on)]
    assert [[(r["step"], r["loss"]) for r in rows if r["step"] <= 40] for rows in before] == [
        [(r["step"], r["loss"]) for r in before[0] if r["step"] <= 40]
    ] * 2
    assert demo.figure.read_bytes()[:4] == b"\x89PNG"
    table = demo.table()
    assert "learning rate x300 in batches 40-43" in table and "guard-on" in table and "40-46" in table
