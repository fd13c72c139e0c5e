"""`make gpu-check`'s CPU smoke run: every check of the GPU acceptance run, at toy sizes, in the suite.

The GPU run itself needs an H100/H200 (docs/scaling.md has its figures when it has run); this
keeps the script working: the real trainer trains the tiny and 7B-shaped recipes, builds the 7B
recipe's trainer, stops on SIGTERM and resumes bit-identically, and generates, and the figures in
the table are consistent with the models' own FLOPs and the memory plan.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
import torch

from bench.gpu_check import LOSS_CHUNK, SMOKE, SMOKE_MEMORY_BYTES, slice_layers, slice_plan
from bench.gpu_check import main as gpu_check_main
from llm.model import ModelConfig, Transformer, count_params
from tests.support import paths

REPO = paths.REPO


def _flops_per_sample(cfg: ModelConfig) -> float:
    with torch.device("meta"):
        model = Transformer(cfg)
    return model.flops_per_batch(1, cfg.max_seq_len - 1)


@pytest.mark.slow
def test_smoke_runs_every_check_through_the_real_trainer_and_prints_one_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = gpu_check_main(["--smoke", "--json", str(out), "--work", str(tmp_path / "work")])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    table = printed.out.strip().splitlines()
    assert table[0].startswith("gpu-check: cpu (smoke") and "17 checks" in table[0]
    assert table[1].split()[:3] == ["check", "ok", "result"]
    listed = json.loads(out.read_text())
    assert all(r["error"] is None for r in listed), listed
    slices = [r for r in listed if r["check"] == "7b-slice"]
    # Each checkpointing policy, float8 (emulated), the profiled window and documents apart, on the
    # same layers.
    assert [s["setting"].split(", ")[1:3] for s in slices] == [
        ["AC none", "fp32"],
        ["AC selective", "fp32"],
        ["AC full", "fp32"],
        ["AC selective", "float8"],
        ["AC selective", "fp32"],
        ["AC selective", "fp32"],
        ["AC selective", "fp32"],
        ["AC auto", "fp32"],
    ]
    assert slices[5]["setting"].endswith(", documents") and "documents" not in slices[1]["setting"]
    # The plain loss head beside the recipes' chunked one (slices[1]): the plan predicts more for it.
    assert slices[6]["setting"].endswith(", plain loss head")
    assert slices[6]["figures"]["planned_bytes"] > slices[1]["figures"]["planned_bytes"]
    # auto: the plan's choice for an 80 GB GPU (the CPU's stand-in) is every block kept whole.
    assert slices[7]["setting"].endswith(
        f"({slices[7]['figures']['layers']} block(s) whole, 0 selective, 0 full)"
    )
    assert len({s["figures"]["layers"] for s in slices}) == 1
    planned = [s["figures"]["planned_bytes"] for s in slices[:3]]
    assert planned[0] > planned[1] > planned[2]  # the plan's order of the policies
    trace = slices[4]["figures"]["trace"]
    assert trace["events"] > 0 and "aten::mm" in trace["block_ops"]
    assert any(op.startswith("aten::_scaled_dot_product") for op in trace["block_ops"])
    assert next(r for r in listed if r["check"] == "float8")["figures"]["speedup"] > 0
    rows = {r["check"]: r for r in listed if r["check"] != "7b-slice"}
    assert list(rows) == [
        "float8",
        "tiny",
        "documents",
        "kernels",
        "7b-init",
        "resume",
        "generation",
        "snapshot",
    ]
    tiny_rows = [r for r in listed if r["check"] == "tiny"]
    assert [r["setting"] for r in tiny_rows] == ["compile off", "compile off, documents"]
    rows["tiny"] = tiny_rows[0]
    rows["7b-slice"] = slices[0]

    # tiny: tokens and FLOPs of the timed batches (global batch 4 of 64-token samples).
    tiny = rows["tiny"]["figures"]
    tiny_cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=64, tie_embeddings=True)
    assert tiny["timed_batches"] == SMOKE.tiny_steps and tiny["tokens"] == SMOKE.tiny_steps * 4 * 64
    assert tiny["flops_per_batch"] == pytest.approx(4 * _flops_per_sample(tiny_cfg))
    assert tiny["tokens_per_s"] == pytest.approx(tiny["tokens"] / tiny["seconds"])
    assert 0 <= tiny["data_wait_share"] < 1 and tiny["mfu"] is None and tiny["peak_memory_bytes"] is None

    # Documents apart against causal: the ratios of the rows' tokens/s; the kernels agree (fp32).
    apart = rows["documents"]["figures"]["ratios"]
    assert apart["tiny"] == pytest.approx(tiny_rows[1]["figures"]["tokens_per_s"] / tiny["tokens_per_s"])
    assert apart["7b-slice"] == pytest.approx(
        slices[5]["figures"]["tokens_per_s"] / slices[1]["figures"]["tokens_per_s"]
    )
    assert tiny_rows[1]["figures"]["flops_per_batch"] == tiny["flops_per_batch"]  # MFU counts the same
    kernels = rows["kernels"]
    assert kernels["ok"] is True and kernels["figures"]["grad_relative_difference"] < 1e-4, kernels

    # 7b-slice: the layers the plan fits on the pretend device, and the plan it is compared with.
    sliced = rows["7b-slice"]["figures"]
    layers = slice_layers(SMOKE, SMOKE_MEMORY_BYTES, checkpointing=False)
    assert 1 < layers < SMOKE.max_layers and sliced["layers"] == layers
    assert sliced["planned_bytes"] == slice_plan(SMOKE, layers, "none", loss_chunk=LOSS_CHUNK).total
    shape = replace(SMOKE.slice_shape, n_layers=layers)
    assert sliced["flops_per_batch"] == pytest.approx(SMOKE.slice_batch * _flops_per_sample(shape))

    # 7b-init: the 7B recipe's trainer at toy size, built for real on the CPU.
    init = rows["7b-init"]["figures"]
    toy_7b = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=1, hidden_dim=344, max_seq_len=64)
    assert init["params"] == count_params(toy_7b).total and init["on_meta"] is False

    # resume after SIGTERM: bit-identical; the generation callback wrote one row per prompt.
    assert rows["resume"]["ok"] is True and rows["resume"]["figures"]["same_weights"] is True
    assert SMOKE.resume_stop <= rows["resume"]["figures"]["stop"] < SMOKE.resume_steps
    assert rows["generation"]["ok"] is True and rows["generation"]["figures"]["samples"] == 3

    # snapshot: the saver's host copy of 16 MiB, exact, and its rate against the 7B's part per rank.
    snap = rows["snapshot"]["figures"]
    assert snap["exact"] is True and snap["pinned"] is False and snap["bytes"] == SMOKE.snapshot_bytes
    assert snap["bytes_per_s"] == pytest.approx(snap["bytes"] / sorted(snap["seconds"])[1])
    assert snap["seven_b_seconds"] == pytest.approx(12 * 7_000_559_616 / 8 / snap["bytes_per_s"])


def test_make_targets_run_the_check_and_its_smoke_mode():
    dry = subprocess.run(
        ["make", "-n", "gpu-check", "gpu-check-smoke"], cwd=REPO, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    commands = [line for line in dry.stdout.splitlines() if "-m bench.gpu_check" in line]
    assert [c.split("-m bench.gpu_check")[1].strip() for c in commands] == ["", "--smoke"], dry.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_the_check_says_to_use_smoke(capsys):
    assert gpu_check_main([]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("error: no CUDA GPU visible") and "--smoke" in printed.err
    assert printed.out == ""
