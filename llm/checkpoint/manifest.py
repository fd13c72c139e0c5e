"""Completion records for checkpoints: what makes a checkpoint "complete" and how it is checked.

Composer writes checkpoint files; nothing in them says whether a save finished. After each rank
has stored its files, it writes a manifest next to them:

    <save_folder>/manifests/ba0000000012-rank00000.json
        {"batch": 12, "rank": 0, "writers": 2, "world_size": 2, "sharded": true,
         "load_path": "ep0-ba12", "files": {"ep0-ba12/__0_0.distcp": {"size": ..., "sha256": ...}},
         "timestamp": {...}, "recipe": {...}}

A checkpoint is complete when all of its `writers` manifests exist (one for a monolithic
checkpoint, one per writing rank for a sharded one: every rank, or the first replica group's
ranks with HSDP) and every file they list is present with the
recorded size (and, where it is checked, the recorded SHA-256). `latest.json` is written only
after that, so it never points at a half-stored checkpoint; resume does not even need it: it scans
the manifests and takes the newest complete checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage import Store

log = logging.getLogger(__name__)

MANIFEST_DIR = "manifests"
LATEST = "latest.json"
_MANIFEST_RE = re.compile(r"^manifests/ba(\d+)-rank(\d+)\.json$")
# what Composer's saver writes with CHECKPOINT_FILENAME: ep0-ba12-rank0.pt, or ep0-ba12/ when sharded
_CHECKPOINT_FILE_RE = re.compile(r"^ep\d+-ba(\d+)(?:-rank\d+\.pt$|/)")


def manifest_name(batch: int, rank: int) -> str:
    return f"{MANIFEST_DIR}/ba{batch:010d}-rank{rank:05d}.json"


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """Size and SHA-256 of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return {"size": os.path.getsize(path), "sha256": sha.hexdigest()}


@dataclass
class Checkpoint:
    """One save, as its manifests describe it."""

    batch: int
    manifests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def head(self) -> dict[str, Any]:
        return min(self.manifests, key=lambda m: m["rank"])

    @property
    def writers(self) -> int:
        return self.head["writers"]

    @property
    def sharded(self) -> bool:
        return self.head["sharded"]

    @property
    def load_path(self) -> str:
        return self.head["load_path"]

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for m in self.manifests:
            out.update(m["files"])
        return out

    @property
    def complete(self) -> bool:
        return {m["rank"] for m in self.manifests} >= set(range(self.writers))

    @property
    def recipe(self) -> dict[str, Any] | None:
        return self.head.get("recipe")


def scan(store: Store) -> tuple[list[Checkpoint], dict[str, int]]:
    """All checkpoints with at least one valid manifest, newest first, and the store's listing.

    A manifest that cannot be read or does not have the expected fields is reported by name and
    skipped: its checkpoint is then incomplete, and resume falls back to an older one.
    """
    listing = store.list()
    by_batch: dict[int, Checkpoint] = {}
    for rel in listing:
        match = _MANIFEST_RE.match(rel)
        if not match:
            continue
        batch, rank = int(match.group(1)), int(match.group(2))
        manifest = store.read_json(rel)
        problem = schema_problem(manifest, batch, rank)
        if problem:
            _warn_once(f"ignoring the manifest {store.url(rel)}: {problem}")
            continue
        by_batch.setdefault(batch, Checkpoint(batch)).manifests.append(manifest)
    return sorted(by_batch.values(), key=lambda c: -c.batch), listing


_WARNED: set[str] = set()  # a bad manifest is met by every scan (each save scans twice): said once


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


# field -> accepted types; every manifest the publisher writes has them
_SCHEMA: dict[str, tuple[type, ...]] = {
    "batch": (int,),
    "rank": (int,),
    "writers": (int,),
    "world_size": (int,),
    "sharded": (bool,),
    "load_path": (str,),
    "files": (dict,),
    "timestamp": (dict,),
}


def unclaimed_files(listing: dict[str, int], after_batch: int | None = None) -> list[str]:
    """Checkpoint files of saves that no manifest claims: what an interrupted save left behind.

    Only batches after `after_batch` count (default: after the newest batch that has any manifest,
    valid or not; none at all when no batch has one, so a folder this project did not write is
    never touched). A batch with any manifest file, even an incomplete or unreadable one, is left
    to retention.
    """
    claimed = {int(m.group(1)) for rel in listing if (m := _MANIFEST_RE.match(rel))}
    if after_batch is None:
        if not claimed:
            return []
        after_batch = max(claimed)
    found = []
    for rel in listing:
        match = _CHECKPOINT_FILE_RE.match(rel)
        if match and int(match.group(1)) > after_batch and int(match.group(1)) not in claimed:
            found.append(rel)
    return sorted(found)


def schema_problem(manifest: Any, batch: int, rank: int) -> str | None:
    """Why `manifest` is not a valid manifest for (batch, rank), or None."""
    if not isinstance(manifest, dict):
        return "not a JSON object (unreadable or torn)"
    for key, types in _SCHEMA.items():
        value = manifest.get(key)
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            return f"field {key!r} is missing or not a {types[0].__name__}"
    if (manifest["batch"], manifest["rank"]) != (batch, rank):
        return f"it describes batch {manifest['batch']} rank {manifest['rank']}, not its file name's"
    if manifest["writers"] < 1:
        return "field 'writers' must be at least 1"
    for rel, info in manifest["files"].items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("size"), int)
            and isinstance(info.get("sha256"), str)
        ):
            return f"file entry {rel!r} lacks a size and sha256"
    return None


def size_problem(ckpt: Checkpoint, listing: dict[str, int]) -> str | None:
    """Why the listed files do not match the manifests (missing or wrong size), or None."""
    if not ckpt.complete:
        have = sorted(m["rank"] for m in ckpt.manifests)
        return f"incomplete: manifests from ranks {have} of {ckpt.writers} writers"
    for rel, info in sorted(ckpt.files.items()):
        if rel not in listing:
            return f"file {rel} is missing"
        if listing[rel] != info["size"]:
            return f"file {rel} has {listing[rel]} bytes, the manifest says {info['size']} (truncated?)"
    return None


def hash_problem(files: dict[str, dict[str, Any]], local_root: Path) -> str | None:
    """Why a local copy of `files` under `local_root` differs from the recorded SHA-256, or None."""
    for rel, info in sorted(files.items()):
        digest = file_digest(local_root / rel)
        if digest != {"size": info["size"], "sha256": info["sha256"]}:
            return f"file {rel} does not match its recorded SHA-256 (corrupt)"
    return None


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True, default=str)
