"""A split's `index.json` on the reading side: it exists, it is an MDS index, its shards are stored
and carry the hash a reader will check. Checked at start, not when training reaches a shard.

The converters write it last (shards/writer.py `index_json`), so its presence marks a split complete.
"""

from __future__ import annotations

import json
from typing import Any

from shards.errors import ShardsError
from storage import StorageError, join, open_store, read_url

INDEX_FILE = "index.json"


def read_index(split_folder: str) -> dict[str, Any]:
    """A split's parsed index.json (local or s3://); StorageError (missing) if it is absent."""
    return json.loads(read_url(join(split_folder, INDEX_FILE)))


def check_index(split_folder: str, validate_hash: str | None, where: str) -> None:
    """ShardsError unless `index.json` exists, every shard it names is stored, and each carries
    the `validate_hash` (when given) that will be checked on download."""
    try:
        index = read_index(split_folder)
        shards = [s.get("zip_data") or s["raw_data"] for s in index["shards"]]
        names = [str(s["basename"]) for s in shards]
    except StorageError as err:
        if not err.missing:
            raise
        raise ShardsError(
            f"{where}: no index.json, so the conversion into it did not finish; re-run the same "
            "`python -m convert shards` command to complete it"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ShardsError(f"{where}: index.json is not a valid MDS index; re-run the conversion") from None
    if validate_hash and any(validate_hash not in (s.get("hashes") or {}) for s in shards):
        raise ShardsError(
            f"{where}: its shards carry no {validate_hash} hash (written by another tool?); set "
            "data.validate_hash=null to read them unchecked, or convert with `python -m convert shards`"
        )
    stored = open_store(split_folder).list()
    absent = [name for name in names if name not in stored]
    if absent:
        raise ShardsError(
            f"{where}: {len(absent)} of the {len(names)} shard files index.json names are missing "
            f"(e.g. {absent[0]}); restore them or re-convert"
        )
