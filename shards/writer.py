"""MDS shards of token samples, written to a local folder or an S3 prefix.

This writes the bytes that mosaicml-streaming 0.13's `MDSWriter` writes (tests/shards/test_shard_writer.py
compares shard files and index entries) without importing streaming, about 10 s of import
per process that every worker would pay, and a sample at a time where this packs whole shards
with numpy:

  shard file  = uint32 n | uint32 offsets[n + 1] | config JSON | n samples
  sample      = uint32 size of each column's datum | the data (columns in name order)
  datum       = one byte (ndim << 2 | shape dtype code) | shape | values (little-endian)

Pretraining shards have one column, `tokens`; SFT shards (`convert.sft`) add `loss_mask` and
`segments`, each also `seq_len` values long, so every sample still has the same byte size.
  zip file    = the shard file compressed with zstd (level 3), named `shard.NNNNN.mds.zstd`
  index.json  = {"version": 2, "shards": [{samples, raw_data, zip_data, ...config}]}

Each shard entry carries the sha1 and xxh64 of both the raw and the compressed bytes, which
streaming checks on download when asked to (`validate_hash`).

Storage goes through the project's storage layer (`storage.Store`; the output folder is opened by
shards/output.py): a local folder (atomic
writes: temporary file, then rename) or an S3 prefix (a PUT is atomic). The pipeline writes `index.json` last, so a reader never sees a
split whose shards are not all stored.
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from collections.abc import Iterable
from typing import TextIO

import numpy as np

from shards.errors import ShardsError
from shards.index import INDEX_FILE
from shards.meta import SplitMeta, write_meta
from storage import Store

COLUMN = "tokens"
HASHES = ["sha1", "xxh64"]  # streaming wants them sorted
ZSTD_LEVEL = 3
_SHAPE_DTYPE_CODES = {"uint8": 0, "uint16": 1, "uint32": 2}


# --- MDS shards --------------------------------------------------------------------------------


def _hashes(data: bytes) -> dict[str, str]:
    import xxhash

    return {"sha1": hashlib.sha1(data).hexdigest(), "xxh64": xxhash.xxh64(data).hexdigest()}


class ShardWriter:
    """Writes rows of token ids as MDS shards into `folder` of a store.

    Samples all have the same byte size, so a shard is built with numpy in one go and its
    sample count is fixed by the size limit up front.
    """

    def __init__(
        self,
        store: Store,
        folder: str,
        *,
        seq_len: int,
        dtype: str,
        size_limit: int,
        extra_columns: dict[str, str] | None = None,
    ) -> None:
        """`extra_columns` ({name: dtype}) are stored beside `tokens`; `write` then takes a dict of
        `[rows, seq_len]` arrays, one per column, instead of the token rows alone."""
        self.store, self.folder, self.dtype = store, folder, np.dtype(dtype)
        # In name order, as streaming's MDSWriter stores them (its readers look columns up by name).
        named = {COLUMN: self.dtype, **{k: np.dtype(v) for k, v in (extra_columns or {}).items()}}
        self.columns = {name: named[name] for name in sorted(named)}
        self.config = {
            "column_encodings": [f"ndarray:{d.name}" for d in self.columns.values()],
            "column_names": list(self.columns),
            "column_sizes": [None] * len(self.columns),
            "compression": "zstd",
            "format": "mds",
            "hashes": HASHES,
            "size_limit": size_limit,
            "version": 2,
        }
        self._config_bytes = json.dumps(self.config, sort_keys=True).encode()
        self._headers = [_datum_header(seq_len, d) for d in self.columns.values()]
        widths = [
            len(h) + seq_len * d.itemsize for h, d in zip(self._headers, self.columns.values(), strict=True)
        ]
        self._sizes = np.array(widths, dtype="<u4")  # each datum's size: what a sample starts with
        sample_bytes = int(self._sizes.sum()) + 4 * len(self.columns)
        # streaming counts 4 bytes per sample (its offset) and 8 + config per shard.
        fixed = 8 + len(self._config_bytes)
        self.rows_per_shard = max(1, (size_limit - fixed) // (sample_bytes + 4))
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self.shards: list[dict] = []
        self.samples = 0

    def write(self, rows: np.ndarray | dict[str, np.ndarray]) -> None:
        """Token rows `[n, seq_len]`, or with extra columns a dict of such arrays (one per column)."""
        columns = rows if isinstance(rows, dict) else {COLUMN: rows}
        if set(columns) != set(self.columns):
            raise ValueError(f"rows for columns {sorted(columns)}, expected {list(self.columns)}")
        for name, values in columns.items():
            if len(values) and int(values.max()) > np.iinfo(self.columns[name]).max:
                what = "token id" if name == COLUMN else f"{name} value"
                raise ShardsError(
                    f"{what} {int(values.max())} does not fit in {self.columns[name].name}; use --dtype auto"
                )
        # One row of bytes per sample: every column's values, side by side, in column order.
        blocks = [_as_bytes(columns[name], dtype) for name, dtype in self.columns.items()]
        block = blocks[0] if len(blocks) == 1 else np.hstack(blocks)
        self._pending.append(block)
        self._pending_rows += len(block)
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def finish(self) -> list[dict]:
        """Store what is pending; returns the shard entries (basenames relative to `folder`)."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        return self.shards

    def _flush(self, count: int) -> None:
        rows = np.concatenate(self._pending)
        shard, rest = rows[:count], rows[count:]
        self._pending, self._pending_rows = ([rest] if len(rest) else []), len(rest)
        self._store_shard(self._encode(shard), len(shard))

    def _encode(self, rows: np.ndarray) -> bytes:
        """`rows`: one row of value bytes per sample, the columns side by side (see `write`)."""
        n = len(rows)
        pieces, start = [np.tile(np.frombuffer(self._sizes.tobytes(), np.uint8), (n, 1))], 0
        for header, size in zip(self._headers, self._sizes, strict=True):
            width = int(size) - len(header)
            pieces += [np.tile(header, (n, 1)), rows[:, start : start + width]]
            start += width
        body = np.hstack(pieces)
        start = 4 + 4 * (n + 1) + len(self._config_bytes)
        offsets = (start + np.arange(n + 1, dtype=np.int64) * body.shape[1]).astype("<u4")
        return np.uint32(n).tobytes() + offsets.tobytes() + self._config_bytes + body.tobytes()

    def _store_shard(self, raw: bytes, samples: int) -> None:
        import zstd

        name = f"shard.{len(self.shards):05d}.mds"
        compressed = zstd.compress(raw, ZSTD_LEVEL)
        self.store.write_bytes(f"{self.folder}/{name}.zstd".lstrip("/"), compressed)
        entry = {
            "samples": samples,
            "raw_data": {"basename": name, "bytes": len(raw), "hashes": _hashes(raw)},
            "zip_data": {"basename": f"{name}.zstd", "bytes": len(compressed), "hashes": _hashes(compressed)},
            **self.config,
        }
        self.shards.append(entry)
        self.samples += samples


def _as_bytes(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`[n, seq_len]` values as `[n, seq_len * itemsize]` bytes of `dtype`."""
    typed = np.ascontiguousarray(values, dtype=dtype)
    return typed.view(np.uint8).reshape(typed.shape[0], typed.shape[1] * dtype.itemsize)


def _datum_header(seq_len: int, dtype: np.dtype) -> np.ndarray:
    """The bytes before a column's values: the shape header of a 1-D array of seq_len."""
    shape_dtype = "uint8" if seq_len < 1 << 8 else "uint16" if seq_len < 1 << 16 else "uint32"
    shape = np.array([seq_len], dtype=shape_dtype).tobytes()
    header = bytes([(1 << 2) | _SHAPE_DTYPE_CODES[shape_dtype]]) + shape
    return np.frombuffer(header, dtype=np.uint8)


def prefixed_entries(shards: list[dict], folder: str) -> list[dict]:
    """Shard entries of a part, with basenames made relative to the split's folder."""
    out = []
    for shard in shards:
        entry = dict(shard)
        for key in ("raw_data", "zip_data"):
            entry[key] = {**shard[key], "basename": f"{folder}/{shard[key]['basename']}"}
        out.append(entry)
    return out


def index_json(shards: list[dict]) -> dict:
    return {"version": 2, "shards": shards}


def index_entries_text(shards: Iterable[dict]) -> str:
    """Shard entries as `Store.write_json` lays them out inside index.json, joined by ",\\n" (a
    conversion's workers format their part's entries; the main process only concatenates them)."""
    return ",\n".join(
        textwrap.indent(json.dumps(shard, indent=2, sort_keys=True, ensure_ascii=False), "    ")
        for shard in shards
    )


def write_index_json(stream: TextIO, texts: Iterable[str]) -> None:
    """`index_json` of all the shards, byte for byte as `Store.write_json` writes it, from the
    `index_entries_text` of consecutive groups of them (a split of a million parts has an index of
    a million entries: not held in memory)."""
    stream.write('{\n  "shards": [')
    first = True
    for text in texts:
        if text:
            stream.write(("\n" if first else ",\n") + text)
            first = False
    stream.write("]" if first else "\n  ]")
    stream.write(',\n  "version": 2\n}\n')


def write_token_split(store: Store, rows: Iterable[np.ndarray], meta: SplitMeta, *, size_limit: int) -> None:
    """A whole pretraining split at the root of `store` from batches of token rows: shards, meta.json,
    index.json last (for benchmarks and tests that need shards without a corpus)."""
    writer = ShardWriter(store, "", seq_len=meta.seq_len, dtype=meta.dtype, size_limit=size_limit)
    for batch in rows:
        writer.write(batch)
    write_meta(store, meta, folder="")
    store.write_json(INDEX_FILE, index_json(writer.finish()))
