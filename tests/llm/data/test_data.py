"""The data path: metadata checks, the streaming dataset, mixing, S3, stale shared memory."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from tests.support import forkserver
import pytest
import torch
from tests.support.training import REPO, load, train_py, write_recipe

from llm.data import build_dataloader, build_dataset, check_streams, document_eos, stream_local
from llm.errors import ConfigError
from shards.meta import FORMAT_NAME


def _cfg(tmp_path, train_data, *overrides, name="r.yaml", **sections):
    return load(write_recipe(tmp_path / name, train_data, **sections), *overrides)


def test_batches_are_writable_long_tensors_of_whole_samples(tmp_path, train_data):
    cfg = _cfg(tmp_path, train_data)
    batch = next(iter(build_dataloader(cfg, "train", 8)))
    ids = batch["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape == (8, train_data.seq_len)
    assert int(ids.max()) < train_data.vocab_size and int(ids.min()) >= 0
    ids[0, 0] = 0  # a read-only view into the shard would raise here


def _order(cfg, n=40) -> list[str]:
    samples = itertools.islice(iter(build_dataset(cfg, "train", 8)), n)  # iteration order = shuffled
    return [hashlib.sha1(s.numpy().tobytes()).hexdigest() for s in samples]


def test_shuffle_is_deterministic_per_seed(tmp_path, train_data):
    a = _order(_cfg(tmp_path / "a", train_data))
    b = _order(_cfg(tmp_path / "b", train_data))
    c = _order(_cfg(tmp_path / "c", train_data, "data.shuffle_seed=1"))
    assert a == b
    assert a != c


def test_streams_mix_by_proportion(tmp_path, train_data):
    data = {
        "train": [
            {"remote": str(train_data.train), "proportion": 1.0},
            {"remote": str(train_data.val), "proportion": 1.0},
        ],
        "cache_root": str(tmp_path / "cache"),
    }
    cfg = load(write_recipe(tmp_path / "r.yaml", train_data, data=data))
    val_ids = {
        s.numpy().tobytes()
        for s in build_dataset(load(write_recipe(tmp_path / "v.yaml", train_data)), "eval", 8)
    }
    dataset = build_dataset(cfg, "train", 8)
    epoch = [s.numpy().tobytes() for s in dataset]
    from_val = sum(s in val_ids for s in epoch)
    # Equal proportions: half of the epoch comes from the (ten times smaller) validation split.
    assert len(epoch) == len(dataset)
    assert from_val / len(epoch) == pytest.approx(0.5, abs=0.02)


def test_each_dataset_gets_its_own_cache_folder(tmp_path, train_data):
    cfg = _cfg(tmp_path, train_data)
    remote = type(cfg.data.train[0])(remote="s3://bkt/shards/train")  # remote splits are cached
    other = type(remote)(remote="s3://bkt/shards/val")
    locals_ = {
        stream_local(cfg, "train", 0, remote, "idx1"),
        stream_local(cfg, "eval", 0, remote, "idx1"),
        stream_local(cfg, "train", 1, remote, "idx1"),
        stream_local(cfg, "train", 0, other, "idx1"),
        stream_local(cfg, "train", 0, remote, "idx2"),  # the remote's index.json changed
    }
    assert len(locals_) == 5
    assert all(p.startswith(str(tmp_path / "run" / "cache" / "test")) for p in locals_)
    # a local split is read where it is
    assert stream_local(cfg, "train", 0, cfg.data.train[0]) == str(train_data.train.resolve())


# --- metadata --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.vocab_size=1000"],
            ["vocab_size=4096", "model.vocab_size=1000", "set model.vocab_size >= 4096"],
        ),
        (["model.max_seq_len=128"], ["seq_len=64", "model.max_seq_len=128", "--seq-len 128"]),
    ],
)
def test_shards_contradicting_the_model_are_refused(tmp_path, train_data, overrides, expected):
    expected = [e.replace("4096", str(train_data.vocab_size)) for e in expected]
    cfg = _cfg(tmp_path, train_data, *overrides)
    with pytest.raises(ConfigError) as err:
        check_streams(cfg)
    message = str(err.value)
    assert "data.train.0" in message and str(train_data.train) in message
    for part in expected:
        assert part in message


def test_shards_from_another_tokenizer_are_refused(tmp_path, train_data):
    other = tmp_path / "other.model"
    other.write_bytes(train_data.tokenizer.read_bytes() + b"\0")
    cfg = _cfg(tmp_path, train_data, f"tokenizer.path={other}")
    with pytest.raises(ConfigError, match="tokenized with a tokenizer of sha256") as err:
        check_streams(cfg)
    assert hashlib.sha256(other.read_bytes()).hexdigest() in str(err.value)
    check_streams(_cfg(tmp_path, train_data, f"tokenizer.path={other}", "data.check_tokenizer_hash=false"))


def test_shards_without_meta_json_are_refused(tmp_path, train_data):
    bare = tmp_path / "bare"
    shutil.copytree(train_data.train, bare)
    (bare / "meta.json").unlink()
    data = {"train": [{"remote": str(bare)}], "cache_root": str(tmp_path / "cache")}
    cfg = load(write_recipe(tmp_path / "r.yaml", train_data, data=data))
    with pytest.raises(
        ConfigError, match=r"no meta\.json: it was not produced by `python -m convert shards`"
    ):
        check_streams(cfg)


def test_metadata_is_checked_by_train_py_before_training(tmp_path, train_data, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    code = train_py(str(recipe), "model.max_seq_len=128")
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.startswith("error: data.train.0") and "model.max_seq_len=128" in err


def test_documents_apart_need_shards_whose_tokenizer_has_an_eos_id(tmp_path, train_data, capsys):
    """model.attention=document tells documents apart by meta.json's eos_id: none (-1) is one line, exit 2,
    before the run folder exists; the streams must agree on it."""
    no_eos = tmp_path / "no-eos"
    shutil.copytree(train_data.train, no_eos)
    meta = json.loads((no_eos / "meta.json").read_text())
    (no_eos / "meta.json").write_text(json.dumps({**meta, "eos_id": -1}))
    data = {"train": [{"remote": str(no_eos)}], "cache_root": str(tmp_path / "cache")}
    recipe = write_recipe(
        tmp_path / "r.yaml", train_data, data=data, checkpoint={"save_folder": str(tmp_path / "ck")}
    )
    assert train_py(str(recipe), "model.attention=document") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data.train.0"), err
    assert "has no EOS id (meta.json eos_id=-1)" in err and "model.attention=causal" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()
    check_streams(load(recipe))  # causal over the window needs no EOS

    cfg = _cfg(tmp_path, train_data, "model.attention=document", name="mixed.yaml")
    assert document_eos(cfg, check_streams(cfg)) == meta["eos_id"]
    (no_eos / "meta.json").write_text(json.dumps({**meta, "eos_id": 7}))
    data["train"].append({"remote": str(train_data.train)})
    cfg = load(write_recipe(tmp_path / "two.yaml", train_data, data=data), "model.attention=document")
    with pytest.raises(
        ConfigError,
        match=f"data.train.0 separates documents with eos_id=7 but data.train.1 with eos_id={meta['eos_id']}",
    ):
        check_streams(cfg)


# --- S3 ----------------------------------------------------------------------------------------


def _upload(s3_server, bucket: str, folder: Path, prefix: str) -> str:
    client = s3_server.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{bucket}/{prefix}"


@pytest.mark.s3
def test_trains_from_s3_and_checks_s3_metadata(tmp_path, train_data, s3_server, s3_bucket):
    from tests.support.training import read_metrics

    from llm.trainer import train

    train_remote = _upload(s3_server, s3_bucket, train_data.train, "shards/train")
    val_remote = _upload(s3_server, s3_bucket, train_data.val, "shards/val")
    data = {
        "train": [{"remote": train_remote}],
        "eval": [{"remote": val_remote}],
        "cache_root": str(tmp_path / "c"),
    }
    recipe = write_recipe(tmp_path / "r.yaml", train_data, data=data)

    with pytest.raises(ConfigError, match=f"data.train.0 \\({train_remote}\\).*seq_len=64"):
        check_streams(load(recipe, "model.max_seq_len=32"))
    result = train(
        load(recipe, "training.max_duration=4ba", "training.eval_interval=4ba", "scheduler.warmup=1ba")
    )
    assert result.step == 4 and result.eval_loss is not None
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [4]


# --- a start after a crashed run -----------------------------------------------------------

_CRASH = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from tests.support.training import load
from llm.data import build_dataset
cfg = load({recipe!r})
dataset = build_dataset(cfg, "train", 8)
dataset[0]
# Die like a run whose container or process group is killed: the multiprocessing resource
# tracker dies too, so nobody unlinks the dataset's shared memory.
assert os.getpgid(0) == os.getpid(), "run me in a session of my own"
os.killpg(os.getpgid(0), signal.SIGKILL)
"""


@pytest.mark.slow
def test_start_after_a_crashed_run_cleans_stale_shared_memory(tmp_path, train_data, monkeypatch):
    import tempfile

    from streaming import StreamingDataset

    from llm.trainer import train

    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(repo=str(REPO), recipe=str(recipe)))
    crashed_tmp, restart_tmp = tmp_path / "tmp-crashed", tmp_path / "tmp-restart"
    crashed_tmp.mkdir(), restart_tmp.mkdir()
    # A session of its own (a fork-served process has one), so that killing its process group
    # cannot reach pytest; and a /tmp of its own, as in a container that shares the host's /dev/shm
    # (docker --ipc=host).
    env = {**os.environ, "TMPDIR": str(crashed_tmp)}
    proc = forkserver.run(
        [sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-2000:]

    # The restarted container: same /dev/shm, fresh /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(restart_tmp))
    cfg = load(recipe, "training.max_duration=2ba", "data.eval=[]", "scheduler.warmup=1ba")
    local = stream_local(cfg, "train", 0, cfg.data.train[0])
    with pytest.raises(ValueError, match="Reused local directory"):  # what a naive restart hits
        StreamingDataset(remote=str(Path(train_data.train).resolve()), local=local, batch_size=8)
    assert train(cfg).step == 2


def test_a_live_dataset_on_the_same_local_shards_keeps_its_shared_memory(tmp_path, train_data):
    """Local shards are read in place by any number of live datasets (an eval beside a training run,
    a sweep's runs on one machine): a start cleans only registrations no live dataset holds, so the
    next dataset takes a prefix of its own instead of the live one's. Here the live one is this
    process's own; once a run has ended, its datasets' memory is released (`ReleaseDatasets`)."""
    from llm.data import all_stream_locals, clean_stale_shared_memory
    from llm.data.shared_memory import SHM_DIR

    cfg = load(write_recipe(tmp_path / "r.yaml", train_data), "data.eval=[]")
    first = build_dataset(cfg, "train", 8)
    sample = first[0]
    segment = SHM_DIR / f"{first._shm_prefix_int:06d}_locals"
    assert segment.exists()
    assert str(train_data.train.resolve()) in [os.path.abspath(p) for p in all_stream_locals(cfg)]

    assert clean_stale_shared_memory(all_stream_locals(cfg)) == []  # it is alive: not stale
    assert segment.exists()
    second = build_dataset(cfg, "train", 8)
    assert second._shm_prefix_int != first._shm_prefix_int
    assert torch.equal(first[0], sample) and torch.equal(second[0], sample)


def test_a_run_s_datasets_give_their_shared_memory_back_when_the_trainer_closes(tmp_path, train_data):
    """In a process that goes on after a run (a notebook, a test worker), the finished run's
    prefixes would otherwise stay taken until the process ends, and every later dataset walks past
    each of them (streaming keeps a descriptor of each)."""
    from llm.data.shared_memory import SHM_DIR
    from llm.trainer import build_trainer

    cfg = load(
        write_recipe(tmp_path / "r.yaml", train_data), "training.max_duration=1ba", "scheduler.warmup=0ba"
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    datasets = [
        trainer.state.train_dataloader.dataset,
        *(e.dataloader.dataloader.dataset for e in trainer.state.evaluators),
    ]
    segments = [SHM_DIR / f"{d._shm_prefix_int:06d}_locals" for d in datasets]
    assert len(segments) == 2 and all(s.exists() for s in segments)
    trainer.close()
    assert not any(s.exists() for s in segments)


def test_a_dead_dataset_s_resume_state_on_a_free_prefix_is_cleaned(tmp_path, train_data):
    """streaming's clean-up list leaves out the resume state a checkpoint's load writes
    (`<prefix>_resume`): on a free prefix, the next dataset to take it would start from a dead
    run's position. A start removes it with the rest."""
    from llm.data import clean_stale_shared_memory
    from llm.data.shared_memory import SHM_DIR

    free = max((int(p.name[:6]) for p in SHM_DIR.glob("[0-9]" * 6 + "_*")), default=0) + 1000
    left = SHM_DIR / f"{free:06d}_resume"
    left.write_bytes(b'{"epoch": 0, "sample_in_epoch": 64, "num_canonical_nodes": 1}')
    # A dataset taking the free prefix this moment: its registration before its lock, so only
    # what was left (resume state, epoch order) may go, not what a start is creating.
    taking = SHM_DIR / f"{free:06d}_barrier"
    taking.write_bytes(bytes(8))
    try:
        assert clean_stale_shared_memory([str(tmp_path / "elsewhere")]) == []  # not a registration
        assert not left.exists() and taking.exists()
    finally:
        taking.unlink(missing_ok=True)


_HOLD = """
import sys

from llm.config import load_config
from llm.data import build_dataset

dataset = build_dataset(load_config(sys.argv[1], ["data.eval=[]"]), "train", 8)
print(dataset._shm_prefix_int, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_another_process_s_live_dataset_is_kept_and_once_it_is_killed_cleaned(tmp_path, train_data):
    """Whether another process maps the segments says nothing (every dataset's start maps all it
    walks past until its process ends): the lock each live dataset holds on its prefix tells, and
    the kernel drops it with the process, SIGKILL too."""
    import subprocess

    from llm.data import all_stream_locals, clean_stale_shared_memory
    from llm.data.shared_memory import SHM_DIR

    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    cfg = load(recipe, "data.eval=[]")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(recipe)], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        prefix = int(holder.stdout.readline())
        segment = SHM_DIR / f"{prefix:06d}_locals"
        assert clean_stale_shared_memory(all_stream_locals(cfg)) == [] and segment.exists()
        mine = build_dataset(cfg, "train", 8)  # beside it, on the same local shards
        assert mine._shm_prefix_int != prefix
    finally:  # its whole group, as a container's OOM kill: its resource tracker cleans up nothing
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    assert clean_stale_shared_memory(all_stream_locals(cfg)) == [prefix]  # killed: stale
    assert not segment.exists() and (SHM_DIR / f"{mine._shm_prefix_int:06d}_locals").exists()


def test_meta_json_records_match_the_fixture(train_data):
    meta = json.loads((train_data.train / "meta.json").read_text())
    assert meta["format"] == FORMAT_NAME and meta["seq_len"] == train_data.seq_len


def _tampered_copy(split: Path, dest: Path) -> Path:
    """A copy of `split` whose first shard holds other tokens, still valid zstd of the same size."""
    import zstd

    shutil.copytree(split, dest, ignore=shutil.ignore_patterns("*.mds"))  # as converted: zstd only
    index = json.loads((dest / "index.json").read_text())
    zip_path = dest / index["shards"][0]["zip_data"]["basename"]
    raw = bytearray(zstd.decompress(zip_path.read_bytes()))
    raw[-2:] = bytes([raw[-2] ^ 1, raw[-1]])  # one bit of the last sample's last token
    zip_path.write_bytes(zstd.compress(bytes(raw), 3))
    return dest


def test_shard_hashes_are_checked_on_read_and_can_be_turned_off(tmp_path, train_data):
    tampered = _tampered_copy(train_data.train, tmp_path / "tampered")
    data = {"train": [{"remote": str(tampered)}], "shuffle": False, "cache_root": str(tmp_path / "c1")}
    cfg = load(write_recipe(tmp_path / "r.yaml", train_data, data=data))
    assert cfg.data.validate_hash == "xxh64"  # the default
    dataset = build_dataset(cfg, "train", 8)
    with pytest.raises(ValueError, match="Checksum failure"):
        dataset[0]  # sample 0 lives in the tampered shard
    del dataset

    data["cache_root"] = str(tmp_path / "c2")
    cfg = load(write_recipe(tmp_path / "r2.yaml", train_data, data=data), "data.validate_hash=null")
    assert build_dataset(cfg, "train", 8)[0].shape == (train_data.seq_len,)  # read silently


def test_index_problems_are_found_at_start_not_when_training_reaches_them(tmp_path, train_data):
    split = tmp_path / "split"
    shutil.copytree(train_data.train, split)
    data = {"train": [{"remote": str(split)}], "cache_root": str(tmp_path / "c")}
    cfg = load(write_recipe(tmp_path / "r.yaml", train_data, data=data))
    check_streams(cfg)  # intact: accepted

    index = json.loads((split / "index.json").read_text())
    last = split / index["shards"][-1]["zip_data"]["basename"]
    last.rename(tmp_path / "aside")
    with pytest.raises(ConfigError, match=r"1 of the \d+ shard files index.json names are missing"):
        check_streams(cfg)
    (tmp_path / "aside").rename(last)

    for shard in index["shards"]:
        shard["zip_data"]["hashes"] = {}
    (split / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="carry no xxh64 hash.*data.validate_hash=null"):
        check_streams(cfg)
    check_streams(load(write_recipe(tmp_path / "r2.yaml", train_data, data=data), "data.validate_hash=null"))

    (split / "index.json").unlink()
    with pytest.raises(ConfigError, match="no index.json, so the conversion into it did not finish"):
        check_streams(cfg)


def test_a_shared_memory_prefix_taken_at_the_same_moment_by_another_process_is_retried(
    tmp_path, train_data, monkeypatch
):
    """Another process creating the prefix this one picked, between streaming's check and its
    create, is simulated at the create (a real race cannot be timed): the dataset is built again,
    from fresh streams, and reads the same samples."""
    import streaming.base.shared.prefix as prefix

    real = prefix.SharedMemory
    raced = []

    def racing(name, create=True, size=0, auto_cleanup=True):
        if create and not raced:
            raced.append(name)
            raise FileExistsError(17, "File exists", f"/{name}")
        return real(name, create, size, auto_cleanup)

    monkeypatch.setattr(prefix, "SharedMemory", racing)
    cfg = _cfg(tmp_path, train_data, "data.shuffle=false")
    dataset = build_dataset(cfg, "train", 8)
    assert raced and raced[0].endswith("_locals")
    first = dataset[0]
    del dataset
    monkeypatch.setattr(prefix, "SharedMemory", real)
    again = build_dataset(_cfg(tmp_path, train_data, "data.shuffle=false", name="r2.yaml"), "train", 8)
    assert torch.equal(first, again[0])

    def other():  # any other existing file is not that race
        raise FileExistsError(17, "File exists", "/tmp/cache/shard.00000.mds")

    from llm.data.shared_memory import with_shm_race_retry

    with pytest.raises(FileExistsError):
        with_shm_race_retry(other)
