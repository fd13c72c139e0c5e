"""Faults: a truncated or corrupt newest checkpoint is skipped for the previous one; S3 down at save time."""

from __future__ import annotations

import json
import signal
import time

import pytest

from llm.checkpoint import manifest as cm
from llm.checkpoint.resume import newest_usable_checkpoint
from scenarios.proxy import Proxy
from storage import StorageError, open_store
from tests.support.resume import (
    SAVE_EVERY,
    assert_continues,
    assert_same_weights,
    finish,
    interrupt,
    release,
    run,
    start,
    wait_for_batch,
    write_recipe,
)
from tests.support.training import checkpoint_bytes, store_checkpoint


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


OLDER, NEWER = checkpoint_bytes("older checkpoint"), checkpoint_bytes("newer checkpoint")


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
    _fake_checkpoint(store, 4, OLDER, tmp_path)
    _fake_checkpoint(store, 8, NEWER, tmp_path)
    store.write_bytes(cm.manifest_name(8, 0), bad)

    point = newest_usable_checkpoint(store.root)
    assert point.batch == 4 and open(point.load_path, "rb").read() == OLDER
    assert f"ignoring the manifest {store.url(cm.manifest_name(8, 0))}" in caplog.text


def test_a_verified_checkpoint_without_model_or_optimizer_state_is_refused_and_the_previous_one_used(
    tmp_path, caplog
):
    import torch

    store = open_store(tmp_path / "run")
    for batch, state in (
        (4, {"model": {"model.norm.weight": torch.ones(2)}, "optimizers": _adamw(["model.norm.weight"])}),
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
    _fake_checkpoint(store, 4, OLDER, tmp_path)
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
    _fake_checkpoint(store, 4, OLDER, tmp_path)
    _fake_checkpoint(store, 8, NEWER, tmp_path)
    s3_server.client().put_object(
        Bucket=s3_bucket, Key="run/ep0-ba8-rank0.pt", Body=NEWER[:-1] + bytes([NEWER[-1] ^ 1])
    )
    # An interrupted save: files but only an incomplete manifest set never counts.
    store.write_text(cm.manifest_name(12, 1), json.dumps({"batch": 12, "rank": 1, "writers": 2, "files": {}}))

    point = newest_usable_checkpoint(store.root)
    assert point.batch == 4
    assert open(point.load_path, "rb").read() == OLDER
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


def _recipe(tmp_path, save_folder, *extra):
    from llm.config import load_config

    path = write_recipe(tmp_path / "recipe.yaml", tmp_path / "shards", str(save_folder), cache=tmp_path / "c")
    return load_config(path, list(extra))


def _adamw(names: list[str]) -> dict:
    """An AdamW state of Composer's layout naming `names`, before its first step (no moments yet)."""
    return {"AdamW": {"state": {}, "param_groups": [{"lr": 1e-3, "params": list(names)}]}}


def _composer_checkpoint(path, model, optimizers=None):
    """What Composer writes for our model (its state dict keys), with the optimizer state after one
    AdamW step (Composer's layout: parameter names as keys), or `optimizers` instead."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from llm.composer_model import LanguageModel

    if model is None:
        return
    if isinstance(model, dict):
        weights, optimizers = model, optimizers or _adamw(list(model))
    else:
        net = LanguageModel.from_config(model, seed=1)
        adamw = torch.optim.AdamW(net.parameters(), lr=1e-3)
        sum(p.sum() for p in net.parameters()).backward()
        adamw.step()
        weights = net.state_dict()
        optimizers = optimizers or {"AdamW": get_optimizer_state_dict(net, adamw)}
    torch.save({"state": {"model": weights, "optimizers": optimizers}}, path)


def _foreign_checkpoints(cfg):
    import dataclasses

    import torch

    wider = dataclasses.replace(cfg.model, dim=2 * cfg.model.dim)
    return {
        "unrelated keys": {"encoder.weight": torch.ones(2), "decoder.bias": torch.zeros(3)},
        "model is 1": 1,
        "another model's shapes": wider,
        "legacy pickle of unrelated keys": "legacy",
    }


@pytest.mark.parametrize(
    "kind", ["unrelated keys", "model is 1", "another model's shapes", "legacy pickle of unrelated keys"]
)
def test_a_re_signed_checkpoint_whose_model_state_is_not_the_model_is_skipped_for_the_previous_one(
    tmp_path, kind, caplog
):
    # Issue 36 item 6c: Composer loads model weights non-strictly, so such a checkpoint "resumed
    # from batch 8" and trained on from freshly initialised weights (or crashed on model=1).
    import torch

    from llm.checkpoint.resume import choose_resume_point

    cfg = _recipe(tmp_path, tmp_path / "run")
    store = open_store(tmp_path / "run")
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    _composer_checkpoint(good, cfg.model)
    foreign = _foreign_checkpoints(cfg)[kind]
    if foreign == "legacy":
        state = {"model": {"encoder.weight": torch.ones(2)}, "optimizers": _adamw(["encoder.weight"])}
        torch.save({"state": state}, bad, _use_new_zipfile_serialization=False)
    elif isinstance(foreign, dict) or foreign == 1:
        torch.save({"state": {"model": foreign, "optimizers": _adamw(["model.norm.weight"])}}, bad)
    else:
        _composer_checkpoint(bad, foreign)
    _fake_checkpoint(store, 4, good.read_bytes(), tmp_path)
    _fake_checkpoint(store, 8, bad.read_bytes(), tmp_path)  # signed: its manifest records its hash

    point = choose_resume_point(cfg)
    assert point.batch == 4, kind
    lines = [r.getMessage() for r in caplog.records if "checkpoint at batch 8" in r.getMessage()]
    assert len(lines) == 1 and "unusable" in lines[0] and "trying an older one" in lines[0], caplog.text
    assert "model" in lines[0] or "not a torch checkpoint" in lines[0], lines[0]


def _foreign_optimizers(cfg, tmp_path) -> dict:
    """Optimizer states that are not this model's AdamW, each in a checkpoint whose model state is."""
    import dataclasses

    import torch

    wider = dataclasses.replace(cfg.model, dim=2 * cfg.model.dim)
    _composer_checkpoint(tmp_path / "wider.pt", wider)
    other = torch.load(tmp_path / "wider.pt", weights_only=False)["state"]["optimizers"]
    return {
        "junk": {"junk": {"state": {}, "param_groups": []}},  # Composer skips it with a warning
        "not a state dict": {"AdamW": {"junk": 1}},
        "unrelated parameter names": _adamw(["encoder.weight", "decoder.bias"]),
        "another model's moments": other,
        "some parameters missing": _adamw(["model.norm.weight"]),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "junk",
        "not a state dict",
        "unrelated parameter names",
        "another model's moments",
        "some parameters missing",
    ],
)
def test_a_re_signed_checkpoint_whose_optimizer_state_is_foreign_is_skipped_for_the_previous_one(
    tmp_path, kind, caplog
):
    # Issue 39 item 6: `{"junk": ...}` resumed with fresh AdamW moments, no warning (Composer skips
    # an optimizer state it does not find under the optimizer's name).
    from llm.checkpoint.resume import choose_resume_point

    cfg = _recipe(tmp_path, tmp_path / "run")
    store = open_store(tmp_path / "run")
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    _composer_checkpoint(good, cfg.model)
    _composer_checkpoint(bad, cfg.model, optimizers=_foreign_optimizers(cfg, tmp_path)[kind])
    _fake_checkpoint(store, 4, good.read_bytes(), tmp_path)
    _fake_checkpoint(store, 8, bad.read_bytes(), tmp_path)  # signed: its manifest records its hash

    point = choose_resume_point(cfg)
    assert point.batch == 4, kind
    lines = [r.getMessage() for r in caplog.records if "checkpoint at batch 8" in r.getMessage()]
    assert len(lines) == 1 and "unusable" in lines[0] and "trying an older one" in lines[0], caplog.text
    assert "optimizer state" in lines[0], lines[0]


def test_a_checkpoint_of_another_model_recipe_is_refused_as_a_recipe_change_not_skipped(tmp_path):
    import dataclasses

    from llm.checkpoint.resume import choose_resume_point
    from llm.errors import ConfigError

    cfg = _recipe(tmp_path, tmp_path / "run")
    wider = dataclasses.replace(cfg.model, dim=2 * cfg.model.dim)
    store = open_store(tmp_path / "run")
    path = tmp_path / "ba4.pt"
    _composer_checkpoint(path, wider)
    _fake_checkpoint(store, 4, path.read_bytes(), tmp_path)
    manifest = json.loads(store.read_text(cm.manifest_name(4, 0)))
    manifest["recipe"] = {"model": dataclasses.asdict(wider)}  # what the saving run recorded
    store.write_text(cm.manifest_name(4, 0), cm.dumps(manifest))
    with pytest.raises(ConfigError, match=r"trained with another model \(model.dim: 64 -> 32\)"):
        choose_resume_point(cfg)


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_ends_in_one_line_and_keeps_the_previous_checkpoint_whole(
    tmp_path, shards
):
    # Issue 36 item 1: rc 1 with two tracebacks (ENOSPC, then torch's "unexpected pos") and the
    # partial file left. The save folder is a tmpfs with room for 3.5 checkpoints: the start check
    # (num_to_keep=2 kept + the one being written) passes; once the checkpoint at 8 is stored, the
    # run holds at batch 9 while another tenant takes one checkpoint's room, so the save at 12 (with
    # 4 and 8 still kept until it is complete) finds the disk full half-way.
    import sys

    from llm.config import load_config
    from llm.model import count_params
    from scenarios.resume import private_shm_problem

    if private_shm_problem():  # the same capability: a mount namespace of its own
        pytest.skip(f"cannot mount a small disk here: {private_shm_problem()}")
    save = tmp_path / "ckpt"
    save.mkdir()
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(save), cache=tmp_path / "cache")
    one = 12 * count_params(load_config(recipe).model).total  # a checkpoint is ~12 B/param
    record = tmp_path / "first.jsonl"  # the harness's record of this run (tag "first")
    # Mounted in the process's own mount namespace (the filler is written there too); what it holds
    # is copied out before it goes.
    script = (
        f'mount -t tmpfs -o size={int(3.5 * one)} tmpfs "$0" || exit 99; "$@" & pid=$!; '
        f"until grep -qs '\"batch\": 9,' {record}; do sleep 0.1; done; "
        f'fallocate -l {one} "$0/another-tenant.bin"; touch {record}.go.9; '
        'wait $pid; rc=$?; rm -f "$0/another-tenant.bin"; mkdir -p "$0.after" && cp -a "$0"/. "$0.after"; exit $rc'
    )
    started = time.monotonic()
    proc, record, weights = start(
        recipe,
        "first",
        cwd=tmp_path,
        launcher=["unshare", "--mount", "sh", "-c", script, str(save), sys.executable],
        pause_at=9,
    )
    first = finish(proc, record, weights, started)
    assert first.returncode == 1, first.output[-4000:]
    errors = [line for line in first.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, first.output[-4000:]
    assert f"could not write the checkpoint at batch 12 to {save}: no space left on the device" in errors[0]
    assert "a checkpoint needs about 506 KiB on this rank" in errors[0] and " is free)" in errors[0]
    assert "the partial file was removed and the checkpoint at batch 8 remains the resume point" in errors[0]
    assert "Traceback" not in first.output and "unexpected pos" not in first.output
    kept = tmp_path / "ckpt.after"
    assert sorted(p.name for p in kept.glob("ep*")) == ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"]
    assert json.loads((kept / "latest.json").read_text())["batch"] == 8
