"""`training.profile` through the real trainer: a Chrome/Perfetto trace of the window, in the run
folder and, with an s3:// save folder, beside the checkpoints. One S3 run, asserted on by each test."""

from __future__ import annotations

import json

import pytest

from tests.support.resume import run, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.s3]  # starts a training process

PROFILE = ("training.profile.enabled=true", "training.profile.wait=1", "training.profile.active=2")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, shards, s3_server):
    folder = tmp_path_factory.mktemp("profiled")
    bucket = s3_server.create_bucket("profiled")
    recipe = write_recipe(folder / "recipe.yaml", shards, f"s3://{bucket}/runs/rs", cache=folder / "cache")
    done = run(recipe, "profiled", cwd=folder, overrides=PROFILE)
    assert done.returncode == 0, done.output[-4000:]
    return folder, bucket


def test_the_trace_is_chrome_json_naming_the_blocks_operations(profiled):
    folder, _ = profiled
    traces = sorted((folder / "runs" / "rs" / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the blocks' linear layers
    assert any("scaled_dot_product" in n for n in names)  # their attention


def test_the_trace_is_stored_beside_the_checkpoints_on_s3(profiled, s3_server):
    folder, bucket = profiled
    stored = [k for k in s3_server.keys(bucket, "runs/rs/profile/") if k.endswith(".pt.trace.json")]
    local = sorted((folder / "runs" / "rs" / "profile").glob("*.pt.trace.json"))
    assert [k.rsplit("/", 1)[-1] for k in stored] == [p.name for p in local]
