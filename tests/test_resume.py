"""Autoresume from a local save_folder: SIGKILL + rerun continues bit-identically; safety; recipe changes."""

from __future__ import annotations

import json
import signal

import pytest
from resume_support import (
    MAX_BATCHES,
    SAVE_EVERY,
    assert_continues,
    assert_same_weights,
    interrupt,
    reference,  # noqa: F401 (fixture)
    run,
    shards,  # noqa: F401 (fixture)
    write_recipe,
)

from llm.config import load_config
from llm.errors import ConfigError


def test_sigkill_then_rerun_resumes_from_the_last_periodic_checkpoint_bit_identically(
    tmp_path, shards, reference
):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=SAVE_EVERY + 2, sig=signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL
    assert first.batches()[-1]["batch"] < 2 * SAVE_EVERY

    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-4000:]
    assert f"[resume] resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    assert_continues(reference, first, second, SAVE_EVERY)
    assert_same_weights(reference.weights, second.weights)
    # num_to_keep=2 counts checkpoints of both processes, not only the last one's.
    manifests = sorted(p.name for p in (tmp_path / "ckpt" / "manifests").iterdir())
    assert manifests == [f"ba{b:010d}-rank00000.json" for b in (2 * SAVE_EVERY, MAX_BATCHES)]


def test_a_finished_run_started_again_trains_nothing_more(tmp_path, shards):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    assert run(recipe, "first", cwd=tmp_path).returncode == 0
    again = run(recipe, "again", cwd=tmp_path)
    assert again.returncode == 0, again.output[-4000:]
    assert f"run 'rs' already finished: its checkpoint at batch {MAX_BATCHES} reached" in again.output
    assert again.batches() == []


def _cfg(tmp_path, *overrides):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", tmp_path / "shards", str(tmp_path / "ckpt"), cache=tmp_path / "cache"
    )
    return load_config(recipe, list(overrides))


def test_load_path_outside_save_folder_needs_the_untrusted_flag(tmp_path):
    from llm.checkpoint.resume import check_load_path_allowed

    outside = tmp_path / "elsewhere" / "ep0-ba4-rank0.pt"
    with pytest.raises(ConfigError, match="allow_untrusted_load_path=true"):
        check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={outside}"))
    with pytest.raises(ConfigError, match="outside checkpoint.save_folder"):
        check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={tmp_path}/ckpt/../x.pt"))
    with pytest.raises(ConfigError):
        cfg = _cfg(
            tmp_path, "checkpoint.save_folder=s3://bkt/run", "checkpoint.load_path=s3://bkt/runner/a.pt"
        )
        check_load_path_allowed(cfg)
    check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={tmp_path}/ckpt/ep0-ba4-rank0.pt"))
    check_load_path_allowed(
        _cfg(tmp_path, f"checkpoint.load_path={outside}", "checkpoint.allow_untrusted_load_path=true")
    )


def test_untrusted_load_path_is_refused_by_train_py_with_exit_code_2(tmp_path, shards):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    result = run(recipe, "refused", cwd=tmp_path, overrides=[f"checkpoint.load_path={tmp_path}/other.pt"])
    assert result.returncode == 2, result.output[-4000:]
    assert "allow_untrusted_load_path=true" in result.output
    assert "Traceback" not in result.output


def test_each_recipe_change_since_the_checkpoint_is_reported_with_its_effect(tmp_path):
    from llm.checkpoint.resume import warn_recipe_changes

    saved = _cfg(tmp_path).to_dict()
    changed = _cfg(tmp_path, "optimizer.lr=0.5", "training.max_duration=20ba", "seed=3", "run_dir=/x")
    messages = warn_recipe_changes(json.loads(json.dumps(saved)), changed.to_dict())
    assert len(messages) == 3, messages
    by_key = {m.split(": ")[1]: m for m in messages}
    assert "checkpoint" in by_key["optimizer.lr"] and "ignored" in by_key["optimizer.lr"]
    assert "'12ba' -> '20ba'" in by_key["training.max_duration"]
    assert "recipe's new value applies" in by_key["training.max_duration"]
    assert "RNG state in the checkpoint" in by_key["seed"]
    assert warn_recipe_changes(json.loads(json.dumps(saved)), saved) == []


def test_a_longer_max_duration_on_resume_trains_on_and_warns(tmp_path, shards):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    assert run(recipe, "first", cwd=tmp_path).returncode == 0
    longer = run(recipe, "longer", cwd=tmp_path, overrides=["training.max_duration=14ba"])
    assert longer.returncode == 0, longer.output[-4000:]
    assert "training.max_duration: '12ba' -> '14ba'" in longer.output
    assert [b["batch"] for b in longer.batches()] == [13, 14]
