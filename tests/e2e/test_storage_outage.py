"""S3 failing for good while a run trains: data reading and checkpoint saving end in one clear
line within the outage budget plus one request timeout (and the process's shutdown), with no
traceback on the console, the last stored checkpoint intact, and the same command resumes once
the storage is back. Reduced settings: a budget of 4 s, timeouts of 1 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from scenarios.proxy import Proxy
from tests.support.resume import SAVE_EVERY, release, run, start, wait_for_batch, write_recipe, write_shards

BUDGET, TIMEOUT = 4, 1
FAST_FAILURE = {
    "LLM_S3_OUTAGE_S": str(BUDGET),
    "LLM_S3_READ_TIMEOUT": str(TIMEOUT),
    "LLM_S3_CONNECT_TIMEOUT": str(TIMEOUT),
}
SHUTDOWN = 20  # after the deadline: the error travels up, Composer closes, the process exits
BOUND_SECONDS = BUDGET + TIMEOUT + SHUTDOWN


def upload(s3_server, bucket: str, split, prefix: str) -> str:
    client = s3_server.client()
    for path in sorted(split.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(split).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def frozen_run(tmp_path, proxy, recipe, overrides=()):
    """Train through the proxy; freeze the server once the checkpoint at SAVE_EVERY is stored."""
    # faulthandler: a run that hangs is sent SIGABRT and prints every thread's stack on the way out.
    env = {"S3_ENDPOINT_URL": proxy.endpoint, "PYTHONFAULTHANDLER": "1", **FAST_FAILURE}
    proc, record, _ = start(
        recipe, "first", cwd=tmp_path, pause_at=SAVE_EVERY + 1, env=env, overrides=overrides
    )
    wait_for_batch(record, SAVE_EVERY + 1, proc)
    proxy.set("hang")
    release(record, SAVE_EVERY + 1)
    frozen_at = time.monotonic()
    try:
        proc.wait(timeout=3 * BOUND_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=60)
        pytest.fail(f"the run hung after the freeze; its threads:\n{proc.tag_log.read_text()[-12000:]}")
    return proc, time.monotonic() - frozen_at, proc.tag_log.read_text()


@pytest.mark.slow
@pytest.mark.s3
def test_a_remote_that_freezes_mid_epoch_ends_in_one_line_and_the_run_resumes_when_it_is_back(
    tmp_path, s3_server, s3_bucket
):
    split = write_shards(tmp_path / "shards", shard_bytes=600)  # ~7 samples a shard, 14 shards
    remote = upload(s3_server, s3_bucket, split, "frozen/train")
    recipe = write_recipe(tmp_path / "recipe.yaml", remote, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    proxy = Proxy(s3_server.port)
    lazy = ["data.predownload=4", "data.shuffle_block_size=16"]  # shards fetched as training goes
    proc, seconds, output = frozen_run(tmp_path, proxy, recipe, lazy)

    assert proc.returncode == 1, output[-3000:]
    assert "error: reading the training data failed" in output and "stopped answering" in output
    assert "re-run the same command to resume" in output
    assert seconds < BOUND_SECONDS, seconds
    assert "Traceback" not in output, output[-3000:]
    log = tmp_path / "runs" / "rs" / "storage-errors.log"
    assert f"(traceback in {log})" in output and "ReadTimeoutError" in log.read_text()

    proxy.set("pass")
    second = run(recipe, "second", cwd=tmp_path, overrides=lazy, env={"S3_ENDPOINT_URL": proxy.endpoint})
    assert second.returncode == 0, second.output[-3000:]
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    proxy.cut()


@pytest.mark.slow
@pytest.mark.s3
def test_a_remote_that_freezes_during_a_save_ends_in_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, s3_server, s3_bucket
):
    split = write_shards(tmp_path / "shards")
    save = f"s3://{s3_bucket}/frozen-save"
    recipe = write_recipe(tmp_path / "recipe.yaml", split, save, cache=tmp_path / "cache")
    proxy = Proxy(s3_server.port)
    proc, seconds, output = frozen_run(tmp_path, proxy, recipe)

    assert proc.returncode == 1, output[-3000:]
    assert f"error: could not store checkpoint {save} (batch {2 * SAVE_EVERY})" in output
    assert "stopped answering" in output and seconds < BOUND_SECONDS, seconds
    assert "Traceback" not in output, output[-3000:]

    proxy.set("pass")
    second = run(recipe, "second", cwd=tmp_path, env={"S3_ENDPOINT_URL": proxy.endpoint})
    assert second.returncode == 0, second.output[-3000:]
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    proxy.cut()


@pytest.mark.slow
@pytest.mark.s3
def test_a_corrupt_remote_shard_ends_in_one_line_with_both_hashes_and_once_repaired_the_same_command_finishes(
    tmp_path, s3_server, s3_bucket
):
    import json

    import xxhash

    split = write_shards(tmp_path / "shards", shard_bytes=600)
    remote = upload(s3_server, s3_bucket, split, "corrupt/train")
    shard = json.loads((split / "index.json").read_text())["shards"][-1]["zip_data"]
    good = (split / shard["basename"]).read_bytes()
    bad = good[:-1] + bytes([good[-1] ^ 1])
    key = f"corrupt/train/{shard['basename']}"
    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=bad)
    recipe = write_recipe(tmp_path / "recipe.yaml", remote, str(tmp_path / "ckpt"), cache=tmp_path / "cache")

    first = run(recipe, "first", cwd=tmp_path)
    assert first.returncode == 1, first.output[-3000:]
    (line,) = [x for x in first.output.splitlines() if x.startswith("error: ")]
    assert f"shard {remote}/{shard['basename']} is corrupt in the remote itself" in line
    assert f"xxh64 expected {shard['hashes']['xxh64']}, got {xxhash.xxh64(bad).hexdigest()}" in line
    assert "Traceback" not in first.output

    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=good)  # the remote repaired
    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-3000:]
    assert "finished at step 12" in second.output
