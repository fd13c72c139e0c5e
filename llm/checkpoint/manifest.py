"""Completion records for checkpoints: what makes a checkpoint "complete" and how it is checked.

Composer writes checkpoint files; nothing in them says whether a save finished. After each rank
has stored its files, it writes a manifest next to them:

    <save_folder>/manifests/ba0000000012-rank00000.json
        {"batch": 12, "rank": 0, "writers": 2, "world_size": 2, "sharded": true,
         "load_path": "ep0-ba12", "files": {"ep0-ba12/__0_0.distcp": {"size": ..., "sha256": ...}},
         "timestamp": {...}, "saved_at": 1700000000.0, "recipe": {...},
         "save_costs": {"stall_s": 0.9, "background_s": 109.2, "step_s": 31.0}}

`Manifest` is that record, field for field (`to_json` / `from_dict`; the recipe and what this run
measured of its saves and steps, `llm.checkpoint.schedule.SaveCosts`, only in rank 0's: a run
resumed from it saves by `auto` at the steady interval from its first step; manifests written
before it have no `save_costs`).

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


@dataclass(frozen=True)
class FileDigest:
    """A stored file as its manifest records it: bytes and SHA-256."""

    size: int
    sha256: str


def file_digest(path: str | os.PathLike) -> FileDigest:
    """Size and SHA-256 of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return FileDigest(size=os.path.getsize(path), sha256=sha.hexdigest())


@dataclass(frozen=True)
class Manifest:
    """One rank's completion record of one save (the JSON in the module docstring)."""

    batch: int
    rank: int
    writers: int  # ranks that write this checkpoint: 1 (monolithic), or each shard-writing rank
    world_size: int
    sharded: bool
    load_path: str  # what Composer loads, relative to save_folder: a `.pt` file or a sharded folder
    timestamp: dict[str, int]  # epoch, batch, sample and token of the save
    files: dict[str, FileDigest] = field(default_factory=dict)  # this rank's files of the save
    saved_at: float | None = None  # time.time() once this rank's files were stored
    recipe: dict[str, Any] | None = None  # the redacted recipe, in rank 0's manifest
    save_costs: dict[str, Any] | None = None  # rank 0's: a save's and a step's seconds as measured

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "batch": self.batch,
            "rank": self.rank,
            "writers": self.writers,
            "world_size": self.world_size,
            "sharded": self.sharded,
            "load_path": self.load_path,
            "timestamp": self.timestamp,
            "files": {rel: {"size": f.size, "sha256": f.sha256} for rel, f in self.files.items()},
        }
        for key in (
            "saved_at",
            "recipe",
            "save_costs",
        ):  # absent rather than null, as manifests always had them
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return dumps(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """The manifest read from JSON (`schema_problem` has accepted it; other keys are ignored)."""
        return cls(
            batch=data["batch"],
            rank=data["rank"],
            writers=data["writers"],
            world_size=data["world_size"],
            sharded=data["sharded"],
            load_path=data["load_path"],
            timestamp=data["timestamp"],
            files={rel: FileDigest(size=f["size"], sha256=f["sha256"]) for rel, f in data["files"].items()},
            saved_at=data.get("saved_at"),
            recipe=data.get("recipe"),
            save_costs=data.get("save_costs") if isinstance(data.get("save_costs"), dict) else None,
        )


@dataclass
class Checkpoint:
    """One save, as its manifests describe it."""

    batch: int
    manifests: list[Manifest] = field(default_factory=list)

    @property
    def head(self) -> Manifest:
        return min(self.manifests, key=lambda m: m.rank)

    @property
    def writers(self) -> int:
        return self.head.writers

    @property
    def sharded(self) -> bool:
        return self.head.sharded

    @property
    def load_path(self) -> str:
        return self.head.load_path

    @property
    def files(self) -> dict[str, FileDigest]:
        out: dict[str, FileDigest] = {}
        for m in self.manifests:
            out.update(m.files)
        return out

    @property
    def complete(self) -> bool:
        return {m.rank for m in self.manifests} >= set(range(self.writers))

    @property
    def recipe(self) -> dict[str, Any] | None:
        return self.head.recipe


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
        by_batch.setdefault(batch, Checkpoint(batch)).manifests.append(Manifest.from_dict(manifest))
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
        have = sorted(m.rank for m in ckpt.manifests)
        return f"incomplete: manifests from ranks {have} of {ckpt.writers} writers"
    for rel, info in sorted(ckpt.files.items()):
        if rel not in listing:
            return f"file {rel} is missing"
        if listing[rel] != info.size:
            return f"file {rel} has {listing[rel]} bytes, the manifest says {info.size} (truncated?)"
    return None


def hash_problem(files: dict[str, FileDigest], local_root: Path) -> str | None:
    """Why a local copy of `files` under `local_root` differs from the recorded SHA-256, or None."""
    for rel, info in sorted(files.items()):
        if file_digest(local_root / rel) != info:
            return f"file {rel} does not match its recorded SHA-256 (corrupt)"
    return None


def dumps(record: dict[str, Any]) -> str:
    """A manifest's or `latest.json`'s text."""
    return json.dumps(record, indent=1, sort_keys=True, default=str)
