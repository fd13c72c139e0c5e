"""The typed training config: YAML recipe + dotted overrides -> validated dataclasses.

The dataclasses below are the schema; OmegaConf's structured configs read the recipe into them,
so `${...}` interpolation works (`run_dir: runs/${run_name}`) and unknown keys and wrong types are
refused. Overrides are `key=value` strings with dotted keys (`optimizer.lr=1e-4`,
`data.train.0.remote=s3://bkt/wiki/train`). Everything is validated once, here, and every error
is one line: an unknown key names the closest valid one, a wrong type names the expected type, a
number out of its range (declared beside its field with `bounded`; every float must be finite)
names the range.
The rest of the code receives a `TrainConfig`, never a raw dict.

A field's meaning is the comment beside it (on its line, or the comment lines right above it):
docs/config.md and `llm config` are written from these comments, the types, defaults and bounds
(`llm/config_reference.py`). A new key needs one; after changing the schema, regenerate the page
with `llm config --out docs/config.md` (tests/llm/test_config_reference.py checks both).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from llm.errors import ConfigError
from llm.model import ModelConfig
from shards.tokenizer import folder_without_tokenizer, tokenizer_in
from storage.local import atomic_write_text

DEFAULT_PROMPTS = ["床前明月光", "请你讲一个童话故事：", "感冒的症状是"]
DATA_KINDS = ("pretrain", "sft")
SPLITS = ("train", "eval")  # the recipe's data.train and data.eval
# The most batches a profiler window may trace: torch holds every traced batch's events in memory
# until the window ends, and a trace of a few batches is what a reader opens.
PROFILE_MAX_ACTIVE = 100


# --- the ranges of numbers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """The range a number of the recipe must lie in (a field's metadata, see `bounded`).

    `validate` checks every number of the recipe once: a float must be finite (nan, inf and
    1e400 are refused everywhere), and a field with bounds must lie in them. An element of a list
    or tuple field (`optimizer.betas`, `training.profile.ranks`) is checked against the field's bounds.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    words: str = ""  # how the range is said after "must be"; default: from the bounds

    def holds(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def says(self) -> str:
        if self.words:
            return self.words
        low, high = (
            _num(self.ge if self.gt is None else self.gt),
            _num(self.le if self.lt is None else self.lt),
        )
        if low is not None and high is not None:
            return f"in {'[' if self.gt is None else '('}{low}, {high}{']' if self.lt is None else ')'}"
        if self.gt == 0:
            return "positive"
        if self.gt is not None:
            return f"above {low}"
        if self.ge is not None:
            return f"{low} or more" if self.ge == 0 else f"at least {low}"
        return f"at most {high}" if self.lt is None else f"below {high}"


def _num(value: float | None) -> str | None:
    return None if value is None else f"{value:g}"


def bounded(default: Any = MISSING, *, factory: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field whose value (or each element) must lie in `Bounds(**bounds)`."""
    return field(default=default, default_factory=factory, metadata={"bounds": Bounds(**bounds)})


@dataclass
class StreamConfig:
    remote: str  # a split folder (holds index.json + meta.json): local path or s3://bucket/prefix
    local: str | None = None  # cache folder; None -> <data.cache_root>/<run_name>/<train|eval>/<i>-<hash>
    proportion: float | None = bounded(None, gt=0)  # mixing weight; all streams set it or none does
    # An eval stream's label in metrics (eval_loss/<name>); None: from remote (s3://b/wiki/val -> wiki).
    name: str | None = None

    def label(self) -> str:
        """`name`, else the remote's folder name, or its parent's when the folder is a split (val ...)."""
        if self.name:
            return self.name
        parts = [p for p in self.remote.split("://")[-1].split("/") if p]
        leaf = parts[-1] if parts else self.remote
        if leaf.lower() in _SPLIT_FOLDERS and len(parts) > 1:
            leaf = parts[-2]
        return re.sub(r"[^\w.-]", "_", leaf)


_SPLIT_FOLDERS = {"train", "val", "valid", "validation", "eval", "test", "dev"}


_POSITIVE_OR_NULL = "positive (or null for the default)"


@dataclass
class DataConfig:
    train: list[StreamConfig]  # the training streams (data.train.N below), mixed by proportion when several
    eval: list[StreamConfig] = field(default_factory=list)  # empty -> no evaluation
    # pretrain: packed documents (`python -m convert shards`), every token scored. sft: prompt/answer
    # samples (`python -m convert sft`), the loss averaged over answer tokens only. meta.json must agree.
    kind: str = "pretrain"
    # Where remote shards are cached (local split folders are read in place, never copied).
    cache_root: str = "${oc.env:LLM_CACHE_ROOT,/tmp/llm-stream-cache}"
    # Cache size per dataset (train, eval) for remote streams: "200gb", "auto" (80% of the cache
    # disk's free space at start, shared by the datasets), or null (no limit). Shards are evicted,
    # coldest first, as training moves on; at least 4 x the largest shard.
    cache_limit: str | None = "auto"
    keep_zip: bool = False  # keep a remote shard's compressed file in the cache once decompressed
    shuffle: bool = True  # shuffle the training samples (streaming's shuffle); false: shard order
    shuffle_seed: int = 9176  # the shuffle's seed: the same seed, the same order
    # samples shuffled together; null: streaming's default
    shuffle_block_size: int | None = bounded(None, ge=1, words=_POSITIVE_OR_NULL)
    # null: streaming's default, then kept by checkpoints
    num_canonical_nodes: int | None = bounded(None, ge=1, words=_POSITIVE_OR_NULL)
    # samples per rank fetched ahead; null: 8 x the batch
    predownload: int | None = bounded(None, ge=1, words=_POSITIVE_OR_NULL)
    # re-fetches of a shard failing its hash; null: 2 (outages: LLM_S3_OUTAGE_S)
    download_retry: int | None = bounded(None, ge=0, words="0 or more (or null for the default)")
    # seconds per shard request; null: LLM_S3_READ_TIMEOUT
    download_timeout: float | None = bounded(None, gt=0, words="positive seconds (or null for the default)")
    num_workers: int = bounded(0, ge=0)  # DataLoader worker processes per rank; 0: in the training process
    check_tokenizer_hash: bool = True  # refuse shards made with a different tokenizer file
    # Checked on every shard as it enters the cache (xxh64 or sha1, both written by convert);
    # null turns the check off. Cost: `make bench-train`'s data-wait figure.
    validate_hash: str | None = "xxh64"
    # Batches never trained on, as [from, to) windows of data batches in sample order (the batch
    # after the first `from` up to batch `to`, numbered as metrics.jsonl's steps): their samples are
    # read and dropped, the order is otherwise unchanged, and they count as steps (max_duration, the
    # schedule). The guard adds its windows here; a resume keeps them (docs/guard.md).
    skip: list[list[int]] = field(default_factory=list)

    def streams(self, split: str) -> list[StreamConfig]:
        """The streams of `split` (one of SPLITS): `train` or `eval`."""
        return self.train if split == "train" else self.eval


_PENALTY = "0 (off) up to 1 (the loss's own weight), e.g. 1e-4"


ATTENTION_KINDS = ("causal", "document")  # model.attention
POSITION_KINDS = ("window", "document")  # model.positions


@dataclass
class ModelSection(ModelConfig):
    """The recipe's `model:` section: the shape (`llm.model.ModelConfig`), two penalties on the
    logits that the loss adds and what a token of a packed sample attends to (`llm.composer_model`;
    none of them is part of the model's shape, so checkpoints and exports do not depend on them)."""

    # What a token attends to: causal (every earlier token of the sample, the previous documents
    # included) or document (earlier tokens of its own document only; documents are separated by
    # the EOS id of the shards' meta.json, which opens the next one, as it starts our prompts).
    # SFT samples always attend per conversation. Training only: exports and generation are the same.
    attention: str = "causal"
    # Rotary positions: window (counted from the sample's first token) or document (0 at each
    # document's first token; with attention=document only).
    positions: str = "window"

    # PaLM's z-loss: z_loss x log(Z)^2 per scored token, Z the softmax normaliser (PaLM: 1e-4); 0: off.
    z_loss: float = bounded(0.0, ge=0, le=1, words=_PENALTY)
    # Baichuan 2's max-z loss: max_z_loss x (the largest logit)^2 per scored token (2e-4); 0: off.
    max_z_loss: float = bounded(0.0, ge=0, le=1, words=_PENALTY)
    # Tokens per chunk of the loss head (llm/loss.py): the output projection and cross-entropy
    # computed a chunk at a time, never every token's logits at once; 0: the plain path (all logits).
    loss_chunk: int = bounded(512, ge=0, words="0 (the plain loss) or a positive number of tokens, e.g. 512")


@dataclass
class TokenizerConfig:
    path: str  # SentencePiece .model, Hugging Face tokenizer.json, or a folder holding one


_RATE = "in (0, 1]: AdamW moves every weight by about lr per step, e.g. 3e-4"


@dataclass
class OptimizerConfig:
    # AdamW's peak learning rate (reached after scheduler.warmup); above 1 is a typo, not a schedule
    lr: float = bounded(3e-4, gt=0, le=1, words=_RATE)
    betas: tuple[float, float] = bounded((0.9, 0.95), ge=0, lt=1)  # each in [0, 1)
    eps: float = bounded(1e-8, gt=0)  # AdamW's epsilon
    # 2-D weights only (matrices, embeddings); norms are not decayed
    weight_decay: float = bounded(0.1, ge=0, words="0 (off) or more, e.g. 0.1")
    # Peak rate of the token embedding matrix, on the same schedule; null: optimizer.lr. A small
    # model on little data learns its embeddings faster at a far higher rate (recipes/demo.yaml).
    embedding_lr: float | None = bounded(None, gt=0, le=1, words="in (0, 1], or null (optimizer.lr)")

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # OmegaConf 2.3 hands tuple fields over as lists


@dataclass
class SchedulerConfig:
    warmup: str = "1000ba"  # linear warmup, then cosine from optimizer.lr to min_lr at max_duration
    min_lr: float = bounded(1e-5, ge=0, words="0 or more, and at most optimizer.lr")  # where the cosine ends


@dataclass
class Float8Config:
    """Float8 matmuls in the decoder blocks' linear layers (torchao; extra `float8`)."""

    enabled: bool = False  # float8 matmuls on
    # Emulate float8 in higher precision (CPUs, GPUs without float8 tensor cores): for tests only.
    emulate: bool = False
    all_gather: bool = True  # with FSDP2: all-gather the block weights in float8 (half of bf16's bytes)


@dataclass
class ProfileConfig:
    """A torch profiler window (Chrome/Perfetto trace) and, on GPUs, a CUDA memory snapshot."""

    enabled: bool = False  # trace one window of batches (llm/profiling.py)
    wait: int = bounded(1, ge=0)  # batches skipped before the window (after the first batch)
    warmup: int = bounded(1, ge=0)  # batches traced but discarded (the profiler's own warm-up)
    active: int = bounded(2, ge=1, le=PROFILE_MAX_ACTIVE)  # batches in the trace
    # global ranks that write traces (each below the world size: checked when training starts)
    ranks: list[int] = bounded(factory=lambda: [0], ge=0, words="a global rank (0, 1, ...)")


@dataclass
class TrainingConfig:
    global_batch_size: int = bounded(32, gt=0)  # samples per optimizer step, all ranks together
    # samples per forward/backward on one device; 0: from the memory plan, the micro-batch (a divisor
    # of the per-rank batch) whose plan fits with the least recomputation, then the largest (printed at
    # start and by llm inspect)
    device_microbatch_size: int = bounded(
        32, ge=0, words="a positive number of samples, or 0 (from the memory plan)"
    )
    max_duration: str = "1000ba"  # batches ("2000ba") or tokens ("50000000tok")
    # the gradients' global norm is clipped to this
    grad_clip_norm: float = bounded(1.0, ge=0, words="0 (no clipping) or positive, e.g. 1.0")
    precision: str = "auto"  # auto | fp32 | amp_bf16 | amp_fp16 (auto: amp_bf16 on GPU, fp32 on CPU)
    device: str = "auto"  # auto | cpu | gpu
    eval_interval: str = "500ba"  # evaluate data.eval this often (batches, tokens, epochs) and at the end
    eval_subset_num_batches: int = -1  # -1: the whole validation split
    compile: bool = False  # torch.compile each decoder block (training path; llm/parallelism.py)
    # batches between the [progress] lines and metrics.jsonl's records
    log_interval: int = bounded(10, ge=1, words="at least 1 (batches between lines)")
    float8: Float8Config = field(default_factory=lambda: Float8Config())
    profile: ProfileConfig = field(default_factory=lambda: ProfileConfig())


@dataclass
class FSDPConfig:
    """Sharding over data-parallel ranks with FSDP2 (`llm/parallelism.py`), on GPUs and CPUs alike."""

    enabled: bool = False  # shard parameters, gradients and optimizer state over the ranks
    version: int = 2  # FSDP2 only: FSDP1 (GPU-only, untestable on CPUs) was removed
    # Replica groups: 1 = shard over every rank (FSDP); N > 1 = HSDP, ranks split into N groups
    # (one per node, say) that each hold a full sharded copy, gradients all-reduced between them.
    replicate: int = bounded(1, ge=1, words="at least 1 (1 = plain FSDP, N = HSDP)")
    mixed_precision: str = "DEFAULT"  # DEFAULT: params in the compute dtype, fp32 reduction; PURE; FULL
    # none: keep every activation; full: recompute each decoder block in backward; selective: keep
    # the outputs of the matmuls and attention, recompute the cheap ops (torch's selective
    # checkpoint API); auto: the memory plan chooses per block the least recomputation that fits
    # this GPU (blocks kept whole, selective or full; llm inspect prints the choice). The old
    # true/false still read as full/none. Memory: llm/memory_plan.py.
    activation_checkpointing: str = "full"
    # selective only: every k-th block (k, 2k, ...) is recomputed in full instead; 0: none is.
    checkpoint_full_every: int = bounded(0, ge=0, words="0 (never) or more")
    state_dict_type: str = "sharded"  # full | sharded
    init_on_meta: bool = True  # build on the meta device; FSDP materialises each rank's shard (GPU)


@dataclass
class CheckpointConfig:
    save_folder: str | None = None  # local folder or s3://...; None disables saving
    # 500ba / 1000000tok / 1ep; wall-clock 90s / 10m / 1h; or auto: as often as max_stall and the
    # uploads allow, from this run's measurements (llm/checkpoint/schedule.py)
    save_interval: str = "500ba"
    max_stall: float = 0.01  # auto: the share of training time the saves may stall it
    num_to_keep: int = 3  # -1 keeps every checkpoint
    autoresume: bool = True  # effective whenever run_name and save_folder are set
    load_path: str | None = None  # a checkpoint to start from
    load_weights_only: bool = False  # take only load_path's weights: a new run from them (an import, SFT)
    allow_untrusted_load_path: bool = False  # checkpoints are pickles: docs/resume.md, "Checkpoint safety"
    # Store each save while training goes on (llm/checkpoint/uploader.py); false: the step waits.
    background_upload: bool = True
    # the most fit end, SIGTERM and close wait for a pending upload
    upload_wait_s: float = bounded(
        600.0,
        ge=1,
        le=86400,
        words="at least 1 second and at most 86400 (a day): how long the end of training waits for a "
        "checkpoint upload, e.g. 600",
    )
    staging_folder: str | None = None  # where an s3:// save is written first; None: the temp folder
    # Copy the state to host memory on the training thread, write and store it in the background
    # (llm/checkpoint/saver.py); false: Composer writes it on the training thread (the step waits).
    snapshot: bool = True
    # One node's host memory in GB (the cluster's, e.g. 2048): the snapshots of a node's ranks are
    # checked against it by `llm inspect` / --dry-run and at start; null: at start, only against the
    # memory available then.
    node_memory_gb: float | None = bounded(None, gt=0)
    when_busy: str = "wait"  # a save due while the previous one is still written or stored: wait | skip
    # An s3:// save_folder: keep this node's newest checkpoint files once stored, and at a restart on
    # the same node load them instead of downloading, when they match the manifest (docs/resume.md)
    local_copy: bool = True


@dataclass
class PreemptionConfig:
    """What a SIGTERM may use (llm/checkpoint/preemption.py, docs/resume.md)."""

    # Seconds between SIGTERM and the kill (30 and 120 are the common clouds'); null: unknown, a
    # save is attempted and waited for up to checkpoint.upload_wait_s. With a notice, a save whose
    # projected time (this run's measured snapshot, write and upload) does not fit the notice less
    # margin_s is not started: the upload in flight finishes if it fits, and the process exits.
    notice_s: float | None = None
    margin_s: float = 5.0  # kept free of the notice for the exit itself


@dataclass
class GenerateCallbackConfig:
    """Prompts continued during training (llm/callbacks/generation.py): console, samples.jsonl, loggers."""

    enabled: bool = True  # continue the prompts during training
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))  # the prompts continued
    interval: str = "500ba"  # how often, and at the end of training
    max_new_tokens: int = bounded(64, ge=1)  # tokens generated per prompt
    temperature: float = bounded(0.8, ge=0, words="0 (greedy) or more")  # the sampling temperature
    top_k: int = bounded(50, ge=0, words="0 (no cut) or more")  # sample among the k likeliest tokens
    top_p: float = bounded(1.0, gt=0, le=1)  # sample within the likeliest tokens whose probability reaches it
    seed: int = 1234  # the generation's own random generator (training's is untouched)


@dataclass
class EvalTasksCallbackConfig:
    """Multiple-choice tasks scored during training (llm/callbacks/task_eval.py, docs/eval.md)."""

    tasks: list[str] = field(default_factory=list)  # task folders (C-Eval/CMMLU CSV layout) or s3://; []: off
    interval: str = "500ba"  # and at the end of training
    shots: int = bounded(0, ge=0)  # few-shot examples, the first of each subject's dev split
    split: str | None = None  # None: val if the task has it, else test
    # the first N questions of each subject; None: all
    max_questions: int | None = bounded(None, ge=1, words="at least 1, or null for all")
    batch_size: int = bounded(8, ge=1)  # rows per forward pass
    shared_prompt: bool = True  # all options of a question in one row (one pass over the prompt)


@dataclass
class CallbacksConfig:
    generate: GenerateCallbackConfig = field(default_factory=GenerateCallbackConfig)
    eval_tasks: EvalTasksCallbackConfig = field(default_factory=EvalTasksCallbackConfig)
    # batches the tokens/s and MFU are averaged over
    speed_window: int = bounded(10, ge=1, words="at least 1 (batches the tokens/s is averaged over), e.g. 10")
    memory_monitor: bool = True  # GPU only
    loss_plot: bool = True  # <run_dir>/loss.png at the end of training


@dataclass
class MLflowConfig:
    """Composer's MLFlowLogger (llm/loggers/mlflow_tracker.py); needs the `mlflow` extra."""

    enabled: bool = False  # log the run to MLflow
    tracking_uri: str | None = None  # http://host:5000, databricks, ...; None: env MLFLOW_TRACKING_URI
    experiment_name: str = "llm-pretrain"  # the MLflow experiment the run is logged under
    run_name: str | None = None  # None: the recipe's run_name
    # seconds between sends; points logged meanwhile go in one request
    flush_interval: float = bounded(5.0, gt=0, words="positive seconds")
    # seconds the end of a run waits for an unreachable server
    close_timeout: float = bounded(30.0, ge=0, words="0 or more seconds")


@dataclass
class WandBConfig:
    """Composer's WandBLogger (llm/loggers/wandb_tracker.py); needs the `wandb` extra."""

    enabled: bool = False  # log the run to Weights & Biases
    project: str = "llm-pretrain"  # the W&B project
    entity: str | None = None  # the W&B team or user; None: your default entity
    name: str | None = None  # the run's display name; None: the recipe's run_name
    mode: str | None = None  # online | offline | disabled; None: env WANDB_MODE, else online
    dir: str | None = None  # where W&B writes its files; None: <run_dir>
    tags: list[str] = field(default_factory=list)  # the W&B run's tags


@dataclass
class LoggersConfig:
    progress_bar: bool = True  # Composer's live bars, drawn only when stderr is a terminal
    metrics_file: bool = True  # <run_dir>/metrics.jsonl
    tensorboard: bool = False  # <run_dir>/tensorboard
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandBConfig = field(default_factory=WandBConfig)


_FACTOR = "above 1 (e.g. 1.5), or 0 to turn that rule off"


@dataclass
class GuardConfig:
    """Loss spikes and non-finite steps: detected, rolled back and skipped (llm/callbacks/guard.py,
    docs/guard.md). Needs checkpoint.save_folder: the rollback point is the newest checkpoint."""

    enabled: bool = False  # detect spikes, roll back and skip (docs/guard.md)
    # A step is a spike when its loss, gradient norm or weight norm is not finite (its update is never
    # applied), or when its loss exceeds loss_factor x the median loss of the last `window` good steps,
    # or its gradient norm (before clipping) grad_factor x their median. 0 turns a factor rule off.
    loss_factor: float = bounded(1.5, ge=0, words=_FACTOR)
    # Off by default: a clean run's gradient norm reached 28 x its median (bench/guard.py, the tiny
    # model), and with clipping what an oversized gradient does shows in the weight norm and the loss.
    grad_factor: float = bounded(0.0, ge=0, words=_FACTOR)
    # A loss more than loss_z x the loss's own noise above the window's median is a spike too, when
    # it is also more than loss_rise (a share) above that median; 0 turns the rule off. The noise: the
    # spread of consecutive losses' differences, not counting the loss's fall (1.4826 x their median
    # absolute deviation / sqrt 2, the standard deviation of one loss for normal noise).
    loss_z: float = bounded(6.0, ge=0)
    loss_rise: float = bounded(
        0.1, ge=0
    )  # the least rise the loss_z rule counts (0.1: 10 % above the median)
    # A collapse: the weights' norm above weight_factor x the previous step's (an update far too large;
    # 0: off), or flat_steps losses in a row equal to 6 digits (a model that outputs the same
    # distribution for every input; 0: off). The rollback goes to a state before the first equal loss.
    weight_factor: float = bounded(1.5, ge=0, words=_FACTOR)
    # losses in a row equal to 6 digits that count as a collapse (see weight_factor)
    flat_steps: int = bounded(5, ge=0, words="at least 2, or 0 to turn that rule off")
    window: int = bounded(100, ge=1)  # good steps in the running medians and the loss's noise
    # the rules but the non-finite one start once this many good steps were seen (kept across resumes)
    warmup: int = bounded(100, ge=0)
    # On a spike at batch S: back to the rollback point R, the newest save at least `rewind` batches
    # before S (0: the newest; none that old: the newest; from its snapshot in host memory when it
    # is there, llm/checkpoint/rollback.py), and batches [R, S + skip) are
    # never trained on (added to data.skip): the stretch since R, the spike's batch and `skip` more.
    rewind: int = bounded(0, ge=0)
    skip: int = bounded(200, ge=0)  # batches past the spike also never trained on (see rewind)
    max_rollbacks: int = bounded(3, ge=0)  # at most this many rollbacks within max_rollbacks_window
    max_rollbacks_window: int = bounded(1000, ge=1)  # batches; past that the run stops (exit 3)


@dataclass
class TrainConfig:
    model: ModelSection
    tokenizer: TokenizerConfig
    data: DataConfig
    run_name: str | None = None  # None: env RUN_NAME / COMPOSER_RUN_NAME, else the recipe's file name
    seed: int = 17  # the model's initial weights and Composer's random state (kept in checkpoints)
    # the run's records: config.yaml, metrics.jsonl, samples.jsonl, loss.png (llm/run_dir.py)
    run_dir: str = "runs/${run_name}"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    loggers: LoggersConfig = field(default_factory=LoggersConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def check_world_size(self, world_size: int) -> int:
        """Per-rank batch size for `world_size` ranks; ConfigError if the batch does not divide."""
        t = self.training
        mb = t.device_microbatch_size
        unit = world_size * (mb or 1)  # 0: from the plan, a divisor of the per-rank batch
        if t.global_batch_size % unit:
            by = f"world size {world_size}" + (f" x training.device_microbatch_size={mb}" if mb else "")
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by {by}; "
                f"choose a global batch that is a multiple of {unit}"
            )
        return t.global_batch_size // world_size

    def check_profile_ranks(self, world_size: int) -> None:
        """ConfigError if `training.profile` names a rank that `world_size` ranks do not have."""
        p = self.training.profile
        beyond = [r for r in p.ranks if r >= world_size] if p.enabled else []
        if beyond:
            raise ConfigError(
                f"training.profile.ranks={p.ranks}: rank {beyond[0]} does not exist in a world of "
                f"{world_size} rank(s); name ranks below {world_size}, e.g. training.profile.ranks=[0]"
            )

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return _redact(data) if redact else data


# --- loading ----------------------------------------------------------------------------------


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML recipe, apply `key=value` overrides, resolve `${...}`, validate, return it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; pass a YAML file such as recipes/demo.yaml")
    recipe = _read_recipe(path)
    try:
        cfg = OmegaConf.structured(TrainConfig)
        # Section by section rather than one merge: OmegaConf then names the section in its errors.
        for key, value in [*recipe.items(), *map(_split_override, overrides)]:
            OmegaConf.update(cfg, str(key), value, merge=True)
        if cfg.run_name is None:
            cfg.run_name = os.environ.get("RUN_NAME") or os.environ.get("COMPOSER_RUN_NAME") or path.stem
        result = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, path, recipe)) from None
    validate(result)
    return result


def _read_recipe(path: Path) -> dict:
    """The recipe's YAML as a dict, `${...}` left unresolved; ConfigError naming line and column."""
    try:
        recipe = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or ""
        if mark is None:
            raise ConfigError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from None
        line = path.read_text(encoding="utf-8", errors="replace").splitlines()[mark.line : mark.line + 1]
        if line and line[0][mark.column : mark.column + 1] == "\t":
            problem += " (a tab: indent YAML with spaces)"
        raise ConfigError(
            f"recipe {path}, line {mark.line + 1}, column {mark.column + 1}: {problem}"
        ) from None
    except OSError as err:  # unreadable, or a lone number ("Invalid loaded object type: int")
        raise ConfigError(f"recipe {path}: {err}; it must be a YAML mapping of sections") from None
    if not isinstance(recipe, DictConfig):
        raise ConfigError(f"recipe {path} must be a YAML mapping of sections, got a list")
    return OmegaConf.to_container(recipe)


def _split_override(item: str) -> tuple[str, Any]:
    """`key=value` -> (key, value read as YAML: numbers, bools, null, lists; else the string)."""
    key, equals, text = item.partition("=")
    key = key.strip().lstrip("+")
    if not equals:
        raise ConfigError(f"override {item!r} must look like key=value, e.g. optimizer.lr=1e-4")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        return key, yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return key, text


# OmegaConf's node class -> what the user has to write there.
_EXPECTED = {
    "IntegerNode": "an integer",
    "FloatNode": "a number",
    "BooleanNode": "true or false",
    "StringNode": "a string",
    "ListConfig": "a list",
    "TupleConfig": "a list of {size} values",
    "DictConfig": "a mapping",
}


def _explain(err: OmegaConfBaseException, path: Path, recipe: dict) -> str:
    """OmegaConf's multi-line error as one line naming the key, the expected type or the closest key."""
    key = re.sub(r"\[(\d+)\]", r".\1", err.full_key or "")  # data.train[0].remote -> data.train.0.remote
    if key and "." not in key and err.object_type is not TrainConfig:
        # Merging a list of sections, OmegaConf names the key relative to its list item.
        key = _find_in_lists(recipe, key, err.value) or key
    unknown = isinstance(err, ConfigKeyError | ConfigAttributeError) and err.child_node is None
    if unknown and dataclasses.is_dataclass(err.object_type):
        valid = [f.name for f in dataclasses.fields(err.object_type)]
        close = difflib.get_close_matches(str(err.key), valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown key '{key}': {hint}valid keys here: {', '.join(valid)}"
    if isinstance(err, MissingMandatoryValue):
        return f"{key} is required but missing from the recipe"
    expected = _EXPECTED.get(type(err.child_node).__name__)
    if expected and "{size}" in expected:  # a fixed-length tuple node: its length is the expected one
        expected = expected.format(size=len(err.child_node))
    if isinstance(err, ValidationError) and key and expected:
        words = _bounds_words(err.object_type, err.key)
        return f"{key} must be {expected}{words} got {err.value!r} ({type(err.value).__name__})"
    return f"recipe {path}: {key + ': ' if key else ''}{str(err).splitlines()[0]}"


def _bounds_words(section: Any, name: Any) -> str:
    """A bounded field's range in words, to follow its type in a wrong-type message ("" otherwise)."""
    if not dataclasses.is_dataclass(section):
        return ""
    found = [f for f in dataclasses.fields(section) if f.name == name]
    bounds = found[0].metadata.get("bounds") if found else None
    return f": {bounds.words};" if bounds and bounds.words else ","


def _find_in_lists(tree: Any, key: str, value: Any, where: str = "") -> str | None:
    """The dotted path of `key` in a mapping that is a list item (holding `value` if one is given)."""
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for name, child in children:
        at = f"{where}.{name}" if where else str(name)
        item = child if isinstance(tree, list) and isinstance(child, dict) else {}
        if key in item and value in (None, item[key]):
            return f"{at}.{key}"
        if found := _find_in_lists(child, key, value, at):
            return found
    return None


# --- durations --------------------------------------------------------------------------------


def parse_duration(
    value: str, key: str = "duration", units: Sequence[str] = ("ba", "tok", "ep", "sp")
) -> tuple[int, str]:
    """A Composer time string as (amount, unit): "1000ba" -> (1000, "ba"); ConfigError otherwise.

    The one reader of durations (validation, schedule, resume): the whole-number subset of
    Composer's `Time.from_timestring` (tests/llm/test_config.py checks they agree). Not Time itself:
    `composer.core.time` imports all of Composer (3 s on top of torch here), and recipes are
    validated on paths that never train (`llm inspect`).
    """
    text = value.strip()
    unit = next((u for u in units if text.endswith(u)), "")
    amount = text[: len(text) - len(unit)]
    if not unit or not (amount.isascii() and amount.isdigit()):
        examples = ", ".join(f"100{u}" for u in units)
        raise ConfigError(f"{key}={value!r} is not a duration; use an integer with a unit: {examples}")
    return int(amount), unit


# --- cross-field validation -----------------------------------------------------------------


def validate(cfg: TrainConfig) -> None:
    """Checks that involve more than one field; raises ConfigError."""
    check_numbers(cfg)
    try:
        cfg.model.validate()
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    t = cfg.training
    if t.device_microbatch_size and t.global_batch_size % t.device_microbatch_size:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"training.device_microbatch_size={t.device_microbatch_size}; gradient accumulation "
            "needs a whole number of micro-batches"
        )
    parse_duration(t.max_duration, "training.max_duration", ("ba", "tok", "ep"))
    parse_duration(cfg.scheduler.warmup, "scheduler.warmup", ("ba", "tok"))
    ck, gen = cfg.checkpoint, cfg.callbacks.generate
    _check_save_interval(ck)
    for key, value, off in (  # zero: Composer would never save, and evaluate after every batch
        ("training.eval_interval", t.eval_interval, "leave data.eval empty"),
        ("callbacks.generate.interval", gen.interval, "set callbacks.generate.enabled=false"),
        ("callbacks.eval_tasks.interval", cfg.callbacks.eval_tasks.interval, "leave its tasks empty"),
    ):
        if parse_duration(value, key, ("ba", "tok", "ep"))[0] == 0:
            raise ConfigError(f"{key}={value!r} is zero; use a positive interval such as 500ba, or {off}")
    _check_documents(cfg.model)
    _check_choice("training.precision", t.precision, ("auto", "fp32", "amp_bf16", "amp_fp16"))
    _check_choice("training.device", t.device, ("auto", "cpu", "gpu"))
    if cfg.fsdp.version != 2:
        raise ConfigError(
            f"fsdp.version={cfg.fsdp.version!r}: only FSDP2 is supported (FSDP1 was removed, see "
            "docs/scaling.md); use fsdp.version=2 or leave it out"
        )
    _check_activation_checkpointing(cfg)
    _check_profile(cfg)
    _check_choice("fsdp.mixed_precision", cfg.fsdp.mixed_precision, ("DEFAULT", "PURE", "FULL"))
    _check_choice("fsdp.state_dict_type", cfg.fsdp.state_dict_type, ("full", "sharded"))
    _check_choice("data.validate_hash", cfg.data.validate_hash, (None, "xxh64", "sha1"))
    _check_choice("data.kind", cfg.data.kind, DATA_KINDS)
    _check_choice("loggers.wandb.mode", cfg.loggers.wandb.mode, (None, "online", "offline", "disabled"))
    if cfg.data.cache_limit not in (None, "auto"):
        parse_bytes(cfg.data.cache_limit, "data.cache_limit")
    if not cfg.data.train:
        raise ConfigError("data.train needs at least one stream (remote: <folder or s3:// of a split>)")
    _check_tokenizer_path(cfg.tokenizer.path)
    for section in ("train", "eval"):
        streams = getattr(cfg.data, section)
        given = [s.proportion is not None for s in streams]
        if any(given) and not all(given):
            raise ConfigError(f"data.{section}: set proportion on every stream or on none")
    _check_eval_names(cfg.data.eval)
    if len(cfg.optimizer.betas) != 2:  # OmegaConf 2.4 checks this itself, 2.3 does not
        raise ConfigError(f"optimizer.betas must be a list of 2 values, got {list(cfg.optimizer.betas)}")
    _check_small_numbers(cfg)
    _check_preemption(cfg.preemption)
    _check_guard(cfg)
    if cfg.scheduler.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"scheduler.min_lr={cfg.scheduler.min_lr} is above optimizer.lr={cfg.optimizer.lr}")


WALL_CLOCK_INTERVAL = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h)$")  # checkpoint.save_interval in time


def wall_clock_seconds(interval: str) -> float | None:
    """Seconds of a wall-clock `checkpoint.save_interval` (`10m` -> 600.0), or None if it is not one."""
    match = WALL_CLOCK_INTERVAL.match(str(interval).strip())
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)] if match else None


def counted_in_time(interval: str) -> bool:
    """Whether a `checkpoint.save_interval` is wall-clock time or `auto`, not a training duration."""
    return interval.strip() == "auto" or wall_clock_seconds(interval) is not None


def _check_save_interval(ck: CheckpointConfig) -> None:
    """`checkpoint.save_interval` (a duration, wall-clock time or auto) and its companions."""
    seconds = wall_clock_seconds(ck.save_interval)
    if ck.save_interval.strip() != "auto" and seconds is None:
        try:
            amount, _ = parse_duration(ck.save_interval, "checkpoint.save_interval", ("ba", "tok", "ep"))
        except ConfigError:
            raise ConfigError(
                f"checkpoint.save_interval={ck.save_interval!r} is not an interval; use batches, tokens or "
                "epochs (500ba, 1000000tok, 1ep), wall-clock time (90s, 10m, 1h) or auto"
            ) from None
        if amount == 0:
            raise ConfigError(
                f"checkpoint.save_interval={ck.save_interval!r} is zero; use a positive interval such as "
                "500ba, 10m or auto, or leave checkpoint.save_folder unset"
            )
    if seconds is not None and not seconds > 0:
        raise ConfigError(f"checkpoint.save_interval={ck.save_interval!r} is zero; use e.g. 10m, 1h or auto")
    if not 0 < ck.max_stall < 1:  # also refuses nan
        raise ConfigError(
            f"checkpoint.max_stall={ck.max_stall} must be a fraction of the training time in (0, 1), e.g. 0.01"
        )
    _check_choice("checkpoint.when_busy", ck.when_busy, ("wait", "skip"))


def _check_documents(m: ModelSection) -> None:
    _check_choice("model.attention", m.attention, ATTENTION_KINDS)
    _check_choice("model.positions", m.positions, POSITION_KINDS)
    if m.positions == "document" and m.attention != "document":
        raise ConfigError(
            "model.positions=document restarts positions at each document, which only makes sense "
            "when documents do not see each other; add model.attention=document or use model.positions=window"
        )


def _check_preemption(p: PreemptionConfig) -> None:
    if p.notice_s is not None and not 0 < p.notice_s < float("inf"):
        raise ConfigError(
            f"preemption.notice_s={p.notice_s} must be positive seconds (30 or 120 on the common clouds), "
            "or null when unknown"
        )
    if not 0 <= p.margin_s < float("inf"):
        raise ConfigError(f"preemption.margin_s={p.margin_s} must be 0 or more seconds, e.g. 5")


def _check_small_numbers(cfg: TrainConfig) -> None:
    """Values that Composer would take and then crash on (or silently misuse), beyond their ranges."""
    t = cfg.training
    if t.eval_subset_num_batches == 0 or t.eval_subset_num_batches < -1:
        raise ConfigError(
            f"training.eval_subset_num_batches={t.eval_subset_num_batches} must be positive, or -1 "
            "for the whole validation split"
        )
    folder = cfg.checkpoint.save_folder
    if folder and "://" in folder and not folder.startswith("s3://"):
        raise ConfigError(
            f"checkpoint.save_folder={folder!r}: only local folders and s3://bucket/prefix are supported"
        )


def _check_guard(cfg: TrainConfig) -> None:
    """data.skip's windows and the guard's settings (docs/guard.md); their numbers' ranges are
    `bounded`'s, checked with the others."""
    for i, window in enumerate(cfg.data.skip):
        if len(window) != 2 or not 0 <= window[0] < window[1]:
            raise ConfigError(
                f"data.skip.{i}={window} must be a window [from, to) of batches with 0 <= from < to, "
                "e.g. data.skip=[[1150,1350]]"
            )
    g = cfg.guard
    if not g.enabled:
        return
    if not cfg.checkpoint.save_folder:
        raise ConfigError(
            "guard.enabled=true needs checkpoint.save_folder: the guard rolls back to the newest "
            "checkpoint; set a save folder, or guard.enabled=false"
        )
    for key in (
        "loss_factor",
        "grad_factor",
        "weight_factor",
    ):  # the bounds say 0 or more; between 0 and 1 flags every step
        value = getattr(g, key)
        if 0 < value <= 1:
            raise ConfigError(f"guard.{key}={value} must be {_FACTOR}")
    if g.flat_steps == 1:  # one loss is always "equal to itself": every step would be a collapse
        raise ConfigError(f"guard.flat_steps={g.flat_steps} must be at least 2, or 0 to turn that rule off")


_BYTE_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_bytes(value: str | int, key: str) -> int:
    """`"200gb"` -> bytes (binary units, as streaming counts them); ConfigError naming `key`."""
    text = str(value).strip().lower()
    number = text.rstrip("kmgtb ")
    unit = text[len(number) :].strip()
    try:
        size = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"{key}={value!r} is not a size; write e.g. 200gb, 512mb or auto") from None
    if size <= 0:
        raise ConfigError(f"{key}={value!r} must be positive")
    return int(size)


def _check_tokenizer_path(path: str) -> None:
    """A folder is a tokenizer's when it holds tokenizer.json or tokenizer.model (`shards.tokenizer`);
    another is the commonest wrong tokenizer.path (the tokenizer's output folder): name its file."""
    if "://" in path or not Path(path).is_dir() or tokenizer_in(path) is not None:
        return
    raise ConfigError(folder_without_tokenizer(path, "tokenizer.path"))


def _check_eval_names(streams: list[StreamConfig]) -> None:
    """Each eval stream reports under its own label: labels must be distinct and fit a metric name."""
    seen: dict[str, int] = {}
    for i, s in enumerate(streams):
        label = s.label()
        if not re.fullmatch(r"[\w.-]+", label):
            raise ConfigError(
                f"data.eval.{i}.name={label!r}: use letters, digits, '_', '-' or '.' (it names metrics)"
            )
        if label in seen:
            raise ConfigError(
                f"data.eval.{seen[label]} and data.eval.{i} are both named {label!r}; give them distinct "
                f"names with data.eval.N.name (each eval stream reports its own loss under its name)"
            )
        seen[label] = i


CHECKPOINTING_POLICIES = ("none", "full", "selective", "auto")
_LEGACY_CHECKPOINTING = {"true": "full", "false": "none"}  # the old on/off key


def _check_activation_checkpointing(cfg: TrainConfig) -> None:
    f = cfg.fsdp
    f.activation_checkpointing = _LEGACY_CHECKPOINTING.get(
        str(f.activation_checkpointing).lower(), f.activation_checkpointing
    )
    _check_choice("fsdp.activation_checkpointing", f.activation_checkpointing, CHECKPOINTING_POLICIES)
    if f.checkpoint_full_every and f.activation_checkpointing != "selective":
        raise ConfigError(
            "fsdp.checkpoint_full_every applies to fsdp.activation_checkpointing=selective only; "
            "set it to 0 or choose selective"
        )
    if f.activation_checkpointing == "selective" and cfg.training.compile:
        raise ConfigError(
            "fsdp.activation_checkpointing=selective does not combine with training.compile=true "
            "(the selective policy must see each op); use full or none with compile"
        )


def _check_profile(cfg: TrainConfig) -> None:
    """The profiler window must name ranks and end within the run (ranges: the schema's bounds)."""
    p = cfg.training.profile
    if not p.enabled:
        return
    if not p.ranks:
        raise ConfigError(f"training.profile.ranks={p.ranks} must list global ranks (0, 1, ...)")
    amount, unit = parse_duration(cfg.training.max_duration, "training.max_duration", ("ba", "tok", "ep"))
    run = -(-amount // (cfg.training.global_batch_size * cfg.model.max_seq_len)) if unit == "tok" else amount
    window = p.wait + p.warmup + p.active  # Composer's cyclic schedule, from the run's first batch
    if unit != "ep" and window > run:
        raise ConfigError(
            f"training.profile: the window (wait {p.wait} + warmup {p.warmup} + active {p.active} = {window} "
            f"batches) ends after the run's {run} (training.max_duration={cfg.training.max_duration}); "
            "profile a few batches, e.g. training.profile.active=2"
        )


def check_numbers(node: Any, prefix: str = "") -> None:
    """Every number of the recipe in its range, one line naming the first that is not: a float
    must be finite (nan and infinities are refused everywhere), and a field declared with
    `bounded` (each element of a list or tuple field) must lie in its `Bounds`."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        bounds = f.metadata.get("bounds")
        items = enumerate(value) if isinstance(value, list | tuple) else [(None, value)]
        for i, item in items:
            where = key if i is None else f"{key}.{i}"
            if dataclasses.is_dataclass(item):
                check_numbers(item, where + ".")
            else:
                _check_number(where, item, bounds)


def _check_number(key: str, value: Any, bounds: Bounds | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not math.isfinite(value):
        says = f": {bounds.says()}" if bounds else ""
        raise ConfigError(f"{key}={value} must be a finite number{says}")
    if bounds is not None and not bounds.holds(value):
        raise ConfigError(f"{key}={value} must be {bounds.says()}")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")


# --- saving -----------------------------------------------------------------------------------

_SECRET_KEY = re.compile(r"(secret|password|passwd|credential|api_key|access_key|session_token)", re.I)
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+:[^/@\s]+@")


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        if key and _SECRET_KEY.search(key):
            return "***"
        return _URL_CREDENTIALS.sub("***@", value)
    return value


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, credentials redacted."""
    return yaml.safe_dump(cfg.to_dict(redact=True), sort_keys=False, allow_unicode=True)


def save_resolved(cfg: TrainConfig, path: str | os.PathLike) -> Path:
    """Write the resolved, redacted config (atomically) so a run records what it ran."""
    atomic_write_text(path, to_yaml(cfg))
    return Path(path)


def schema_default(key: str) -> Any:
    """The schema's default of a flattened key (`checkpoint.save_interval`); `MISSING` where the
    key is required, unknown or inside a list. A checkpoint saved before a key existed trained as
    that default says: a new key's default keeps the old behaviour."""
    cls: Any = TrainConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return MISSING
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None:
            return MISSING
        default = f.default if f.default is not MISSING else f.default_factory  # type: ignore[misc]
        cls = typing.get_type_hints(cls)[part]
    if default is MISSING:
        return MISSING
    value = default if f.default is not MISSING else default()
    return list(value) if isinstance(value, tuple) else value


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict (`TrainConfig.to_dict()`) as `section.key` -> value, tuples as lists:
    what a resume compares with the checkpoint's recipe and what the trackers take as params."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, tuple):
        value = list(value)
    return {prefix.rstrip("."): value}
