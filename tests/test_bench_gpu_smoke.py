"""The GPU bench's CPU smoke mode: the one-GPU script keeps running, and its figures add up."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.gpu import SMOKE_MEMORY_BYTES, SMOKE_SLICE_SHAPE, SMOKE_TINY, slice_layers_that_fit
from llm.meta_init import build_meta_model

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_smoke_trains_both_models_and_reports_consistent_figures(tmp_path):
    out = tmp_path / "bench.json"
    result = run_bench("--smoke", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s" in result.stdout and "TFLOP/s" in result.stdout and "MFU" in result.stdout
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"tiny", "7b-slice"}

    slice_layers = slice_layers_that_fit(SMOKE_SLICE_SHAPE, 2, SMOKE_MEMORY_BYTES, cap=8)
    expected = {"tiny": SMOKE_TINY, "7b-slice": replace(SMOKE_SLICE_SHAPE, n_layers=slice_layers)}
    for name, cfg in expected.items():
        row, model = rows[name], build_meta_model(cfg, seed=0)
        assert row["error"] is None and row["compile"] is False and row["steps"] == 3
        assert row["layers"] == cfg.n_layers and row["params"] == model.num_params()
        assert row["tokens_per_s"] > 0
        flops = model.flops_per_token(cfg.max_seq_len) * row["tokens_per_s"]
        assert row["tflops_per_s"] == pytest.approx(flops / 1e12, rel=1e-9)
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # CPU: no peak to compare with
        # Small initial weights give near-uniform predictions over random tokens: loss ~ ln(vocab).
        assert abs(row["first_loss"] - math.log(cfg.vocab_size)) < 0.3
        assert math.isfinite(row["last_loss"])
    assert 1 < slice_layers < 8, "the smoke budget should fit some layers, not all of them"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_the_full_bench_says_to_use_smoke():
    result = run_bench()
    assert result.returncode != 0
    assert "--smoke" in result.stderr and "Traceback" not in result.stderr
