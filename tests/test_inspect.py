"""The dry run: sizes, FLOPs and the memory plan without allocating the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llm.commands import main as llm_main

REPO = Path(__file__).resolve().parents[1]


def test_7b_dry_run_prints_sizes_and_fits_8_x_80gb(capsys):
    assert llm_main(["inspect", str(REPO / "recipes/7b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "7,000,559,616" in out
    # Hand calculation: 6 * (non-embedding 6,476,271,616 + output 64,000 * 4096) + 12 * 32 * 4096 * 4096
    flops = 6 * (6_476_271_616 + 64_000 * 4096) + 12 * 32 * 4096 * 4096
    assert f"{flops:.4g}" in out
    assert "2,097,152" in out  # tokens per optimizer step: 512 x 4096
    assert "64 samples = 16 micro-batch(es) of 4 x 4096 tokens" in out
    assert "=> this recipe fits on 8 x 80 GB GPUs" in out


def test_7b_does_not_fit_one_gpu(capsys):
    assert llm_main(["inspect", str(REPO / "recipes/7b.yaml"), "--gpus", "1"]) == 0
    assert "=> this recipe does NOT fit on 1 x 80 GB GPUs" in capsys.readouterr().out


def test_train_py_dry_run_builds_tiny_on_meta():
    proc = subprocess.run(
        [sys.executable, "train.py", "recipes/tiny.yaml", "--dry-run", "--gpus", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "58,479,616" in proc.stdout and "16,384" in proc.stdout  # 32 x 512 tokens per step


def test_dry_run_reports_bad_overrides_in_one_line(capsys):
    assert llm_main(["inspect", str(REPO / "recipes/7b.yaml"), "model.dimm=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.dimm" in err and "did you mean 'dim'" in err


def test_llm_inspect_prints_what_the_typed_library_function_returns(capsys):
    from llm.config import load_config
    from llm.memory_plan import describe_run

    assert llm_main(["inspect", str(REPO / "recipes/7b.yaml"), "--gpus", "4", "--gpu-gb", "141"]) == 0
    expected = describe_run(load_config(REPO / "recipes/7b.yaml"), gpus=4, gpu_gb=141.0)
    assert capsys.readouterr().out == expected + "\n"
    assert "on 4 x 141 GB GPUs" in expected
