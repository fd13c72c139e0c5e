"""Data at scale: a bounded cache for remote shards, local shards read in place, a cache tied to
the index it caches, and clear errors for caches that cannot work."""


from __future__ import annotations

import gc
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import forkserver
import pytest
from tests.support.training import REPO, load, write_recipe

from llm.data import build_dataset, check_streams, stream_local
from llm.errors import ConfigError

SEQ = 64


@pytest.fixture(scope="module")
def small_shards(train_data, tmp_path_factory) -> Path:
    """The fixture corpus again, cut into ~10 kB shards: many shards from a small split."""
    out = tmp_path_factory.mktemp("small-shards")
    args = [
        sys.executable, "-m", "convert", "shards", str(train_data.root / "corpus.jsonl"), "--format", "jsonl",
        "--tokenizer", str(train_data.tokenizer), "--seq-len", str(SEQ), "--shard-size-mb", "0.01",
        "--val-fraction", "0.05", "--workers", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    forkserver.run(args, cwd=REPO, check=True, capture_output=True, timeout=600)
    return out / "train"


def upload(s3_server, bucket: str, folder: Path, prefix: str) -> str:
    client = s3_server.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def digest(sample) -> str:
    return hashlib.sha1(sample.numpy().tobytes()).hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def recipe(tmp_path, train_data, remote: str, *overrides: str, name: str = "r.yaml", **data):
    section = {"train": [{"remote": remote}], "cache_root": str(tmp_path / "cache"), **data}
    return load(write_recipe(tmp_path / name, train_data, data=section), *overrides)


def largest_shard(split: Path) -> int:
    index = json.loads((split / "index.json").read_text())
    return max(s["raw_data"]["bytes"] + s["zip_data"]["bytes"] for s in index["shards"])


class CacheWatch:
    """Samples the size of a folder every few milliseconds while a block runs."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self.samples = folder, 0, 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, folder_bytes(self.folder))
                self.samples += 1
            except FileNotFoundError:  # a shard evicted while listed
                pass
            time.sleep(0.002)

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def read_epoch(cfg, stop_after: int | None = None, state: dict | None = None) -> tuple[list[str], dict]:
    """Samples of one epoch of one rank in training order (optionally resumed from `state`)."""
    dataset = build_dataset(cfg, "train", 8)
    if state is not None:
        dataset.load_state_dict(state)
    seen = []
    for sample in dataset:
        seen.append(digest(sample))
        if stop_after is not None and len(seen) == stop_after:
            break
    saved = dataset.state_dict(len(seen), from_beginning=state is None)
    if stop_after is not None:  # a run stopped here: end the download threads as its exit would
        dataset._iterator.exit()
        dataset._executor.shutdown(wait=True)
    del dataset
    gc.collect()
    return seen, saved


@pytest.mark.s3
def test_a_bounded_cache_streams_an_epoch_and_a_resume_several_times_its_size_in_the_same_order(
    tmp_path, train_data, small_shards, s3_server, s3_bucket
):
    remote = upload(s3_server, s3_bucket, small_shards, "small/train")
    index = json.loads((small_shards / "index.json").read_text())
    total = sum(s["raw_data"]["bytes"] for s in index["shards"])  # what the cache holds, decompressed
    limit = 4 * largest_shard(small_shards) + 4096
    assert total > 3 * limit  # the dataset is several times the cache
    # A shuffle block of a few shards: the window streaming works through must fit the cache
    # (with a block spanning every shard, 4 cached shards thrash and streaming stalls).
    settings = ("data.predownload=8", "data.shuffle_block_size=128")
    plain = recipe(tmp_path / "a", train_data, remote, "data.cache_limit=null", *settings)
    unlimited, _ = read_epoch(plain)

    bounded = recipe(tmp_path / "b", train_data, remote, f"data.cache_limit={limit}", *settings)
    cache = Path(stream_local(bounded, "train", 0, bounded.data.train[0])).parent
    half = len(unlimited) // 2
    with CacheWatch(cache) as watch:
        first, state = read_epoch(bounded, stop_after=half)
        rest, _ = read_epoch(bounded, state=state)  # a resume: a new dataset from the saved state
    assert first + rest == unlimited  # same samples, same order
    # Streaming makes room for one download at a time: a second thread's download (the iterator's,
    # when the prefetch has not reached that shard) can be on disk before the first is accounted
    # for, so the cache may pass the limit by one shard while both are in flight.
    assert watch.samples > 20 and 0 < watch.peak <= limit + largest_shard(small_shards)
    assert not list(cache.rglob("*.mds.zstd"))  # compressed files are not kept once decompressed


@pytest.mark.s3
def test_when_both_download_threads_fail_the_epoch_still_ends(
    tmp_path, train_data, small_shards, s3_server, s3_bucket, monkeypatch
):
    """streaming 0.13 waits at the end of an epoch until its two background threads have counted
    their exit, which a failing thread never did: with both failing on a frozen remote the run hung
    (seen in CI). Each thread is run here as streaming runs it, against a remote cut off."""
    import numpy as np
    from streaming.base.dataset import _Iterator

    from scenarios.proxy import Proxy

    remote = upload(s3_server, s3_bucket, small_shards, "both-fail/train")
    proxy = Proxy(s3_server.port)
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("LLM_S3_OUTAGE_S", "1")  # the outage budget, reduced
    monkeypatch.setenv("LLM_S3_CONNECT_TIMEOUT", "1")
    cfg = recipe(tmp_path, train_data, remote, "data.download_retry=0")
    dataset = build_dataset(cfg, "train", 8)  # index.json read while the remote answers
    proxy.cut()  # then every shard download fails
    dataset._event = threading.Event()
    it = _Iterator(np.arange(dataset.num_samples, dtype=np.int64))
    # The ready thread fetches the first sample's shard itself; the download thread, started at a
    # sample of another shard (as if it were ahead), fetches that one. Both fail.
    other = next(i for i in range(dataset.num_samples) if dataset.spanner[i][0] != dataset.spanner[0][0])
    for thread, start in ((dataset._ready_thread, 0), (dataset._prepare_thread, other)):
        it.prepare_index = it.ready_index = it.yield_index = start
        thread(it)  # fails: its error is kept for the one-line message, its traceback logged
    assert "cannot reach" in str(dataset._failure) and dataset._event.is_set()
    assert "ConnectionRefused" in Path(dataset.error_log).read_text()
    ended = threading.Thread(target=it.exit, daemon=True)  # what __iter__ does after the last sample
    ended.start()
    ended.join(timeout=30)
    assert not ended.is_alive(), "the epoch's end waits forever for threads that already failed"


def test_local_shards_are_read_in_place_and_decompressed_once_for_all_runs(
    tmp_path, train_data, small_shards
):
    split = tmp_path / "split"
    subprocess.run(["cp", "-r", str(small_shards), str(split)], check=True)
    before = folder_bytes(split)
    for run in ("one", "two"):
        cfg = recipe(tmp_path, train_data, str(split), f"run_name={run}", name=f"{run}.yaml")
        assert stream_local(cfg, "train", 0, cfg.data.train[0]) == str(split.resolve())
        assert sum(1 for _ in build_dataset(cfg, "train", 8)) > 0
        if run == "one":
            after_first = folder_bytes(split)
            assert after_first > before  # the .mds beside each .mds.zstd, once
    assert folder_bytes(split) == after_first  # the second run added nothing
    assert folder_bytes(tmp_path / "cache") == 0  # nothing copied into the cache
    assert len(list(split.rglob("*.mds.zstd"))) == len(list(split.rglob("*.mds")))  # originals kept


@pytest.mark.s3
def test_a_reconverted_remote_is_never_served_from_the_old_cache(
    tmp_path, train_data, small_shards, s3_server, s3_bucket
):
    remote = upload(s3_server, s3_bucket, small_shards, "reconv/train")
    cfg = recipe(tmp_path, train_data, remote, "data.shuffle=false")
    first = [digest(s) for s in build_dataset(cfg, "train", 8)]
    old_local = Path(stream_local(cfg, "train", 0, cfg.data.train[0], "x")).parent
    assert len([p for p in old_local.iterdir() if p.is_dir()]) == 1

    # Re-convert into the same prefix with other data: the training split of the val-heavy cut.
    other = train_data.val
    client = s3_server.client()
    for key in s3_server.keys(s3_bucket, "reconv/train/"):
        client.delete_object(Bucket=s3_bucket, Key=key)
    upload(s3_server, s3_bucket, other, "reconv/train")
    second = [digest(s) for s in build_dataset(cfg, "train", 8)]
    expected = [
        digest(s)
        for s in build_dataset(
            recipe(tmp_path / "v", train_data, str(other), "data.shuffle=false"), "train", 8
        )
    ]
    assert second == expected and second != first
    assert len([p for p in old_local.iterdir() if p.is_dir()]) == 1  # the old cache folder is gone


def test_caches_that_cannot_work_are_refused_before_training(
    tmp_path, train_data, small_shards, s3_server, s3_bucket
):
    remote = upload(s3_server, s3_bucket, small_shards, "bad/train")
    too_small = recipe(tmp_path, train_data, remote, "data.cache_limit=10kb")
    with pytest.raises(ConfigError, match=r"data.cache_limit=10kb cannot hold the 4 shards .* at least \d"):
        build_dataset(too_small, "train", 8)
    (tmp_path / "file").write_text("x")
    unwritable = recipe(tmp_path, train_data, remote, f"data.cache_root={tmp_path / 'file' / 'cache'}")
    with pytest.raises(ConfigError, match="data.cache_root=.* is not a writable folder"):
        check_streams(unwritable)
    mixed = {"train": [{"remote": remote}, {"remote": str(small_shards)}]}
    with pytest.raises(ConfigError, match="mixes local and remote streams"):
        build_dataset(recipe(tmp_path, train_data, remote, "data.cache_limit=1gb", **mixed), "train", 8)
    with pytest.raises(ConfigError, match="data.cache_limit='lots' is not a size"):
        recipe(tmp_path, train_data, remote, "data.cache_limit=lots")
