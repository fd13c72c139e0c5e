"""What is verified when, on the data path (llm/data/verified_stream.py `VerifiedStream`): a shard
that fails its hash after download is deleted from the cache and fetched again; only a remote whose
own copy is corrupt ends the run, in one line naming the file and both hashes; once the remote is repaired
the same cache serves it; a decompressed shard edited in the cache is caught at the next start.

In-process: the real loader over real shards on the loopback S3 server.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import pytest
from tests.support.training import load, write_recipe

from llm.data import CorruptShard, build_dataset, stream_local

pytestmark = pytest.mark.s3


@pytest.fixture
def remote(train_data, s3_server, s3_bucket):
    client = s3_server.client()
    for path in sorted(train_data.train.rglob("*")):
        if path.is_file():
            client.upload_file(
                str(path), s3_bucket, f"shards/train/{path.relative_to(train_data.train).as_posix()}"
            )
    return f"s3://{s3_bucket}/shards/train"


@pytest.fixture
def cfg(tmp_path, train_data, remote):
    data = {"train": [{"remote": remote}], "cache_root": str(tmp_path / "cache"), "download_retry": 2}
    return load(write_recipe(tmp_path / "r.yaml", train_data, data=data), "data.shuffle=false")


def _epoch(cfg) -> list[str]:
    dataset = build_dataset(cfg, "train", 8)
    try:
        return [hashlib.sha1(s.numpy().tobytes()).hexdigest() for s in dataset]
    finally:
        del dataset
        gc.collect()  # streaming refuses a second live dataset on the same cache folder


def _shard(train_data) -> dict:
    return json.loads((train_data.train / "index.json").read_text())["shards"][0]


def _cache_split(cfg) -> Path:
    from llm.data import index_digest
    from shards.index import read_index

    s = cfg.data.train[0]
    return Path(stream_local(cfg, "train", 0, s, index_digest(read_index(s.remote))))


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


@pytest.fixture
def clean_epoch(cfg, tmp_path):
    epoch = _epoch(cfg)
    return epoch


def test_a_corrupt_file_in_the_cache_is_deleted_and_fetched_again(cfg, train_data, clean_epoch, caplog):
    shard = _shard(train_data)
    folder = _cache_split(cfg)
    raw = folder / shard["raw_data"]["basename"]
    zipped = folder / shard["zip_data"]["basename"]
    raw.unlink()  # as if the download had stopped after the compressed file arrived, corrupt
    zipped.write_bytes(_flip((train_data.train / shard["zip_data"]["basename"]).read_bytes()))
    assert _epoch(cfg) == clean_epoch
    assert "fetching it again" in caplog.text
    assert raw.read_bytes() == _decompressed(train_data, shard)


def test_a_decompressed_shard_edited_in_the_cache_is_not_trained_on(cfg, train_data, clean_epoch, caplog):
    shard = _shard(train_data)
    raw = _cache_split(cfg) / shard["raw_data"]["basename"]
    raw.write_bytes(_flip(raw.read_bytes()))  # same size: only its hash tells
    assert _epoch(cfg) == clean_epoch
    assert "does not match its xxh64 hash: deleted" in caplog.text
    assert raw.read_bytes() == _decompressed(train_data, shard)


def test_a_corrupt_remote_ends_in_one_line_and_the_repaired_remote_is_read(
    cfg, train_data, clean_epoch, s3_server, remote
):
    import xxhash

    shard = _shard(train_data)
    name = shard["zip_data"]["basename"]
    bucket, key = remote[len("s3://") :].split("/", 1)
    good = (train_data.train / name).read_bytes()
    bad = _flip(good)
    s3_server.client().put_object(Bucket=bucket, Key=f"{key}/{name}", Body=bad)
    (_cache_split(cfg) / shard["raw_data"]["basename"]).unlink()  # not cached: must be fetched
    (_cache_split(cfg) / name).unlink(missing_ok=True)
    with pytest.raises(CorruptShard) as err:
        _epoch(cfg)
    message = str(err.value)
    assert "\n" not in message and f"{remote}/{name}" in message and "corrupt in the remote" in message
    assert shard["zip_data"]["hashes"]["xxh64"] in message and xxhash.xxh64(bad).hexdigest() in message
    assert "3 downloads" in message  # the first and data.download_retry=2 more
    assert "re-run the same command" in message
    s3_server.client().put_object(Bucket=bucket, Key=f"{key}/{name}", Body=good)  # repaired
    assert _epoch(cfg) == clean_epoch  # same index.json, same cache folder: nothing corrupt stayed


def _decompressed(train_data, shard) -> bytes:
    from streaming.base.compression import decompress

    return decompress(shard["compression"], (train_data.train / shard["zip_data"]["basename"]).read_bytes())
