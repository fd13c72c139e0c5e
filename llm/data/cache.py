"""Where a stream's shards are read from, and the cache of remote shards.

`stream_local` names the folder streaming reads each stream from (a split folder read in place, or
a cache folder per run, split, stream and index.json of a remote), `drop_stale_caches` removes a
remote's cache folders made for an earlier index.json, and `cache_limit` sizes a dataset's cache
(`data.cache_limit`), refusing one too small to hold the 4 shards streaming needs at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from llm.config import SPLITS, StreamConfig, TrainConfig, parse_bytes
from llm.errors import ConfigError
from shards.index import read_index
from storage import is_remote

log = logging.getLogger(__name__)


def check_cache_root(cache_root: str) -> None:
    """ConfigError unless remote shards can be cached under `cache_root`."""
    try:
        Path(cache_root).mkdir(parents=True, exist_ok=True)
        probe = Path(cache_root) / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"data.cache_root={cache_root} is not a writable folder ({err.strerror or err}); set "
            "data.cache_root or LLM_CACHE_ROOT to a folder on a local disk with room for the cache"
        ) from None


def stream_local(
    cfg: TrainConfig, split: str, index: int, stream: StreamConfig, index_digest: str = ""
) -> str:
    """The folder streaming reads a stream from.

    - `local` given in the recipe: that folder.
    - a local split folder: the folder itself, read in place (nothing copied; compressed shards
      are decompressed beside themselves once, on first read, and kept for later runs).
    - a remote split: a cache folder unique per run, split, stream position, remote and the
      content of the remote's index.json (`index_digest`), so that two live datasets never share
      one (streaming refuses that) and re-converted or repaired data is never served from an old
      cache: a changed index.json gets a new folder, and the old one is removed.
    """
    if stream.local:
        return stream.local
    if not is_remote(stream.remote):
        return str(Path(stream.remote).resolve())
    digest = hashlib.sha256(stream.remote.encode()).hexdigest()[:10]
    name = f"{index}-{digest}-{index_digest}" if index_digest else f"{index}-{digest}"
    return str(Path(cfg.data.cache_root) / str(cfg.run_name) / split / name)


def index_digest(index: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()[:10]


def largest_shard_bytes(index: dict[str, Any]) -> int:
    """Cache space one shard takes while it is decompressed: raw plus compressed bytes."""
    return max(s["raw_data"]["bytes"] + (s.get("zip_data") or {}).get("bytes", 0) for s in index["shards"])


def drop_stale_caches(local: str) -> None:
    """Remove this stream's cache folders made for an earlier index.json of the same remote."""
    folder = Path(local)
    stem = folder.name.rsplit("-", 1)[0] + "-"
    if not folder.parent.is_dir():
        return
    for old in folder.parent.iterdir():
        if old.name.startswith(stem) and old.name != folder.name and old.is_dir():
            log.info("removing the stream cache %s: its remote's index.json has changed", old)
            shutil.rmtree(old, ignore_errors=True)


def all_stream_locals(cfg: TrainConfig) -> list[str]:
    """Every folder this run's datasets will register."""
    return [
        stream_local(cfg, split, i, s, index_digest(read_index(s.remote)) if is_remote(s.remote) else "")
        for split in SPLITS
        for i, s in enumerate(cfg.data.streams(split))
    ]


def cache_limit(cfg: TrainConfig, split: str, largest: int, cached: list[str], n_streams: int) -> int | None:
    """The byte limit of a dataset's cache, or None; ConfigError when it cannot hold 4 shards.

    Only datasets whose streams are all copied into a cache get one: streaming evicts by deleting
    a shard's files, which for a split read in place would be the data itself.
    """
    wanted = cfg.data.cache_limit
    if wanted is None or not cached:
        return None
    if len(cached) < n_streams:
        if wanted == "auto":
            return None  # local streams read in place: no eviction (it would delete their files)
        raise ConfigError(
            f"data.cache_limit={wanted}: data.{split} mixes local and remote streams, and a limited "
            "cache would evict (delete) the local ones' files; give each local stream a `local:` "
            "cache folder, or set data.cache_limit=null"
        )
    largest = largest or max(largest_shard_bytes(read_index(s.remote)) for s in cfg.data.streams(split))
    if wanted == "auto":
        root = _existing_parent(Path(cfg.data.cache_root))
        usage = sum(_folder_bytes(Path(local)) for local in cached)
        datasets = 1 + len(cfg.data.eval)  # train and each eval stream's dataset share the disk
        limit = int(0.8 * (shutil.disk_usage(root).free + usage) / datasets)
        where = f"data.cache_root={cfg.data.cache_root} (80% of its disk's free space: {limit:,} bytes)"
    else:
        limit = parse_bytes(wanted, "data.cache_limit")
        where = f"data.cache_limit={wanted}"
    if limit < 4 * largest:
        raise ConfigError(
            f"{where} cannot hold the 4 shards streaming needs at once: the largest takes {largest:,} "
            f"bytes decompressed plus compressed; raise data.cache_limit to at least {4 * largest:,} "
            "bytes or point data.cache_root (LLM_CACHE_ROOT) at a disk with room"
        )
    return limit


def _existing_parent(path: Path) -> Path:
    return next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
