"""shards/writer.py writes, byte for byte, the shards and index entries streaming's MDSWriter writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zstd

from shards.writer import HASHES, ShardWriter, index_entries_text, index_json, write_index_json
from storage import open_store


def streaming_shards(out, rows: np.ndarray, dtype: str, size_limit: int) -> list[dict]:
    """Write `rows` with the library's MDSWriter; returns its index.json shard entries."""
    from streaming import MDSWriter

    columns = {"tokens": f"ndarray:{dtype}"}
    with MDSWriter(
        out=str(out), columns=columns, compression="zstd", hashes=HASHES, size_limit=size_limit
    ) as writer:
        for row in rows:
            writer.write({"tokens": row.astype(dtype)})
    return json.loads((out / "index.json").read_text())["shards"]


@pytest.mark.parametrize(
    ("seq_len", "dtype", "count"),
    [(64, "uint16", 41), (300, "uint32", 23), (1 << 16, "uint16", 5)],  # shape stored as uint8/16/32
)
def test_shards_are_byte_identical_to_streaming(tmp_path, seq_len, dtype, count):
    rng = np.random.default_rng(seq_len)
    rows = rng.integers(0, np.iinfo(dtype).max, size=(count, seq_len), endpoint=True, dtype=np.uint32)
    sample_bytes = 4 + 1 + np.dtype(np.min_scalar_type(seq_len)).itemsize + seq_len * np.dtype(dtype).itemsize
    size_limit = 300 + int(3.5 * (sample_bytes + 4))  # a few samples a shard: several shards
    ours = ShardWriter(
        open_store(tmp_path / "ours"), "part", seq_len=seq_len, dtype=dtype, size_limit=size_limit
    )
    for piece in np.array_split(rows, [1, 2, 9, 10]):  # pieces smaller and larger than a shard
        ours.write(piece)
    entries = ours.finish()
    assert len(entries) > 1 and entries[-1]["samples"] < entries[0]["samples"]  # the last one short

    theirs = streaming_shards(tmp_path / "theirs", rows, dtype, size_limit)
    assert entries == theirs  # samples, raw_data and zip_data (basename, bytes, hashes), columns, limit
    ours_dir, theirs_dir = tmp_path / "ours" / "part", tmp_path / "theirs"
    assert sorted(os.listdir(ours_dir)) == sorted(set(os.listdir(theirs_dir)) - {"index.json"})
    for entry in entries:
        zipped = (ours_dir / entry["zip_data"]["basename"]).read_bytes()
        assert zipped == (theirs_dir / entry["zip_data"]["basename"]).read_bytes()
        # The uncompressed shard too (a zstd frame could differ only in its own framing).
        raw = zstd.decompress(zipped)
        assert raw == zstd.decompress((theirs_dir / entry["zip_data"]["basename"]).read_bytes())
        assert len(raw) == entry["raw_data"]["bytes"]


def test_an_index_written_part_by_part_is_the_bytes_write_json_writes(tmp_path):
    """A conversion writes index.json from each part's formatted entries (a million parts are not
    held in memory): the same bytes as `Store.write_json` of the whole index, empty parts too."""
    import io

    store = open_store(tmp_path)
    entry = {"basename": "part-00000/shard.00000.mds", "hashes": {"xxh64": "ab"}, "note": "é\n{"}
    for groups in ([], [[]], [[entry]], [[entry, {"samples": 3}], [], [{"zip_data": None, "a": [1, [2]]}]]):
        stream = io.StringIO()
        write_index_json(stream, [index_entries_text(group) for group in groups])
        store.write_json("index.json", index_json([e for group in groups for e in group]))
        assert stream.getvalue() == (tmp_path / "index.json").read_text(encoding="utf-8")
