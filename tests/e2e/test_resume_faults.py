"""Faults: a truncated or corrupt newest checkpoint is skipped for the previous one; S3 down at save time."""

from __future__ import annotations

import json
import signal

import pytest

from llm.checkpoint import manifest as cm
from llm.checkpoint.resume import newest_usable_checkpoint
from scenarios.proxy import Proxy
from storage import StorageError, open_store
from tests.support.resume import (
    SAVE_EVERY,
    assert_continues,
    assert_same_weights,
    interrupt,
    release,
    run,
    start,
    wait_for_batch,
    write_recipe,
)
from tests.support.training import store_checkpoint


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_is_reported_and_the_previous_one_resumes_bit_identically(
    tmp_path, shards, reference
):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=2 * SAVE_EVERY + 1, sig=signal.SIGKILL)
    newest = tmp_path / "ckpt" / f"ep0-ba{2 * SAVE_EVERY}-rank0.pt"
    newest.write_bytes(newest.read_bytes()[:1000])

    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-4000:]
    assert f"checkpoint at batch {2 * SAVE_EVERY}" in second.output and "truncated" in second.output
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    assert_continues(reference, first, second, SAVE_EVERY)
    assert_same_weights(reference.weights, second.weights)


def _fake_checkpoint(store, batch: int, payload: bytes, tmp_path) -> None:
    """A stored monolithic checkpoint holding `payload`, with its manifest."""
    local = tmp_path / f"ba{batch}.pt"
    local.write_bytes(payload)
    store_checkpoint(store, batch, local)


@pytest.mark.parametrize("bad", [b"{}", b"[1, 2]", b'{"batch": 8, "rank": 0, "writ', b'{"batch": "8"}'])
def test_a_malformed_newest_manifest_is_reported_by_name_and_the_previous_checkpoint_is_used(
    tmp_path, bad, caplog
):
    store = open_store(tmp_path / "run")
    _fake_checkpoint(store, 4, b"older checkpoint", tmp_path)
    _fake_checkpoint(store, 8, b"newer checkpoint", tmp_path)
    store.write_bytes(cm.manifest_name(8, 0), bad)

    point = newest_usable_checkpoint(store.root)
    assert point.batch == 4 and open(point.load_path, "rb").read() == b"older checkpoint"
    assert f"ignoring the manifest {store.url(cm.manifest_name(8, 0))}" in caplog.text


def test_a_verified_checkpoint_without_model_or_optimizer_state_is_refused_and_the_previous_one_used(
    tmp_path, caplog
):
    import torch

    store = open_store(tmp_path / "run")
    for batch, state in (
        (4, {"model": {"w": torch.ones(2)}, "optimizers": {"AdamW": {"state": {0: {}}}}}),
        (8, {"model": {}, "optimizers": {}, "timestamp": None}),  # what a resume must not trust
    ):
        path = tmp_path / f"ba{batch}.pt"
        torch.save({"state": state, "rng": [torch.get_rng_state()]}, path)
        _fake_checkpoint(store, batch, path.read_bytes(), tmp_path)
    point = newest_usable_checkpoint(store.root)
    assert point.batch == 4
    assert "checkpoint at batch 8" in caplog.text and "holds no model and no optimizers state" in caplog.text


def test_a_malformed_manifest_is_reported_once_however_often_the_folder_is_scanned(tmp_path, caplog):
    store = open_store(tmp_path / "run")
    _fake_checkpoint(store, 4, b"older checkpoint", tmp_path)
    store.write_bytes(cm.manifest_name(8, 0), b"{}")
    for _ in range(5):  # every save scans the folder twice (latest.json, retention)
        assert [c.batch for c in cm.scan(store)[0]] == [4]
    assert caplog.text.count("ignoring the manifest") == 1


def test_manifests_written_as_dicts_before_the_typed_record_read_back_and_write_out_byte_for_byte():
    """Old checkpoints keep resuming: the JSON the publisher wrote from a dict (rank 0's with the
    recipe, another rank's without) is what `Manifest` reads and writes."""
    files = {"ep0-ba12/__0_0.distcp": {"size": 123, "sha256": "ab" * 32}}
    common = {"batch": 12, "writers": 2, "world_size": 2, "sharded": True, "load_path": "ep0-ba12"}
    common |= {"timestamp": {"epoch": 0, "batch": 12, "sample": 96, "token": 3072}, "files": files}
    recipe = {"model": {"dim": 64, "tie_embeddings": True}, "data": {"train": [{"remote": "s3://b/t"}]}}
    for old in ({**common, "rank": 0, "recipe": recipe}, {**common, "rank": 1}):
        text = json.dumps({**old, "saved_at": 1700000000.25}, indent=1, sort_keys=True, default=str)
        manifest = cm.Manifest.from_dict(json.loads(text))
        assert manifest.to_json() == text
        assert manifest.files["ep0-ba12/__0_0.distcp"] == cm.FileDigest(size=123, sha256="ab" * 32)
    assert cm.schema_problem(json.loads(manifest.to_json()), 12, 1) is None


@pytest.mark.s3
def test_a_corrupt_newest_s3_checkpoint_of_the_right_size_fails_its_sha256_and_is_skipped(
    tmp_path, s3_server, s3_bucket, caplog
):
    store = open_store(f"s3://{s3_bucket}/run")
    _fake_checkpoint(store, 4, b"older checkpoint", tmp_path)
    _fake_checkpoint(store, 8, b"newer checkpoint", tmp_path)
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/ep0-ba8-rank0.pt", Body=b"newer checkpoinX")
    # An interrupted save: files but only an incomplete manifest set never counts.
    store.write_text(cm.manifest_name(12, 1), json.dumps({"batch": 12, "rank": 1, "writers": 2, "files": {}}))

    point = newest_usable_checkpoint(store.root)
    assert point.batch == 4
    assert open(point.load_path, "rb").read() == b"older checkpoint"
    assert "checkpoint at batch 8" in caplog.text and "SHA-256" in caplog.text

    s3_server.client().put_object(Bucket=s3_bucket, Key="run/ep0-ba4-rank0.pt", Body=b"x")
    with pytest.raises(StorageError, match="no usable checkpoint"):
        newest_usable_checkpoint(store.root)


@pytest.mark.s3
@pytest.mark.slow
def test_s3_down_at_save_time_fails_clearly_after_retries_and_the_run_resumes_from_the_previous_checkpoint(
    tmp_path, shards, reference, s3_server, s3_bucket
):
    save = f"s3://{s3_bucket}/down"
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, save, cache=tmp_path / "cache")
    proxy = Proxy(s3_server.port)
    env = {"S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "LLM_S3_MAX_ATTEMPTS": "3"}
    proc, record, weights = start(recipe, "first", cwd=tmp_path, pause_at=SAVE_EVERY + 1, env=env)
    wait_for_batch(record, SAVE_EVERY + 1, proc)  # the checkpoint at SAVE_EVERY is stored
    proxy.cut()
    release(record, SAVE_EVERY + 1)
    proc.wait(timeout=300)
    output = proc.tag_log.read_text()
    assert proc.returncode == 1, output[-4000:]  # one line, no traceback (train.py)
    assert f"error: could not store checkpoint {save} (batch {2 * SAVE_EVERY})" in output
    assert "The previous complete checkpoint remains the resume point" in output

    second = run(recipe, "second", cwd=tmp_path)
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    assert_same_weights(reference.weights, second.weights)
    ref = reference.batches()
    assert [b["ids"] for b in second.batches()] == [b["ids"] for b in ref[SAVE_EVERY:]]
