"""`composer -n 2` on the CPU (gloo): two ranks train together on different data."""

from __future__ import annotations

import os

import pytest

from tests.support import forkserver
from tests.support.training import REPO, read_metrics, write_recipe

COMPOSER = forkserver.COMPOSER


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([], id="ddp"),
        pytest.param(
            ["fsdp.enabled=true", "fsdp.version=2", "fsdp.activation_checkpointing=true"], id="fsdp2"
        ),
    ],
)
def test_two_ranks_train_on_different_samples(tmp_path, train_data, overrides):
    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    samples = tmp_path / "samples"
    env = {**os.environ, "SAMPLE_LOG_DIR": str(samples)}
    cmd = [COMPOSER, "-n", "2", "tests/support/drivers/train_rank_driver.py", str(recipe), "training.max_duration=6ba",
           "training.eval_interval=6ba", "scheduler.warmup=2ba", "training.log_interval=2", "training.device_microbatch_size=4",
           f"checkpoint.save_folder={tmp_path / 'ckpt'}", "checkpoint.save_interval=6ba", *overrides]  # fmt: skip
    proc = forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    rank0 = (samples / "rank0.txt").read_text().split()
    rank1 = (samples / "rank1.txt").read_text().split()
    assert len(rank0) == len(rank1) == 6 * 4  # 6 steps x (global batch 8 / 2 ranks)
    assert not set(rank0) & set(rank1)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6]
    assert records[-1]["tokens"] == 6 * 8 * train_data.seq_len
    assert "eval_loss" in records[-1]
    assert any((tmp_path / "ckpt").iterdir())
