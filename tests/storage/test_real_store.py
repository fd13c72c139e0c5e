"""Where the real object store (SeaweedFS, the suite's S3 server) and moto differ, each behaviour
the product meets, asserted against SeaweedFS; moto only where its answer is AWS's and SeaweedFS's
is not (the conditional write on a file that is gone). The list: tests/README.md."""

from __future__ import annotations

import os
import time

import pytest

import storage.s3
from storage import StorageError, open_store
from tests.support.s3server import MotoServer, apply_env, restore_env

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def moto_server():
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["seaweedfs", "moto"])
def any_server_bucket(request, s3_bucket):
    """A fresh bucket on SeaweedFS, or on moto (whose If-Match on a missing key answers as AWS)."""
    if request.param == "seaweedfs":
        yield s3_bucket
        return
    moto = request.getfixturevalue("moto_server")
    moto.client().create_bucket(Bucket=s3_bucket)
    previous = apply_env(moto.env)
    try:
        yield s3_bucket
    finally:
        restore_env(previous)


def test_replacing_a_file_that_is_gone_says_changed_on_both_servers(any_server_bucket):
    """SeaweedFS answers 412 to an If-Match on a missing key, AWS and moto 404 NoSuchKey: both are
    "someone else changed it" (a lease released between the run lock's read and its write), never
    an error that ends the run."""
    store = open_store(f"s3://{any_server_bucket}/runs/a")
    assert store.write_if("run-lock.json", b"{}", expected='"9f0e2b7c1d4a5e6f7a8b9c0d1e2f3a4b"') is None
    assert store.delete_if("run-lock.json", '"9f0e2b7c1d4a5e6f7a8b9c0d1e2f3a4b"') is False
    created = store.write_if("run-lock.json", b"{}", expected=None)
    assert created is not None and store.write_if("run-lock.json", b"{}", expected=None) is None


def test_a_bucket_name_s3_refuses_is_named_with_the_rule(s3_server):
    """moto made a bucket of any name; a real store refuses `ab` (2 characters): the write says
    which rule, the read says the bucket is missing and that its name would be refused too."""
    store = open_store("s3://ab/shards")
    started = time.monotonic()
    with pytest.raises(StorageError) as refused:
        store.write_bytes("index.json", b"{}")
    assert time.monotonic() - started < 5, "an invalid name is not an outage: no retries"
    message = str(refused.value)
    assert "'ab' is not a valid bucket name (3-63 characters" in message and "\n" not in message
    with pytest.raises(StorageError, match=r"bucket 'ab' does not exist; .*S3 refuses that name too \(3-63"):
        store.read_bytes("index.json")


def test_a_missing_bucket_is_named_by_the_check_before_any_work(s3_server):
    """HEAD answers a bare 404 for a missing bucket (both servers): the check names the bucket,
    not "no such object"."""
    with pytest.raises(StorageError) as missing:
        open_store("s3://no-such-bucket-here/ckpt").check_writable()
    assert "bucket 'no-such-bucket-here' does not exist; create it or fix the URL" in str(missing.value)
    assert "refuses" not in str(missing.value)


@pytest.fixture
def fresh_clients():
    storage.s3._client.cache_clear()  # clients are cached per endpoint and policy, not per key
    yield
    storage.s3._client.cache_clear()


def test_wrong_keys_are_refused_at_once_naming_the_credentials(s3_bucket, monkeypatch, fresh_clients):
    """moto took any keys; SeaweedFS checks the signature, and the refusal is not an outage."""
    open_store(f"s3://{s3_bucket}").write_bytes("a.txt", b"a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    storage.s3._client.cache_clear()
    started = time.monotonic()
    with pytest.raises(StorageError) as denied:
        open_store(f"s3://{s3_bucket}").read_bytes("a.txt")
    assert time.monotonic() - started < 5
    assert "access denied (SignatureDoesNotMatch); check the AWS credentials" in str(denied.value)


def test_a_session_token_the_server_never_issued_is_named(s3_bucket, monkeypatch, fresh_clients):
    """The right keys with a stray AWS_SESSION_TOKEN (left from an AWS login): SeaweedFS refuses them
    as an unknown key (moto ignored the token); the line says which variable to unset."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "left-from-an-aws-login")
    storage.s3._client.cache_clear()
    with pytest.raises(StorageError) as denied:
        open_store(f"s3://{s3_bucket}").read_bytes("a.txt")
    message = str(denied.value)
    assert "access denied (InvalidAccessKeyId)" in message and "AWS_SESSION_TOKEN is set" in message


def test_an_emptied_folder_may_still_be_named_by_list_dirs_but_holds_no_file(s3_bucket):
    """SeaweedFS keeps a folder whose objects were all deleted and lists it as a common prefix (AWS
    and moto do not): `list_dirs` may name it, `list` never shows a file in it. The callers read a
    named folder's marker (a conversion's part.json, a task's task.json) before using it."""
    store = open_store(f"s3://{s3_bucket}/shards")
    for rel in ("train/part-00000/shard.00000.mds", "train/part-00001/shard.00000.mds"):
        store.write_bytes(rel, b"x")
    store.delete_tree("train/part-00001")
    assert store.list("train/") == {"train/part-00000/shard.00000.mds": 1}
    assert set(store.list_dirs("train")) == {"part-00000", "part-00001"}  # SeaweedFS 4.48's answer


def test_a_multipart_upload_round_trips_bit_identical(s3_bucket, tmp_path):
    """Above 8 MiB boto3 uploads in parts; SeaweedFS enforces S3's 5 MiB least part size, as AWS."""
    blob = tmp_path / "ep0-ba4-rank0.pt"
    blob.write_bytes(os.urandom(9 << 20))
    store = open_store(f"s3://{s3_bucket}/ckpt")
    store.upload(blob, "ep0-ba4-rank0.pt")
    store.download("ep0-ba4-rank0.pt", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == blob.read_bytes()
    assert store.size("ep0-ba4-rank0.pt") == 9 << 20
