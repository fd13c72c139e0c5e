"""Float8 training (emulated on the CPU) through the real trainer: it checkpoints, resumes
bit-identically after SIGTERM, and exports ordinary (non-float8) weights."""

from __future__ import annotations

import signal

import pytest
from safetensors.torch import load_file

from llm.commands import main as llm_main
from tests.support.resume import assert_same_weights, interrupt, run, write_recipe

pytestmark = pytest.mark.slow  # starts training processes

FLOAT8 = ("training.float8.enabled=true", "training.float8.emulate=true")


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory, shards):
    """One uninterrupted float8 run, and one stopped by SIGTERM at batch 5 then resumed."""
    ref_dir, cut_dir = tmp_path_factory.mktemp("f8-ref"), tmp_path_factory.mktemp("f8-cut")
    ref_recipe = write_recipe(ref_dir / "recipe.yaml", shards, str(ref_dir / "ckpt"), cache=ref_dir / "cache")
    cut_recipe = write_recipe(cut_dir / "recipe.yaml", shards, str(cut_dir / "ckpt"), cache=cut_dir / "cache")
    reference = run(ref_recipe, "reference", cwd=ref_dir, overrides=FLOAT8)
    first = interrupt(cut_recipe, "first", cwd=cut_dir, at_batch=5, sig=signal.SIGTERM, overrides=FLOAT8)
    second = run(cut_recipe, "second", cwd=cut_dir, overrides=FLOAT8)
    return reference, first, second, cut_dir


def test_float8_runs_finish_and_say_float8_is_on(float8_runs):
    reference, first, second, _ = float8_runs
    assert reference.returncode == 0, reference.output[-4000:]
    assert first.returncode == 143, first.output[-4000:]
    assert second.returncode == 0, second.output[-4000:]
    assert (
        "[float8] 14 linear layers of the blocks compute in float8 (emulated)" in reference.output
    )  # 7 a block


def test_a_float8_run_resumed_after_sigterm_is_bit_identical(float8_runs):
    reference, first, second, _ = float8_runs
    stop = first.batches()[-1]["batch"]
    assert f"resuming run 'rs' from the checkpoint at batch {stop}" in second.output
    assert_same_weights(reference.weights, second.weights)


def test_a_float8_checkpoint_exports_ordinary_weights(float8_runs, tmp_path):
    *_, cut_dir = float8_runs
    out = tmp_path / "hf"
    assert (
        llm_main(
            ["export", str(cut_dir / "ckpt"), "--recipe", str(cut_dir / "recipe.yaml"), "--out", str(out)]
        )
        == 0
    )
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors and all(t.dtype.is_floating_point and t.element_size() == 4 for t in tensors.values())
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
