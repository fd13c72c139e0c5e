"""Checkpoints on s3:// (loopback moto server): resume on an empty machine; stale local copies never win."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from resume_support import (
    SAVE_EVERY,
    assert_continues,
    assert_same_weights,
    interrupt,
    reference,  # noqa: F401 (fixture)
    run,
    shards,  # noqa: F401 (fixture)
    write_recipe,
)

pytestmark = pytest.mark.s3


def test_sigterm_on_s3_then_resume_on_an_empty_machine_with_only_the_bucket(
    tmp_path, shards, reference, s3_server, s3_bucket
):
    save = f"s3://{s3_bucket}/runs/rs"
    first_dir, second_dir = tmp_path / "machine-a", tmp_path / "machine-b"
    first_dir.mkdir()
    recipe = write_recipe(first_dir / "recipe.yaml", shards, save, cache=first_dir / "cache")
    first = interrupt(recipe, "first", cwd=first_dir, at_batch=5, sig=signal.SIGTERM)
    assert first.returncode == 143, first.output[-4000:]
    stop = first.batches()[-1]["batch"]
    keys = s3_server.keys(s3_bucket, "runs/rs/")
    assert f"runs/rs/manifests/ba{stop:010d}-rank00000.json" in keys
    latest = s3_server.client().get_object(Bucket=s3_bucket, Key="runs/rs/latest.json")["Body"].read()
    assert json.loads(latest)["batch"] == stop

    # Another machine: nothing on disk but the recipe and the data; the run's own files are gone.
    second_dir.mkdir()
    recipe_b = write_recipe(second_dir / "recipe.yaml", shards, save, cache=second_dir / "cache")
    shutil.rmtree(first_dir)
    scratch = second_dir / "tmp"  # the run's temp folder: the verified download, the save staging
    scratch.mkdir()
    second = run(recipe_b, "second", cwd=second_dir, env={"TMPDIR": str(scratch)})
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming run 'rs' from the checkpoint at batch {stop}" in second.output
    leftovers = [p.name for p in scratch.iterdir() if p.name.startswith(("llm-resume-", "llm-ckpt-"))]
    assert not leftovers, f"checkpoint copies left in the temp folder after the run: {leftovers}"
    assert_same_weights(reference.weights, second.weights)
    resumed = second.batches()
    assert resumed[0]["batch"] == stop + 1
    ref = reference.batches()
    assert [b["ids"] for b in resumed] == [b["ids"] for b in ref[stop:]]
    assert [b["loss"] for b in resumed] == [b["loss"] for b in ref[stop:]]


def test_a_stale_local_s3_copy_never_wins_over_the_newer_remote_checkpoint(
    tmp_path, shards, reference, s3_server, s3_bucket
):
    save = f"s3://{s3_bucket}/ckpt"
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, save, cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=2 * SAVE_EVERY + 1, sig=signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL
    # What Composer's autoresume leaves behind: ./s3:/<bucket>/<prefix>/latest-rank0.pt, an older save.
    stale = tmp_path / f"s3:/{s3_bucket}/ckpt"
    stale.mkdir(parents=True)
    s3_server.client().download_file(
        s3_bucket, f"ckpt/ep0-ba{SAVE_EVERY}-rank0.pt", str(stale / "latest-rank0.pt")
    )

    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-4000:]
    assert "removing the stale local checkpoint copy" in second.output
    assert not stale.exists()
    assert f"resuming run 'rs' from the checkpoint at batch {2 * SAVE_EVERY}" in second.output
    assert_continues(reference, first, second, 2 * SAVE_EVERY)
    assert_same_weights(reference.weights, second.weights)
