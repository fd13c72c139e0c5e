"""A training run rides out a storage outage: the loopback S3 endpoint (data and checkpoints)
goes away after batch 5, while shards are still being downloaded ahead, and comes back seconds
later. Training goes on from the shards already in the cache, the save at batch 8 and the
download-ahead wait, and the run finishes with rc 0 and the final weights of an uninterrupted run.

Reduced timings: an outage of a few seconds inside a budget of 60 s (the issue's 60 s outage
and random points are `make soak-outage`). One reference run and one outage run per module.
"""

from __future__ import annotations

import pytest

from scenarios import outage as so
from scenarios.proxy import Proxy
from tests.support.resume import SAVE_EVERY, assert_same_weights, run, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.s3]

ENV = {
    "LLM_S3_OUTAGE_S": "60",
    "LLM_S3_CONNECT_TIMEOUT": "1",
    "LLM_S3_READ_TIMEOUT": "2",
    "LLM_S3_BACKOFF_MAX_S": "1",
}
DOWN_FOR = 5.0


@pytest.fixture(scope="module")
def remote(tmp_path_factory, s3_server):
    bucket = s3_server.create_bucket("outage-run")
    split = so.rs.write_shards(tmp_path_factory.mktemp("outage-shards"), shard_bytes=so.SHARD_BYTES)
    return bucket, so.upload_split(s3_server.client(), bucket, split, "data/train")


@pytest.fixture(scope="module")
def switch(s3_server):
    switch = Proxy(s3_server.port)
    yield switch
    switch.down()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, remote, switch):
    bucket, data = remote
    folder = tmp_path_factory.mktemp("outage-reference")
    recipe = write_recipe(folder / "recipe.yaml", data, f"s3://{bucket}/ref-ckpt", cache=folder / "cache")
    result = run(
        recipe, "reference", cwd=folder, overrides=so.LAZY, env={"S3_ENDPOINT_URL": switch.endpoint, **ENV}
    )
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def outage(tmp_path_factory, remote, switch, reference):
    bucket, data = remote
    folder = tmp_path_factory.mktemp("outage-run")
    # Two batches' samples fetched ahead (the order does not depend on it), given a second to arrive.
    return so.outage_run(
        folder, switch, data, f"s3://{bucket}/ckpt", at_batch=SAVE_EVERY + 1, delay=1.0, down_for=DOWN_FOR,
        env=ENV, overrides=["data.predownload=8"],
    )  # fmt: skip


def test_the_run_finishes_through_the_outage(outage):
    assert outage.run.returncode == 0, outage.run.output[-3000:]
    assert outage.run.seconds > DOWN_FOR


def test_the_outage_was_met_and_waited_out_with_one_line_each_way(outage):
    out = outage.run.output
    assert "is failing" in out and "retrying for up to 60s (LLM_S3_OUTAGE_S)" in out
    assert "answers again after" in out
    assert "Traceback" not in out


def test_training_went_on_from_the_cache_while_the_endpoint_was_away(outage):
    assert outage.batches_while_down(), [b["batch"] for b in outage.run.batches()]
    assert max(outage.batches_while_down()) < 12  # and then waited: the run ended after it came back


def test_every_save_was_stored_none_given_up(outage, remote, s3_server):
    bucket, _ = remote
    manifests = s3_server.keys(bucket, "ckpt/manifests/")
    assert [k.rsplit("/", 1)[1] for k in manifests] == [
        "ba0000000008-rank00000.json",
        "ba0000000012-rank00000.json",
    ]
    assert "could not store checkpoint" not in outage.run.output


def test_the_weights_equal_the_uninterrupted_run(outage, reference):
    assert_same_weights(outage.run.weights, reference.weights)


def test_every_batch_is_the_uninterrupted_runs(outage, reference):
    got, want = outage.run.batches(), reference.batches()
    assert [(b["batch"], b["ids"], b["loss"]) for b in got] == [
        (b["batch"], b["ids"], b["loss"]) for b in want
    ]
