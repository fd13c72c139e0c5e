"""Checkpointing and autoresume for the Trainer: one call, `checkpoint_kwargs`, before it is built.

Composer's own autoresume is not used: it trusts a local copy under `./s3:/...` over a newer
remote checkpoint, can point at a checkpoint whose upload never finished, and crashes on a
corrupt one. Instead, before the Trainer exists, every rank reads the checkpoint folder itself
(the manifests written by `CheckpointPublisher`), picks the newest complete checkpoint that
verifies, and hands Composer an explicit `load_path`. See docs/resume.md.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm import checkpoint_manifest as cm
from llm.checkpoint_store import CheckpointStoreError, open_store
from llm.config import TrainConfig
from llm.errors import ConfigError

log = logging.getLogger(__name__)

# Files up to this many bytes in total are SHA-256 checked before loading (env overrides it).
DEFAULT_VERIFY_MAX_BYTES = 8 << 30
CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"


class RunAlreadyComplete(SystemExit):
    """The newest checkpoint already reached max_duration: the same command exits 0, training nothing."""

    def __init__(self, message: str):
        print(f"[resume] {message}", file=sys.stderr, flush=True)
        super().__init__(0)


@dataclass
class ResumePoint:
    """Where training starts: a checkpoint to load (or None for a fresh start) and why."""

    load_path: str | None
    weights_only: bool = False
    batch: int | None = None
    checkpoint: cm.Checkpoint | None = None
    source: str = "fresh"  # fresh | autoresume | load_path


def checkpoint_kwargs(cfg: TrainConfig, *, rank: int, world_size: int) -> tuple[dict[str, Any], list]:
    """Trainer kwargs and callbacks for saving, preemption and resuming; call before building it.

    Pre-flight work, on every rank, before the Trainer exists:
    - checks `checkpoint.num_to_keep` and the load-path safety rule (ConfigError: a `load_path`
      outside `save_folder` needs `checkpoint.allow_untrusted_load_path: true`, because Composer
      0.32.1 unpickles checkpoints);
    - deletes the stale `./s3:/<bucket>/...` copy Composer's autoresume leaves in the working
      directory, so it can never shadow a newer remote checkpoint;
    - with autoresume (on when `run_name` and `save_folder` are set), scans `save_folder` for the
      newest complete checkpoint, verifies its sizes and SHA-256 (downloading a monolithic S3
      checkpoint into a fresh temp folder), falls back to the previous one if it is corrupt, and
      logs "resuming from ..." or "starting a new run"; else uses `checkpoint.load_path`;
    - warns about every recipe value that differs from the checkpoint's recipe (docs/resume.md).

    Returns:
      kwargs: `save_folder=None` (saving is done by the returned saver), `autoresume=False`,
        `save_overwrite`, `load_path`, `load_weights_only`; they override the builder's own.
      callbacks: `[CheckpointSaver, CheckpointPublisher, PreemptionCallback]` (the saver only when
        `save_folder` is set); append them AFTER all other callbacks, in this order: the
        publisher must follow the saver, and the preemption callback exits the process at
        `fit_end` with 143 (SIGTERM) or 130 (SIGINT) once the checkpoint is stored.
    """
    from llm.callbacks.preemption import PreemptionCallback

    ck = cfg.checkpoint
    if ck.num_to_keep == 0 or ck.num_to_keep < -1:
        raise ConfigError(
            f"checkpoint.num_to_keep={ck.num_to_keep}: keep at least 1 checkpoint, or -1 for all"
        )
    check_load_path_allowed(cfg)
    if ck.save_folder:
        remove_stale_composer_copy(ck.save_folder)
    point = choose_resume_point(cfg, rank=rank)
    if rank == 0:
        _announce(cfg, point, world_size)
    _stop_if_complete(cfg, point)
    if point.checkpoint is not None and point.checkpoint.recipe and rank == 0:
        warn_recipe_changes(point.checkpoint.recipe, cfg.to_dict(redact=True))

    kwargs: dict[str, Any] = {
        "save_folder": None,
        "autoresume": False,
        "save_overwrite": True,
        "load_path": point.load_path,
        "load_weights_only": point.weights_only,
    }
    callbacks: list = []
    if ck.save_folder:
        callbacks += _saving_callbacks(cfg, rank)
    callbacks.append(PreemptionCallback())
    return kwargs, callbacks


def _saving_callbacks(cfg: TrainConfig, rank: int) -> list:
    from composer.callbacks import CheckpointSaver

    from llm.callbacks.checkpoint_publish import CheckpointPublisher

    ck = cfg.checkpoint
    store = open_store(ck.save_folder)
    # Remote: Composer writes into a private staging folder that the publisher uploads and empties.
    staging = tempfile.mkdtemp(prefix=f"llm-ckpt-rank{rank}-") if store.is_remote else ck.save_folder
    saver = CheckpointSaver(
        folder=staging,
        filename=CHECKPOINT_FILENAME,
        remote_file_name=None,
        latest_filename=None,
        latest_remote_file_name=None,
        save_interval=ck.save_interval,
        overwrite=True,
        num_checkpoints_to_keep=-1,  # the publisher keeps num_to_keep across runs, not per process
    )
    publisher = CheckpointPublisher(store, staging, ck.num_to_keep, recipe=cfg.to_dict(redact=True))
    return [saver, publisher]


# --- where to start -----------------------------------------------------------------------------


def choose_resume_point(cfg: TrainConfig, *, rank: int = 0) -> ResumePoint:
    """The checkpoint this run starts from; see `checkpoint_kwargs` for the rules."""
    ck = cfg.checkpoint
    if ck.autoresume and ck.save_folder and cfg.run_name:
        found = newest_usable_checkpoint(ck.save_folder, rank=rank)
        if found is not None:
            return found
    if ck.load_path:
        return ResumePoint(load_path=ck.load_path, weights_only=ck.load_weights_only, source="load_path")
    return ResumePoint(load_path=None)


def newest_usable_checkpoint(save_folder: str, *, rank: int = 0) -> ResumePoint | None:
    """The newest complete checkpoint in `save_folder` that verifies; None if there is none.

    A checkpoint that is incomplete, truncated or corrupt is reported and skipped. If checkpoints
    exist but none is usable, CheckpointStoreError: starting over silently would throw away the
    run.
    """
    store = open_store(save_folder)
    ckpts, listing = cm.scan(store)
    rejected = []
    for ckpt in ckpts:
        problem = cm.size_problem(ckpt, listing)
        load_path = None
        if problem is None:
            load_path, problem = _verified_load_path(store, ckpt, rank)
        if problem is None:
            return ResumePoint(load_path=load_path, batch=ckpt.batch, checkpoint=ckpt, source="autoresume")
        rejected.append(ckpt.batch)
        if ckpt.complete or ckpt is not ckpts[0]:
            log.warning(
                "checkpoint at batch %d in %s is unusable (%s); trying an older one",
                ckpt.batch,
                store.uri,
                problem,
            )
        else:  # the newest save was interrupted: expected after a SIGKILL, not worth a warning
            log.info("ignoring the interrupted save at batch %d in %s (%s)", ckpt.batch, store.uri, problem)
    if any(c.complete for c in ckpts):
        raise CheckpointStoreError(
            f"no usable checkpoint in {store.uri}: every complete one failed verification "
            f"(batches {rejected}); restore one, or point checkpoint.save_folder elsewhere to start fresh"
        )
    return None


def _verified_load_path(store, ckpt: cm.Checkpoint, rank: int) -> tuple[str | None, str | None]:
    """(path to give Composer, None) or (None, why the checkpoint cannot be used)."""
    limit = int(os.environ.get("LLM_CKPT_VERIFY_MAX_BYTES", DEFAULT_VERIFY_MAX_BYTES))
    small = sum(f["size"] for f in ckpt.files.values()) <= limit
    if not store.is_remote:
        problem = cm.hash_problem(ckpt.files, store.root) if small else None
        return (None, problem) if problem else (store.uri_of(ckpt.load_path), None)
    if ckpt.sharded:
        # Each rank reads only its shards straight from S3; sizes were checked against the listing.
        return store.uri_of(ckpt.load_path), None
    local_root = Path(tempfile.mkdtemp(prefix=f"llm-resume-rank{rank}-"))
    for rel in ckpt.files:
        (local_root / rel).parent.mkdir(parents=True, exist_ok=True)
        store.download(rel, local_root / rel)
    problem = cm.hash_problem(ckpt.files, local_root)
    if problem:
        shutil.rmtree(local_root, ignore_errors=True)
        return None, problem
    return str(local_root / ckpt.load_path), None


def remove_stale_composer_copy(save_folder: str) -> None:
    """Delete `./s3:/bucket/prefix`, the local copy Composer's autoresume downloads and later trusts."""
    if not save_folder.startswith("s3://"):
        return
    stale = Path(os.path.abspath(save_folder))  # how Composer names it: "s3://b/p" -> ./s3:/b/p
    if stale.is_dir():
        log.warning("removing the stale local checkpoint copy %s (the bucket is the source of truth)", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _stop_if_complete(cfg: TrainConfig, point: ResumePoint) -> None:
    """RunAlreadyComplete if the checkpoint resumed from is at or past the recipe's max_duration.

    Composer would raise "no training would occur"; a scheduler that restarts a finished job should
    see success instead.
    """
    if point.source != "autoresume":
        return
    reached = point.checkpoint.head.get("timestamp", {})
    match = re.fullmatch(r"(\d+)(ba|tok|ep)", cfg.training.max_duration.strip())
    key = {"ba": "batch", "tok": "token", "ep": "epoch"}[match.group(2)] if match else None
    if key and reached.get(key, -1) >= int(match.group(1)):
        raise RunAlreadyComplete(
            f"run {cfg.run_name!r} already finished: its checkpoint at batch {point.batch} reached "
            f"training.max_duration={cfg.training.max_duration}; nothing to do (raise max_duration to train on)"
        )


# --- safety -------------------------------------------------------------------------------------


def check_load_path_allowed(cfg: TrainConfig) -> None:
    """ConfigError if `load_path` lies outside `save_folder` and the recipe does not allow that."""
    ck = cfg.checkpoint
    if not ck.load_path or ck.allow_untrusted_load_path:
        return
    if ck.save_folder and _is_inside(ck.load_path, ck.save_folder):
        return
    raise ConfigError(
        f"checkpoint.load_path={ck.load_path!r} is outside checkpoint.save_folder={ck.save_folder!r}. "
        "Checkpoints are pickles that can run code when loaded (Composer 0.32.1 uses torch.load with "
        "weights_only=False); if you trust this file, set checkpoint.allow_untrusted_load_path=true"
    )


def _is_inside(path: str, folder: str) -> bool:
    if folder.startswith("s3://") or path.startswith("s3://"):
        norm = [p.rstrip("/") + "/" for p in (path, folder)]
        return norm[0].startswith(norm[1]) and "/../" not in norm[0]
    if "://" in path:
        return False
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


# --- reporting ----------------------------------------------------------------------------------


def _announce(cfg: TrainConfig, point: ResumePoint, world_size: int) -> None:
    if point.source == "autoresume":
        ckpt = point.checkpoint
        saved_ws = ckpt.head.get("world_size")
        change = f"; world size {saved_ws} -> {world_size}" if saved_ws not in (None, world_size) else ""
        msg = f"resuming run {cfg.run_name!r} from the checkpoint at batch {ckpt.batch}: {point.load_path}{change}"
    elif point.source == "load_path":
        what = "weights only" if point.weights_only else "full training state"
        msg = f"starting run {cfg.run_name!r} from checkpoint.load_path={point.load_path} ({what})"
    elif cfg.checkpoint.save_folder:
        msg = f"starting run {cfg.run_name!r} from scratch: no checkpoint in {cfg.checkpoint.save_folder}"
    else:
        msg = f"starting run {cfg.run_name!r} from scratch: checkpoint.save_folder is not set, nothing will be saved"
    # Printed, not only logged: whether a run resumed is the first thing an operator looks for.
    print(f"[resume] {msg}", file=sys.stderr, flush=True)
    log.info(msg)


# What a resumed run takes from where; see docs/resume.md. Keys not listed come from the recipe.
FROM_CHECKPOINT = {
    "optimizer.": "the optimizer state in the checkpoint (lr, betas, eps, weight_decay) is used; the new value is ignored",
    "seed": "the RNG state in the checkpoint is used; the new seed has no effect",
    "model.": "the model shape must match the checkpoint; loading will fail if it does not",
}
NOT_COMPARED = ("checkpoint.", "run_dir", "loggers.", "data.cache_root")


def warn_recipe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Warn once per recipe value that differs from the checkpoint's; return the messages."""
    old, new = _flatten(saved), _flatten(current)
    messages = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(NOT_COMPARED) or old.get(key) == new.get(key):
            continue
        rule = next((v for k, v in FROM_CHECKPOINT.items() if key == k or key.startswith(k)), None)
        effect = rule or "the recipe's new value applies from the resume point on"
        messages.append(
            f"recipe changed since the checkpoint: {key}: {old.get(key)!r} -> {new.get(key)!r}; {effect}"
        )
    for msg in messages:
        log.warning(msg)
        print(f"[resume] WARNING {msg}", file=sys.stderr, flush=True)
    return messages


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, tuple):
        value = list(value)
    return {prefix.rstrip("."): value}
