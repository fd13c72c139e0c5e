"""This node's copy of the newest checkpoint (llm/checkpoint/local_copy.py): loaded at a restart
only when it is what the store's manifest says, else downloaded again into it; real S3 (loopback)."""

from __future__ import annotations

import pytest

from llm.checkpoint import restart
from llm.checkpoint.local_copy import NodeCopy, node_copy
from llm.checkpoint.resume import newest_usable_checkpoint
from llm.config import load_config
from storage import open_store
from tests.support.resume import write_recipe
from tests.support.training import checkpoint_bytes, store_checkpoint

pytestmark = pytest.mark.s3


OLDER, NEWER = checkpoint_bytes("older checkpoint"), checkpoint_bytes("newer checkpoint")


@pytest.fixture
def run(tmp_path, s3_bucket):
    """A run's folder on S3 with complete checkpoints at 4 and 8, and an empty copy folder."""
    store = open_store(f"s3://{s3_bucket}/run")
    for batch, payload in ((4, OLDER), (8, NEWER)):
        local = tmp_path / f"ba{batch}.pt"
        local.write_bytes(payload)
        store_checkpoint(store, batch, local)
    return store, NodeCopy(tmp_path / "node-copy", writer=True)


def _counts() -> tuple[int, int]:
    return restart.DOWNLOADED["files"], restart.REUSED["files"]


def test_a_copy_that_matches_the_manifest_is_loaded_and_nothing_is_downloaded(run, s3_server, s3_bucket):
    store, copy = run
    (copy.root).mkdir()
    (copy.root / "ep0-ba8-rank0.pt").write_bytes(NEWER)
    # The stored file now differs (same size): a download would fail its SHA-256 and fall back to 4.
    s3_server.client().put_object(
        Bucket=s3_bucket, Key="run/ep0-ba8-rank0.pt", Body=NEWER[:-1] + bytes([NEWER[-1] ^ 1])
    )
    downloaded, reused = _counts()
    point = newest_usable_checkpoint(store.root, copy=copy)
    assert point.batch == 8 and point.load_path == str(copy.root / "ep0-ba8-rank0.pt")
    assert open(point.load_path, "rb").read() == NEWER
    assert _counts() == (downloaded, reused + 1)  # reused, not downloaded


@pytest.mark.parametrize(
    "damaged",
    [NEWER[:-1] + bytes([NEWER[-1] ^ 1]), NEWER[: len(NEWER) // 2]],
    ids=["a byte flipped", "truncated"],
)
def test_a_copy_that_differs_from_its_manifest_by_a_byte_is_downloaded_again(run, damaged):
    store, copy = run
    copy.root.mkdir()
    (copy.root / "ep0-ba8-rank0.pt").write_bytes(damaged)
    downloaded, reused = _counts()
    point = newest_usable_checkpoint(store.root, copy=copy)
    assert point.batch == 8 and open(point.load_path, "rb").read() == NEWER
    assert point.load_path == str(copy.root / "ep0-ba8-rank0.pt")  # the copy now holds the good bytes
    assert _counts() == (downloaded + 1, reused)


def test_a_damaged_copy_of_a_damaged_stored_checkpoint_is_refused_for_the_one_before(
    run, s3_server, s3_bucket
):
    store, copy = run
    copy.root.mkdir()
    flipped = NEWER[:-1] + bytes([NEWER[-1] ^ 1])
    (copy.root / "ep0-ba8-rank0.pt").write_bytes(flipped)
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/ep0-ba8-rank0.pt", Body=flipped)
    point = newest_usable_checkpoint(store.root, copy=copy)
    assert point.batch == 4 and open(point.load_path, "rb").read() == OLDER
    assert sorted(p.name for p in copy.root.iterdir()) == ["ep0-ba4-rank0.pt"]  # 8's bytes never kept


def test_a_copy_of_an_older_checkpoint_is_replaced_by_the_newest_one(run):
    store, copy = run
    copy.root.mkdir()
    (copy.root / "ep0-ba4-rank0.pt").write_bytes(OLDER)  # a node that was away for a save
    point = newest_usable_checkpoint(store.root, copy=copy)
    assert point.batch == 8 and open(point.load_path, "rb").read() == NEWER
    assert sorted(p.name for p in copy.root.iterdir()) == ["ep0-ba8-rank0.pt"]


def test_a_rank_that_does_not_write_the_copy_downloads_to_its_own_folder(run):
    store, copy = run
    reader = NodeCopy(copy.root, writer=False)  # not the node's first rank
    point = newest_usable_checkpoint(store.root, copy=reader)
    assert point.batch == 8 and open(point.load_path, "rb").read() == NEWER
    assert not copy.root.exists() and not point.load_path.startswith(str(copy.root))


def test_keep_moves_the_stored_files_in_and_drops_the_older_copy(tmp_path):
    copy = NodeCopy(tmp_path / "node-copy", writer=True)
    staging = tmp_path / "staging"
    for batch in (4, 8):
        staged = staging / f"ep0-ba{batch}-rank0.pt"
        staged.parent.mkdir(exist_ok=True)
        staged.write_bytes(b"x" * batch)
        assert copy.keep([staged], staging)
        assert not staged.exists()
    assert sorted(p.name for p in copy.root.iterdir()) == ["ep0-ba8-rank0.pt"]
    other = NodeCopy(tmp_path / "node-copy", writer=False)
    staged = staging / "ep0-ba12-rank0.pt"
    staged.write_bytes(b"y")
    assert not other.keep([staged], staging) and not staged.exists()  # deleted, as without a copy
    assert sorted(p.name for p in copy.root.iterdir()) == ["ep0-ba8-rank0.pt"]
    copy.remove()
    assert not copy.root.exists()


def test_only_a_run_saving_to_s3_with_local_copy_on_has_a_copy_one_per_save_folder(tmp_path):
    base = write_recipe(
        tmp_path / "recipe.yaml", tmp_path / "shards", str(tmp_path / "unused"), cache=tmp_path
    )
    s3 = ["checkpoint.save_folder=s3://b/runs/r", f"checkpoint.staging_folder={tmp_path / 'stage'}"]
    copy = node_copy(load_config(base, s3))
    assert copy is not None and copy.root.parent == tmp_path / "stage" and copy.writer
    assert copy.root.name.startswith("llm-ckpt-copy-")
    other = node_copy(load_config(base, ["checkpoint.save_folder=s3://b/runs/other", s3[1]]))
    assert other.root != copy.root
    assert node_copy(load_config(base, [*s3, "checkpoint.local_copy=false"])) is None
    assert node_copy(load_config(base, [f"checkpoint.save_folder={tmp_path / 'ckpt'}"])) is None
