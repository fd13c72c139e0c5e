"""Where a run starts: the newest verified checkpoint, an allowed `load_path`, or nothing.

Before the Trainer exists, every rank reads the checkpoint folder itself (the manifests written by
`llm.checkpoint.publisher`), picks the newest complete checkpoint that verifies, and hands
Composer an explicit `load_path`; see docs/resume.md for why Composer's own autoresume is not used.
`llm generate` and `llm export` resolve a run folder through the same `newest_usable_checkpoint`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pickle
import shutil
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm.checkpoint import manifest as cm
from llm.checkpoint import restart
from llm.checkpoint.local_copy import NodeCopy, node_copy
from llm.config import TrainConfig, flatten, parse_duration, schema_default
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer, parameter_name
from storage import StorageError, Store, open_store
from storage.env_numbers import EnvNumberError, env_number
from storage.scratch import make_process_folder, remove_at_exit, remove_dead_process_folders

log = logging.getLogger(__name__)

DOWNLOAD_THREADS = 8  # files of one checkpoint downloaded at once
# Files up to this many bytes in total are SHA-256 checked before loading (env overrides it).
DEFAULT_VERIFY_MAX_BYTES = 8 << 30
CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
RESUME_COPY_PREFIX = "llm-resume-rank"  # + "<rank>-<pid>-<random>": a verified local copy from S3


class RunAlreadyComplete(Exception):
    """The newest checkpoint already reached max_duration: the command says so and exits 0."""


@dataclass
class ResumePoint:
    """Where training starts: a checkpoint to load (or None for a fresh start) and why."""

    load_path: str | None
    weights_only: bool = False
    batch: int | None = None
    checkpoint: cm.Checkpoint | None = None
    source: str = "fresh"  # fresh | autoresume | load_path


# --- where to start -----------------------------------------------------------------------------


def choose_resume_point(cfg: TrainConfig, *, rank: int = 0) -> ResumePoint:
    """The checkpoint this run starts from: autoresume's find first, then `checkpoint.load_path`."""
    ck = cfg.checkpoint
    if ck.autoresume and ck.save_folder and cfg.run_name:
        found = newest_usable_checkpoint(ck.save_folder, rank=rank, model=cfg.model, copy=node_copy(cfg))
        if found is not None:
            return found
    if ck.load_path:
        load_path = run_folder_checkpoint(ck.load_path, rank=rank) or ck.load_path
        return ResumePoint(load_path=load_path, weights_only=ck.load_weights_only, source="load_path")
    return ResumePoint(load_path=None)


def run_folder_checkpoint(path: str, *, rank: int = 0) -> str | None:
    """When `path` is a run's checkpoint folder (it holds manifests), its newest verified checkpoint
    (what resume would pick there; ConfigError if it has none); else None: `path` is a file.
    Lets `checkpoint.load_path` name another run's folder, e.g. the pretraining run an SFT run
    starts from."""
    store = open_store(path)
    if not store.list(cm.MANIFEST_DIR):
        return None
    found = newest_usable_checkpoint(path, rank=rank)
    if found is None:
        raise ConfigError(
            f"checkpoint.load_path={path} is a run folder without a complete checkpoint; point it at a "
            "checkpoint file, or at the folder once its run has saved one"
        )
    return found.load_path


TRAINING_STATE = ("model", "optimizers")  # what a resume needs; reading weights needs only "model"
# Composer stores each optimizer's state under its class's name and silently skips (a warning) an
# optimizer whose name is missing: the one `llm.optim.build_optimizer` builds.
OPTIMIZER = "AdamW"


def newest_usable_checkpoint(
    save_folder: str,
    *,
    rank: int = 0,
    needs: tuple[str, ...] = TRAINING_STATE,
    model: ModelConfig | None = None,
    at_most: int | None = None,
    copy: NodeCopy | None = None,
) -> ResumePoint | None:
    """The newest complete checkpoint in `save_folder` that verifies and holds the `needs` parts
    of the state (a monolithic one's model state: the keys and shapes of `model`, the recipe's,
    when given); None if there is none. `at_most`: only checkpoints at or before that batch (the
    guard's rewind, llm/checkpoint/rollback.py). `copy`: this node's copy of the newest checkpoint
    (`llm.checkpoint.local_copy`; a training run's), loaded when it matches the manifest and
    refilled by the download when it does not; without it a download goes to a folder of this
    process, removed at its exit.

    A checkpoint that is incomplete, truncated or corrupt, or whose model state is not this model
    (re-signed with other contents), is reported and skipped. If checkpoints exist but none is
    usable, StorageError: starting over silently would throw away the run. A checkpoint saved with
    another `model.*` than the recipe's whose state does not fit it: ConfigError (the recipe
    changed, the checkpoint is fine).
    """
    store = open_store(save_folder)
    ckpts, listing = cm.scan(store)
    ckpts = [c for c in ckpts if at_most is None or c.batch <= at_most]
    expected = ModelLayout.of(model) if model is not None else None
    rejected = []
    for ckpt in ckpts:
        problem = cm.size_problem(ckpt, listing)
        load_path = None
        if problem is None:
            load_path, problem = _verified_load_path(store, ckpt, rank, needs, expected, copy)
        if problem is not None and problem.startswith(MODEL_MISMATCH) and model is not None:
            _refuse_changed_model(ckpt, model, problem)
        if problem is None:
            return ResumePoint(load_path=load_path, batch=ckpt.batch, checkpoint=ckpt, source="autoresume")
        rejected.append(ckpt.batch)
        if ckpt.complete or ckpt is not ckpts[0]:
            log.warning(
                "checkpoint at batch %d in %s is unusable (%s); trying an older one",
                ckpt.batch,
                store.root,
                problem,
            )
        else:  # the newest save was interrupted: expected after a SIGKILL, not worth a warning
            log.info("ignoring the interrupted save at batch %d in %s (%s)", ckpt.batch, store.root, problem)
    if any(c.complete for c in ckpts):
        raise StorageError(
            f"no usable checkpoint in {store.root}: every complete one failed verification "
            f"(batches {rejected}); restore one, or point checkpoint.save_folder elsewhere to start fresh"
        )
    return None


def verify_limit() -> int:
    """Checkpoints up to this many bytes in total are SHA-256 checked before they are loaded."""
    try:
        return env_number("LLM_CKPT_VERIFY_MAX_BYTES", DEFAULT_VERIFY_MAX_BYTES, int, zero_ok=True)
    except EnvNumberError as err:
        raise ConfigError(str(err)) from None


def _refuse_changed_model(ckpt: cm.Checkpoint, model: ModelConfig, problem: str) -> None:
    """ConfigError when the checkpoint's recorded recipe has another `model.*` than `model`."""
    saved = (ckpt.head.recipe or {}).get("model")
    current = dataclasses.asdict(model)
    if not isinstance(saved, dict) or saved == current:
        return  # same model recipe: the state itself is wrong, the caller falls back
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    raise ConfigError(
        f"the checkpoint at batch {ckpt.batch} was trained with another model "
        f"({', '.join(f'model.{k}: {saved.get(k)!r} -> {current.get(k)!r}' for k in changed)}) and "
        f"{problem.removeprefix(MODEL_MISMATCH).strip()}; resume with the checkpoint's model settings, "
        "or give this recipe its own checkpoint.save_folder (or load only weights that fit)"
    )


def _verified_load_path(
    store: Store,
    ckpt: cm.Checkpoint,
    rank: int,
    needs: tuple[str, ...],
    expected: ModelLayout | None = None,
    copy: NodeCopy | None = None,
) -> tuple[str | None, str | None]:
    """(path to give Composer, None) or (None, why the checkpoint cannot be used)."""
    small = sum(f.size for f in ckpt.files.values()) <= verify_limit()
    if not store.is_remote:
        problem = cm.hash_problem(ckpt.files, Path(store.root)) if small else None
        if problem is None and not ckpt.sharded:
            problem = state_problem(Path(store.root) / ckpt.load_path, needs, expected)
        return (None, problem) if problem else (store.url(ckpt.load_path), None)
    if ckpt.sharded:
        # Each rank reads only its shards straight from S3; sizes were checked against the listing.
        return store.url(ckpt.load_path), None
    if copy is not None:
        found = _from_node_copy(store, ckpt, needs, expected, copy)
        if found is not None:
            return found
    remove_dead_process_folders(rf"{RESUME_COPY_PREFIX}\d+-")  # copies of killed runs: a checkpoint each
    local_root = make_process_folder(f"{RESUME_COPY_PREFIX}{rank}-")
    # A full copy of the checkpoint: removed when this process exits (normally, on an error or on
    # SIGTERM through Composer's handler), once Composer or `llm generate` has read it.
    remove_at_exit(local_root)
    download_files(store, sorted(ckpt.files), local_root)
    problem = cm.hash_problem(ckpt.files, local_root) or state_problem(
        local_root / ckpt.load_path, needs, expected
    )
    if problem:
        shutil.rmtree(local_root, ignore_errors=True)
        return None, problem
    return str(local_root / ckpt.load_path), None


def _from_node_copy(
    store: Store, ckpt: cm.Checkpoint, needs: tuple[str, ...], expected: ModelLayout | None, copy: NodeCopy
) -> tuple[str | None, str | None] | None:
    """The checkpoint from this node's copy, verified as a download is: SHA-256 and state against
    the manifest; else, on the rank that writes the copy, downloaded into it. None: neither (the
    caller downloads into a folder of this process)."""
    if copy.holds(ckpt):
        problem = cm.hash_problem(ckpt.files, copy.root) or state_problem(copy.path(ckpt), needs, expected)
        if problem is None:
            restart.record_reuse(len(ckpt.files), sum(f.size for f in ckpt.files.values()))
            return str(copy.path(ckpt)), None
        log.info(
            "this node's copy of the checkpoint at batch %d is not it (%s): downloading it",
            ckpt.batch,
            problem,
        )
    if not copy.writer:
        return None
    try:
        download_files(store, sorted(ckpt.files), copy.receive())
    except OSError as err:  # the copy's disk: the download goes to the process's folder instead
        log.warning("could not download into this node's checkpoint copy %s: %s", copy.root, err)
        copy.clear()
        return None
    problem = cm.hash_problem(ckpt.files, copy.root) or state_problem(copy.path(ckpt), needs, expected)
    if problem:
        copy.clear()
        return None, problem
    return str(copy.path(ckpt)), None


class _Opaque:
    """Whatever a checkpoint's pickle names, built as nothing: only the shape of the dicts matters."""

    def __init__(self, *args, **kwargs):
        self.items: dict = {}

    def __setstate__(self, state) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        self.items[key] = value

    def append(self, value) -> None:
        pass

    def extend(self, values) -> None:
        pass


@dataclass(frozen=True)
class _TensorShape:
    """A tensor of the pickle, as its shape: its bytes are never read."""

    shape: tuple[int, ...]


def _rebuild_tensor(storage, offset, size, *rest, **kwargs) -> _TensorShape:
    return _TensorShape(tuple(int(n) for n in size))


def _rebuild_parameter(data, *rest, **kwargs):
    return data


# How torch's pickles name the functions that rebuild a tensor or a parameter.
_REBUILDS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
# torch.save's format before the zip one (`_use_new_zipfile_serialization=False`): four pickles,
# the first of them this number.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _ShapeReader(pickle.Unpickler):
    """Reads a checkpoint's pickle without running it: every class and function it names becomes
    `_Opaque` (dicts stay dicts), every tensor its shape (`_TensorShape`)."""

    def find_class(self, module: str, name: str):
        return _REBUILDS.get((module, name), _Opaque)

    def persistent_load(self, pid):
        return "storage"


class _NotTorch(Exception):
    """The file is neither of torch.save's formats."""


def _read_pickle(path: Path) -> Any:
    """The object a torch.save file holds, read with `_ShapeReader` (zip or the legacy format)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                raise _NotTorch
            with archive.open(name) as f:
                return _ShapeReader(f).load()
    with open(path, "rb") as f:
        if _ShapeReader(f).load() != _LEGACY_MAGIC:
            raise _NotTorch
        _ShapeReader(f).load()  # the format's protocol version
        _ShapeReader(f).load()  # the writer's system (endianness, type sizes)
        return _ShapeReader(f).load()


Shapes = dict[str, tuple[int, ...]]
MODEL_MISMATCH = "its model state does not fit"  # the problem `state_problem` names a wrong model with


@dataclass(frozen=True)
class ModelLayout:
    """What a checkpoint of the recipe's model holds: every key of its state dict and its shape, and
    its parameters (what the optimizer state names: a tied output weight is no parameter of its own)."""

    state: Shapes
    params: Shapes

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelLayout:
        import torch

        with torch.device("meta"):  # nothing allocated
            net = Transformer(cfg)
        return cls(
            state={name: tuple(t.shape) for name, t in net.state_dict().items()},
            params={name: tuple(p.shape) for name, p in net.named_parameters()},
        )


def state_problem(
    path: Path, needs: tuple[str, ...] = TRAINING_STATE, expected: ModelLayout | None = None
) -> str | None:
    """Why a monolithic Composer checkpoint cannot be used although its bytes verify; else None:

    - it is not a torch.save file, or holds no state for one of `needs` (a resume without model or
      optimizer state would silently start from step 1; `llm generate` needs only the model);
    - its model state holds none of our parameters, or (with `expected`, the recipe's model) other
      keys or shapes than the model: Composer loads model weights non-strictly, so a re-signed
      checkpoint with unrelated keys would train on from fresh weights while saying it resumed;
    - its optimizer state is not AdamW's state of our parameters (`_optimizer_problem`): Composer
      skips an optimizer state stored under another name, so a re-signed `{"junk": ...}` would
      resume with fresh moments.

    Only the pickle is read (never the tensors' bytes, and nothing in it is run)."""
    try:
        saved = _read_pickle(path)
    except (_NotTorch, pickle.UnpicklingError, EOFError):
        return "it is not a torch checkpoint file"
    except Exception as err:  # a pickle we cannot even walk: Composer could not load it either
        return f"its state cannot be read ({type(err).__name__})"
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        return "it holds no training state"
    missing = [key for key in needs if not state.get(key)]
    if missing:
        return f"it holds no {' and no '.join(missing)} state"
    wrong = [
        f"its {key} state is a {type(state[key]).__name__}"
        for key in needs
        if not isinstance(state[key], dict)
    ]
    if wrong:
        return f"{' and '.join(wrong)}, not a state dict"
    problem = (
        _model_problem(state["model"], expected.state if expected else None) if "model" in needs else None
    )
    if problem is None and "optimizers" in needs:
        problem = _optimizer_problem(state["optimizers"], expected.params if expected else None)
    return problem


def _optimizer_problem(optimizers: dict, expected: Shapes | None) -> str | None:
    """Why a checkpoint's optimizer state is not AdamW's of the model (`expected`: our parameters'
    names and shapes; None: only that it names parameters of ours)."""
    adamw = optimizers.get(OPTIMIZER)
    if adamw is None:
        keys = ", ".join(map(str, list(optimizers)[:3]))
        return f"its optimizer state holds no {OPTIMIZER} state (it holds {keys})"
    groups = adamw.get("param_groups") if isinstance(adamw, dict) else None
    moments = adamw.get("state") if isinstance(adamw, dict) else None
    if not isinstance(groups, list) or not isinstance(moments, dict):
        return f"its {OPTIMIZER} optimizer state is not an optimizer state dict (no state and param_groups)"
    named = [n for g in groups if isinstance(g, dict) for n in (g.get("params") or [])]
    ours = {str(n): parameter_name(str(n)) for n in named}
    foreign = [n for n, name in ours.items() if name is None]
    if foreign or not named:
        example = f" (e.g. {foreign[0]})" if foreign else ""
        return f"its {OPTIMIZER} optimizer state names {len(foreign)} of {len(named)} entries that are not our parameters{example}"
    if expected is None:
        return None
    missing = sorted(set(expected) - set(ours.values()))
    unknown = sorted(n for n in ours.values() if n not in expected)
    resized = [
        f"{ours[str(key)]}: {list(value.shape)} here, {list(expected[ours[str(key)]])} in the model"
        for key, entry in moments.items()
        if str(key) in ours and ours[str(key)] in expected and isinstance(entry, dict)
        for value in entry.values()
        if isinstance(value, _TensorShape) and value.shape and value.shape != expected[ours[str(key)]]
    ]
    if not (missing or unknown or resized):
        return None
    parts = [f"{len(missing)} of the model's parameters missing (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(unknown)} it does not have (e.g. {unknown[0]})"] if unknown else []
    parts += [f"moments of another shape (e.g. {resized[0]})"] if resized else []
    return f"its {OPTIMIZER} optimizer state does not fit the recipe's model: {', '.join(parts)}"


def _model_problem(model: dict, expected: Shapes | None) -> str | None:
    """Why a checkpoint's model state is not the model (`expected`: our names and shapes)."""
    found: dict[str, tuple[int, ...]] = {}
    foreign = []
    for key, value in model.items():
        name = parameter_name(str(key))
        if name is None or not isinstance(value, _TensorShape):
            foreign.append(str(key))
        else:
            found[name] = value.shape
    if not found:
        return f"{MODEL_MISMATCH} this project's models: none of its {len(model)} entries is one of our parameters"
    if expected is None:
        return None
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected)) + foreign
    resized = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    if not (missing or unexpected or resized):
        return None
    parts = [f"{len(missing)} of its parameters missing (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(unexpected)} entries it does not have (e.g. {unexpected[0]})"] if unexpected else []
    if resized:
        n = resized[0]
        parts.append(
            f"{len(resized)} of another shape (e.g. {n}: {list(found[n])} here, {list(expected[n])} in the model)"
        )
    return f"{MODEL_MISMATCH} the recipe's model: {', '.join(parts)}"


def download_files(store: Store, rels: list[str], local_root: Path) -> None:
    """Download `rels` under `local_root`, several at once (each large file is itself fetched in
    parallel parts by boto3's transfer manager); the time and bytes go to the `[restart]` line."""
    started = time.monotonic()
    for rel in rels:
        (local_root / rel).parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=min(DOWNLOAD_THREADS, max(1, len(rels)))) as pool:
        for done in [pool.submit(store.download, rel, local_root / rel) for rel in rels]:
            done.result()  # the first StorageError is raised here
    size = sum((local_root / rel).stat().st_size for rel in rels)
    restart.record_download(len(rels), size, time.monotonic() - started)


def remove_stale_composer_copy(save_folder: str) -> None:
    """Delete `./s3:/bucket/prefix`, the local copy Composer's autoresume downloads and later trusts."""
    if not save_folder.startswith("s3://"):
        return
    stale = Path(os.path.abspath(save_folder))  # how Composer names it: "s3://b/p" -> ./s3:/b/p
    if stale.is_dir():
        log.warning("removing the stale local checkpoint copy %s (the bucket is the source of truth)", stale)
        shutil.rmtree(stale, ignore_errors=True)


def stop_if_complete(cfg: TrainConfig, point: ResumePoint) -> None:
    """RunAlreadyComplete if the checkpoint resumed from is at or past the recipe's max_duration.

    Composer would raise "no training would occur"; a scheduler that restarts a finished job should
    see success instead.
    """
    if point.source != "autoresume":
        return
    reached = point.checkpoint.head.timestamp
    amount, unit = parse_duration(cfg.training.max_duration, "training.max_duration", ("ba", "tok", "ep"))
    if reached.get({"ba": "batch", "tok": "token", "ep": "epoch"}[unit], -1) >= amount:
        done = (
            f"run {cfg.run_name!r} already finished: its checkpoint at batch {point.batch} reached "
            f"training.max_duration={cfg.training.max_duration}; nothing to do"
        )
        saved = point.checkpoint.recipe
        changed = recipe_changes(saved, cfg.to_dict(redact=True)) if saved else []
        if not changed:
            raise RunAlreadyComplete(f"{done} (raise max_duration to train on)")
        # A command with new values (`train.py recipe optimizer.lr=1e-3`) would otherwise end here
        # saying only that the run is done, the values silently unused (issue 39).
        listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changed)
        raise RunAlreadyComplete(
            f"{done}. The recipe differs from the one it was trained with ({listed}) and these values "
            f"were not used; to train with them, {how_to_train_anew(cfg)}; to train this run on, "
            "raise training.max_duration"
        )


def how_to_train_anew(cfg: TrainConfig) -> str:
    """What to change so that the same recipe starts a new run instead of resuming this one (a
    recipe's save_folder is often `runs/${run_name}/checkpoints`, a command's often explicit)."""
    return (
        f"start a new run: another run_name (e.g. run_name={cfg.run_name}-2) with a "
        f"checkpoint.save_folder that holds no checkpoint (this run's is {cfg.checkpoint.save_folder})"
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


def announce(cfg: TrainConfig, point: ResumePoint, world_size: int) -> None:
    if point.source == "autoresume":
        ckpt = point.checkpoint
        saved_ws = ckpt.head.world_size
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
    # The loss's penalties on the logits live in the model section but are no part of its shape.
    "model.z_loss": "the recipe's new value applies from the resume point on",
    "model.max_z_loss": "the recipe's new value applies from the resume point on",
    "model.loss_chunk": "the recipe's new value applies from the resume point on",
    # What a token attends to is no part of the shape either: the weights load, the new mask applies.
    "model.attention": "the recipe's new value applies from the resume point on",
    "model.positions": "the recipe's new value applies from the resume point on",
    "optimizer.": "the optimizer state in the checkpoint (lr, embedding_lr, betas, eps, weight_decay) is used; "
    "the new value is ignored",
    "seed": "the RNG state in the checkpoint is used; the new seed has no effect",
    "model.": "the model shape must match the checkpoint; loading will fail if it does not",
}
NOT_COMPARED = ("checkpoint.", "run_dir", "loggers.", "data.cache_root")


def refuse_optimizer_group_change(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """ConfigError if `optimizer.embedding_lr` was set or unset since the checkpoint.

    Setting it adds a parameter group, and an optimizer state of another group layout cannot be
    loaded; a changed value (both set) is only ignored, as for every optimizer key.
    """
    before = saved.get("optimizer", {}).get("embedding_lr")
    after = current.get("optimizer", {}).get("embedding_lr")
    if (before is None) != (after is None):
        before, after = ("null" if v is None else v for v in (before, after))
        raise ConfigError(
            f"optimizer.embedding_lr is {after} but the checkpoint was trained with {before}: the "
            "optimizer state has another set of parameter groups and cannot be resumed; resume with "
            f"optimizer.embedding_lr={before}, or start a new run from the "
            "checkpoint's weights (checkpoint.load_path=<it> checkpoint.load_weights_only=true)"
        )


def recipe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, recipe's value) of every compared recipe value that differs. A key
    newer than the checkpoint differs only away from its schema default, the value that keeps the
    behaviour the checkpoint trained with."""
    old, new = flatten(saved), flatten(current)
    return [
        (key, old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if not key.startswith(NOT_COMPARED)
        and old.get(key) != new.get(key)
        and (key in old or new.get(key) != schema_default(key))
    ]


def warn_recipe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Warn once per recipe value that differs from the checkpoint's; return the messages."""
    messages = []
    for key, before, after in recipe_changes(saved, current):
        rule = next((v for k, v in FROM_CHECKPOINT.items() if key == k or key.startswith(k)), None)
        effect = rule or "the recipe's new value applies from the resume point on"
        messages.append(f"recipe changed since the checkpoint: {key}: {before!r} -> {after!r}; {effect}")
    for msg in messages:
        log.warning(msg)
        print(f"[resume] WARNING {msg}", file=sys.stderr, flush=True)
    return messages
