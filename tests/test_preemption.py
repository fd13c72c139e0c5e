"""Save on SIGTERM/SIGINT: stop after the current batch on every rank, store a checkpoint, exit 143/130."""

from __future__ import annotations

import json
import signal

from resume_support import (
    MAX_BATCHES,
    assert_continues,
    assert_same_weights,
    interrupt,
    reference,  # noqa: F401 (fixture)
    run,
    shards,  # noqa: F401 (fixture)
    write_recipe,
)


def test_sigterm_saves_the_interrupted_batch_and_the_same_command_continues_bit_identically(
    tmp_path, shards, reference
):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=5, sig=signal.SIGTERM)

    assert first.returncode == 143, first.output[-4000:]
    assert "[resume] starting run 'rs' from scratch" in first.output
    stop = first.batches()[-1]["batch"]
    assert 5 <= stop < MAX_BATCHES
    assert f"[preemption] SIGTERM: checkpoint at batch {stop} stored" in first.output
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["batch"] == stop
    assert first.seconds < 30, f"exit took {first.seconds:.1f} s after SIGTERM; launchers kill at 30 s"

    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-4000:]
    assert f"[resume] resuming run 'rs' from the checkpoint at batch {stop}" in second.output
    assert_continues(reference, first, second, stop)
    assert_same_weights(reference.weights, second.weights)


def test_sigint_stops_with_exit_code_130_after_saving(tmp_path, shards):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=2, sig=signal.SIGINT)

    assert first.returncode == 130, first.output[-4000:]
    stop = first.batches()[-1]["batch"]
    assert f"[preemption] SIGINT: checkpoint at batch {stop} stored" in first.output
    manifest = tmp_path / "ckpt" / "manifests" / f"ba{stop:010d}-rank00000.json"
    assert json.loads(manifest.read_text())["batch"] == stop
