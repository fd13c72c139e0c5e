"""MDS shards of token samples, written to a local folder or an S3 prefix, and read back.

This writes the MDS layout that mosaicml-streaming 0.13 reads (`StreamingDataset`), without
importing streaming (about 10 s of import per process, paid by every worker otherwise):

  shard file  = uint32 n | uint32 offsets[n + 1] | config JSON | n samples
  sample      = uint32 size of the `tokens` datum | datum
  datum       = one byte (ndim << 2 | shape dtype code) | shape | ids (little-endian)
  zip file    = the shard file compressed with zstd (level 3), named `shard.NNNNN.mds.zstd`
  index.json  = {"version": 2, "shards": [{samples, raw_data, zip_data, ...config}]}

Each shard entry carries the sha1 and xxh64 of both the raw and the compressed bytes, which
streaming checks on download when asked to (`validate_hash`).

Storage goes through `Store`: a local folder (atomic writes: temporary file, then rename) or an
S3 prefix (a PUT is atomic). The pipeline writes `index.json` last, so a reader never sees a
split whose shards are not all stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from convert.errors import ConvertError

COLUMN = "tokens"
HASHES = ["sha1", "xxh64"]  # streaming wants them sorted
ZSTD_LEVEL = 3
_SHAPE_DTYPE_CODES = {"uint8": 0, "uint16": 1, "uint32": 2}


# --- storage -----------------------------------------------------------------------------------


class Store:
    """Files under one root (local folder or s3://bucket/prefix), addressed by relative path."""

    root: str

    @staticmethod
    def open(out: str) -> Store:
        if out.startswith("s3://"):
            bucket, _, prefix = out[len("s3://") :].partition("/")
            if not bucket:
                raise ConvertError(f"--out {out}: an S3 output needs a bucket, e.g. s3://my-bucket/shards")
            return S3Store(bucket, prefix.strip("/"))
        return LocalStore(out)

    def url(self, rel: str = "") -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def check_writable(self) -> None: ...
    def exists(self, rel: str) -> bool: ...
    def size(self, rel: str) -> int | None: ...
    def read_bytes(self, rel: str) -> bytes | None: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def delete_tree(self, rel: str) -> None: ...
    def list_dirs(self, rel: str) -> list[str]: ...

    def read_json(self, rel: str) -> dict | None:
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None  # a torn or foreign file: treated as absent, so the work is redone

    def write_json(self, rel: str, obj: dict) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


@dataclass
class LocalStore(Store):
    root: str

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def check_writable(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.root))
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConvertError(f"--out {self.root} is a file; give a folder")
        if not os.path.isdir(parent):
            raise ConvertError(f"--out {self.root}: its parent folder {parent} does not exist")

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def size(self, rel: str) -> int | None:
        try:
            return os.path.getsize(self._path(rel))
        except OSError:
            return None

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            with open(self._path(rel), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as stream:
            stream.write(data)
        os.replace(tmp, path)

    def delete_tree(self, rel: str) -> None:
        path = self._path(rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def list_dirs(self, rel: str) -> list[str]:
        path = self._path(rel)
        if not os.path.isdir(path):
            return []
        return sorted(name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name)))


@dataclass
class S3Store(Store):
    bucket: str
    prefix: str
    root: str = field(init=False)

    def __post_init__(self) -> None:
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    @staticmethod
    def _client():
        from convert.sources import s3_client

        return s3_client()

    def _endpoint(self) -> str:
        endpoint = os.environ.get("S3_ENDPOINT_URL")
        return f"endpoint {endpoint}" if endpoint else "the AWS default endpoint (S3_ENDPOINT_URL unset)"

    def check_writable(self) -> None:
        """Fail before any work when the bucket is missing or the endpoint does not answer."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client().head_bucket(Bucket=self.bucket)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ConvertError(
                    f"bucket {self.bucket!r} does not exist at {self._endpoint()}; create it or fix --out"
                ) from err
            raise ConvertError(f"bucket {self.bucket!r} at {self._endpoint()}: {code or err}") from err
        except BotoCoreError as err:
            raise ConvertError(
                f"cannot reach {self._endpoint()} for bucket {self.bucket!r} ({err}); check S3_ENDPOINT_URL"
            ) from err

    def exists(self, rel: str) -> bool:
        return self.size(rel) is not None

    def size(self, rel: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self._client().head_object(Bucket=self.bucket, Key=self._key(rel))["ContentLength"])
        except ClientError as err:
            if err.response.get("Error", {}).get("Code", "") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def read_bytes(self, rel: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self._client().get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code", "") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._client().put_object(Bucket=self.bucket, Key=self._key(rel), Body=data)

    def delete_tree(self, rel: str) -> None:
        client = self._client()
        prefix = self._key(rel)
        keys = [prefix] if self.exists(rel) else []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/"):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def list_dirs(self, rel: str) -> list[str]:
        prefix = self._key(rel).rstrip("/") + "/"
        names = set()
        for page in (
            self._client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/")
        ):
            names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted(names)


# --- MDS shards --------------------------------------------------------------------------------


def _hashes(data: bytes) -> dict[str, str]:
    import xxhash

    return {"sha1": hashlib.sha1(data).hexdigest(), "xxh64": xxhash.xxh64(data).hexdigest()}


class ShardWriter:
    """Writes rows of token ids as MDS shards into `folder` of a store.

    Samples all have the same byte size, so a shard is built with numpy in one go and its
    sample count is fixed by the size limit up front.
    """

    def __init__(self, store: Store, folder: str, *, seq_len: int, dtype: str, size_limit: int) -> None:
        self.store, self.folder, self.dtype = store, folder, np.dtype(dtype)
        self.config = {
            "column_encodings": [f"ndarray:{dtype}"],
            "column_names": [COLUMN],
            "column_sizes": [None],
            "compression": "zstd",
            "format": "mds",
            "hashes": HASHES,
            "size_limit": size_limit,
            "version": 2,
        }
        self._config_bytes = json.dumps(self.config, sort_keys=True).encode()
        self._sample_prefix = _sample_prefix(seq_len, self.dtype)
        sample_bytes = len(self._sample_prefix) + seq_len * self.dtype.itemsize
        # streaming counts 4 bytes per sample (its offset) and 8 + config per shard.
        fixed = 8 + len(self._config_bytes)
        self.rows_per_shard = max(1, (size_limit - fixed) // (sample_bytes + 4))
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self.shards: list[dict] = []
        self.samples = 0

    def write(self, rows: np.ndarray) -> None:
        if len(rows) and int(rows.max()) > np.iinfo(self.dtype).max:
            raise ConvertError(
                f"token id {int(rows.max())} does not fit in {self.dtype.name}; use --dtype auto"
            )
        self._pending.append(rows.astype(self.dtype))
        self._pending_rows += len(rows)
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
        n = len(rows)
        body = np.hstack([np.tile(self._sample_prefix, (n, 1)), rows.view(np.uint8).reshape(n, -1)])
        start = 4 + 4 * (n + 1) + len(self._config_bytes)
        offsets = (start + np.arange(n + 1, dtype=np.int64) * body.shape[1]).astype("<u4")
        return np.uint32(n).tobytes() + offsets.tobytes() + self._config_bytes + body.tobytes()

    def _store_shard(self, raw: bytes, samples: int) -> None:
        import zstd

        name = f"shard.{len(self.shards):05d}.mds"
        compressed = zstd.compress(raw, ZSTD_LEVEL)
        self.store.write_bytes(f"{self.folder}/{name}.zstd", compressed)
        entry = {
            "samples": samples,
            "raw_data": {"basename": name, "bytes": len(raw), "hashes": _hashes(raw)},
            "zip_data": {"basename": f"{name}.zstd", "bytes": len(compressed), "hashes": _hashes(compressed)},
            **self.config,
        }
        self.shards.append(entry)
        self.samples += samples


def _sample_prefix(seq_len: int, dtype: np.dtype) -> np.ndarray:
    """The bytes before the ids: datum size, then the shape header of a 1-D array of seq_len."""
    shape_dtype = "uint8" if seq_len < 1 << 8 else "uint16" if seq_len < 1 << 16 else "uint32"
    shape = np.array([seq_len], dtype=shape_dtype).tobytes()
    datum_size = 1 + len(shape) + seq_len * dtype.itemsize
    header = np.uint32(datum_size).tobytes() + bytes([(1 << 2) | _SHAPE_DTYPE_CODES[shape_dtype]]) + shape
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


# --- reading back (tests, benchmark, inspection) -----------------------------------------------


def read_split(store: Store, split: str) -> np.ndarray:
    """All samples of a finished split, in index order, as an (n, seq_len) array."""
    import zstd

    index = store.read_json(f"{split}/index.json")
    if index is None:
        raise ConvertError(f"{store.url(split)} has no index.json: the split is missing or incomplete")
    rows = []
    for shard in index["shards"]:
        raw = zstd.decompress(store.read_bytes(f"{split}/{shard['zip_data']['basename']}"))
        dtype = np.dtype(shard["column_encodings"][0].split(":")[1])
        rows.append(_decode_shard(raw, dtype))
    return np.concatenate(rows) if rows else np.empty((0, 0), dtype=np.uint16)


def _decode_shard(raw: bytes, dtype: np.dtype) -> np.ndarray:
    n = int(np.frombuffer(raw, "<u4", count=1)[0])
    offsets = np.frombuffer(raw, "<u4", count=n + 1, offset=4)
    out = []
    for begin, end in zip(offsets[:-1], offsets[1:], strict=True):
        sample = raw[begin + 4 : end]  # skip the datum size
        ndim_code = sample[0]
        shape_dtype = {0: np.uint8, 1: np.uint16, 2: np.uint32}[ndim_code & 3]
        header = 1 + (ndim_code >> 2) * np.dtype(shape_dtype).itemsize
        out.append(np.frombuffer(sample[header:], dtype=dtype))
    return np.stack(out)
