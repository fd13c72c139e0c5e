"""Weights from a run's checkpoint folder, picked and checked exactly as resume picks and checks them.

Given the folder, its newest checkpoint whose manifest verifies (`llm.checkpoint.resume`), so a
corrupt newest save gives way to the previous good one; `latest.json` alone is not trusted. Given
a checkpoint file inside such a folder, it must be one the manifests record, and is checked
against them (size, and SHA-256 up to `LLM_CKPT_VERIFY_MAX_BYTES`) as resume checks it.
"""

from __future__ import annotations

from pathlib import Path

from llm.checkpoint import manifest
from llm.checkpoint.resume import newest_usable_checkpoint, verify_limit
from llm.errors import ConfigError
from llm.weights.safe_load import TRUST_HINT
from storage import is_remote, open_store


def is_run_folder(path: str) -> bool:
    """Whether `path` is a run's checkpoint folder (it holds manifests or a latest pointer)."""
    if is_remote(path):
        return bool(open_store(path).list(manifest.MANIFEST_DIR))
    folder = Path(path)
    return folder.is_dir() and (
        (folder / manifest.MANIFEST_DIR).is_dir() or (folder / manifest.LATEST).is_file()
    )


def newest_verified_checkpoint(folder: str) -> str:
    """The checkpoint resume would pick in a run's folder (StorageError if every one is corrupt)."""
    point = newest_usable_checkpoint(folder, needs=("model",))  # weights only: no optimizer needed
    if point is None:
        raise ConfigError(
            f"{folder} holds no complete checkpoint (no complete manifests; latest.json alone is not "
            f"trusted): pass a checkpoint file instead"
        )
    if is_remote(point.load_path):  # a sharded checkpoint: resume reads its shards in place
        raise ConfigError(
            f"the newest checkpoint in {folder} is sharded ({point.load_path}): download that folder "
            f"and pass the local copy"
        )
    return point.load_path


def check_against_run_folder(path: str, local: Path) -> None:
    """ConfigError unless `path`, if it lies in a run's checkpoint folder, is a checkpoint its
    manifests record, complete and matching their sizes and SHA-256 (as resume checks it);
    `local` is its local copy (itself, for a local path)."""
    if is_remote(path):
        parent, _, name = path.rstrip("/").rpartition("/")
    else:
        parent, name = str(Path(path).parent), Path(path).name
    if not is_run_folder(parent):
        return
    ckpts, listing = manifest.scan(open_store(parent))
    ckpt = next((c for c in ckpts if c.load_path == name), None)
    if ckpt is None:
        raise ConfigError(
            f"{path} is not a checkpoint that the manifests of its run folder record (an interrupted "
            f"save, or a file put there by hand): pass the folder {parent} for its newest verified "
            f"checkpoint, or {TRUST_HINT}"
        )
    problem = manifest.size_problem(ckpt, listing)
    if problem is None and sum(f.size for f in ckpt.files.values()) <= verify_limit():
        problem = manifest.hash_problem(ckpt.files, local.parent)  # the files lie beside `local`
    if problem:
        raise ConfigError(
            f"{path} does not match its manifest in {parent}: {problem}; pass the folder {parent} to "
            f"use its newest checkpoint that verifies"
        )
