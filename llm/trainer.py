"""Build a Composer `Trainer` from a `TrainConfig`, and run it.

`build_trainer(cfg)` resolves device and precision, checks the data's metadata against the recipe,
builds the streaming dataloaders, the model, AdamW and the schedule, the callbacks and loggers,
and hands everything to Composer. `train(cfg)` fits and returns a `TrainResult`: the last losses
and where the run's files are.

Callbacks are assembled from `CALLBACK_BUILDERS`, a list of small functions `(ctx) -> callbacks`:
a feature that needs a callback (generation samples, preemption handling) appends its own
function there instead of growing this module. The guard and the skip windows come first
(`guard_callbacks`; the guard's rollback point is `rollback_point`'s).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from composer import Trainer
from composer.algorithms import GradientClipping
from composer.callbacks import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
from composer.core import Callback, Evaluator
from composer.loggers import LoggerDestination
from composer.utils import dist

from llm.callbacks.chat_record import chat_record_callbacks
from llm.callbacks.eval_sources import EvalSources, eval_sources_callbacks, source_label
from llm.callbacks.generation import first_and_last_samples, generation_callbacks
from llm.callbacks.guard import NonFiniteLoss, SpikeGuard
from llm.callbacks.loss_plot import LossPlot
from llm.callbacks.release_datasets import ReleaseDatasets
from llm.callbacks.skip_windows import SkipWindowsCallback
from llm.callbacks.task_eval import task_eval_callbacks
from llm.checkpoint import restart
from llm.checkpoint.plan import plan_checkpointing
from llm.checkpoint.rollback import HostSnapshot, NewestCheckpoint, RollbackPoint
from llm.composer_model import Documents, LanguageModel
from llm.config import TrainConfig, counted_in_time, save_resolved, to_yaml
from llm.data import (
    all_stream_locals,
    build_dataloader,
    check_streams,
    clean_stale_shared_memory,
    document_eos,
    release_shared_memory,
    train_data_spec,
)
from llm.errors import ConfigError
from llm.float8 import apply_float8, check_float8
from llm.loggers import MetricsFile, ProgressLine, build_trackers, check_extras
from llm.memory_plan import DEFAULT_GPU_GB, plan_microbatch, recipe_plan, recompute_share, with_microbatch
from llm.optim import build_optimizer, build_scheduler, duration_in_batches
from llm.parallelism import (
    all_reduce_between_replicas,
    apply_activation_checkpointing,
    compile_blocks,
    report,
    sharding_config,
)
from llm.plots import draw_run_plot
from llm.profiling import memory_snapshot_callbacks, profiler_for
from llm.run_dir import RunDir, RunRecords
from llm.startup import quick_cpu_model
from storage.scratch import on_exit, use_own_temp_folder

EVAL_METRICS = ["LanguageCrossEntropy", "LanguagePerplexity"]


@dataclass
class BuildContext:
    """What callback builders may need besides the config."""

    cfg: TrainConfig
    device: str  # "cpu" | "gpu"
    run_dir: Path
    world_size: int
    model: LanguageModel
    train_loader: Any = None  # the SkippingLoader (llm/data/skip.py)
    schedule: Schedule | None = None


# --- device, precision, parallelism ------------------------------------------------------------


def resolve_device(cfg: TrainConfig) -> str:
    wanted = cfg.training.device
    if wanted == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if wanted == "gpu" and not torch.cuda.is_available():
        raise ConfigError("training.device=gpu but no CUDA GPU is visible; use training.device=auto or cpu")
    return wanted


def resolve_precision(cfg: TrainConfig, device: str) -> str:
    precision = cfg.training.precision
    if precision == "auto":
        return "amp_bf16" if device == "gpu" else "fp32"
    if device == "cpu" and precision != "fp32":
        raise ConfigError(
            f"training.precision={precision} needs a GPU; on the CPU use training.precision=fp32 (or auto)"
        )
    return precision


def parallelism_config(cfg: TrainConfig, world_size: int) -> dict[str, Any] | None:
    """Composer's `parallelism_config`: FSDP2 or HSDP (llm/parallelism.py), or None for DDP."""
    sharding = sharding_config(cfg.fsdp, world_size)
    return None if sharding is None else {"fsdp": sharding}


def documents_for(cfg: TrainConfig, eos_id: int | None) -> Documents | None:
    """How pretraining samples' documents are kept apart (`model.attention=document`), or None."""
    if eos_id is None:
        return None
    return Documents(eos_id=eos_id, restart_positions=cfg.model.positions == "document")


def build_model(cfg: TrainConfig, device: str, eos_id: int | None = None) -> LanguageModel:
    """The model; `eos_id` separates documents when the recipe keeps them apart (`document_eos`)."""
    # On the meta device nothing is allocated; FSDP materialises each rank's shard through the
    # model's `param_init_fn`, giving the same weights as an ordinary build with this seed.
    # Composer's meta initialisation targets CUDA, so the CPU path always builds for real.
    on_meta = cfg.fsdp.enabled and cfg.fsdp.init_on_meta and device == "gpu"
    model = LanguageModel.from_config(
        cfg.model,
        seed=cfg.seed,
        device="meta" if on_meta else None,
        z_loss=cfg.model.z_loss,
        max_z_loss=cfg.model.max_z_loss,
        documents=documents_for(cfg, eos_id),
        loss_chunk=cfg.model.loss_chunk,
    )
    if cfg.training.float8.enabled:
        swapped = apply_float8(model.model, cfg.training.float8, fsdp=cfg.fsdp.enabled, device=device)
        how = "emulated" if cfg.training.float8.emulate else "float8 tensor cores"
        print(f"[float8] {swapped} linear layers of the blocks compute in float8 ({how})", flush=True)
    if cfg.training.compile:
        compile_blocks(model.model)  # per block, before checkpointing and FSDP wrap it
    if cfg.fsdp.enabled:  # as the memory plan assumes: checkpointing comes with FSDP
        policy = cfg.fsdp.activation_checkpointing
        if policy == "auto":
            policy = auto_block_policies(cfg, device, dist.get_world_size())
        apply_activation_checkpointing(model.model, policy, cfg.fsdp.checkpoint_full_every)
    return model


def planned_gpu_bytes(device: str) -> float:
    """The memory the plan fits a rank into: this GPU's, or on the CPU the plan's default GPU (80 GB)."""
    if device == "gpu":  # this rank's GPU: called before the process group makes it the current one
        index = dist.get_local_rank() % max(1, torch.cuda.device_count())
        return float(torch.cuda.get_device_properties(index).total_memory)
    return DEFAULT_GPU_GB * 1e9


def resolve_microbatch(cfg: TrainConfig, device: str, world_size: int, announce: bool = True) -> TrainConfig:
    """`training.device_microbatch_size: 0`: the recipe with the micro-batch the memory plan chooses
    for this world size and GPU (`plan_microbatch`, its trade-off printed unless `announce` is
    false); otherwise `cfg` itself."""
    if cfg.training.device_microbatch_size:
        return cfg  # the recipe's own value wins
    choice = plan_microbatch(cfg, world_size, planned_gpu_bytes(device))
    if announce and dist.get_global_rank() == 0:
        print(choice.line(), flush=True)
    return with_microbatch(cfg, choice.micro_batch)


def auto_block_policies(cfg: TrainConfig, device: str, world_size: int) -> list[str]:
    """`fsdp.activation_checkpointing=auto`: each block's policy, as the memory plan chooses it for
    this world size and this GPU's memory (on the CPU, the plan's default GPU of 80 GB)."""
    shards = world_size // cfg.fsdp.replicate
    gpu_bytes = planned_gpu_bytes(device)
    plan = recipe_plan(cfg, shards, gpu_bytes)
    share = recompute_share(cfg.model, cfg.model.max_seq_len, plan.blocks.full)
    print(
        f"[checkpointing] auto: {plan.blocks.words()} ({100 * share:.1f}% of the step's FLOPs recomputed; "
        f"planned {plan.total / 2**30:.1f} GiB of {gpu_bytes / 1e9:.0f} GB)",
        flush=True,
    )
    return plan.blocks.policies()


# --- callbacks and loggers ---------------------------------------------------------------------


def speed_callbacks(ctx: BuildContext) -> list[Callback]:
    # MFU needs the model's flops_per_batch (LanguageModel has it) and a GPU in Composer's table.
    # RuntimeEstimator: the seconds left (time/remaining_estimate), measured from this process's
    # own steps, so also right after a resume (llm/loggers/progress_line.py prints it).
    return [SpeedMonitor(window_size=ctx.cfg.callbacks.speed_window), RuntimeEstimator(time_unit="seconds")]


def lr_callbacks(ctx: BuildContext) -> list[Callback]:
    return [LRMonitor()]


def memory_callbacks(ctx: BuildContext) -> list[Callback]:
    return [MemoryMonitor()] if ctx.cfg.callbacks.memory_monitor and ctx.device == "gpu" else []


def profile_callbacks(ctx: BuildContext) -> list[Callback]:
    return memory_snapshot_callbacks(ctx.cfg, ctx.device, dist.get_global_rank())


def loss_plot_callbacks(ctx: BuildContext) -> list[Callback]:
    if not ctx.cfg.callbacks.loss_plot:
        return []
    return [LossPlot(RunDir(ctx.run_dir).loss_plot, title=f"{ctx.cfg.run_name}: loss")]


def rollback_point(cfg: TrainConfig) -> RollbackPoint:
    """Where the guard rolls back to (llm/checkpoint/rollback.py): the newest save's snapshot in host
    memory when saves take one (`checkpoint.snapshot`), else (and where it does not fit) the newest
    complete checkpoint."""
    newest = NewestCheckpoint(cfg.checkpoint.save_folder)
    return HostSnapshot(newest) if cfg.checkpoint.snapshot else newest


def guard_callbacks(ctx: BuildContext) -> list[Callback]:
    """The skip windows (always: a resume keeps the windows of a run whose guard was on), and
    before them the guard when `guard.enabled` (first of all: llm/callbacks/guard.py), else the
    stop on a non-finite loss."""
    skips = SkipWindowsCallback(ctx.train_loader, ctx.cfg)
    if not ctx.cfg.guard.enabled:
        return [NonFiniteLoss(), skips]  # a non-finite loss still stops the run, unsaved
    # How far back a rollback goes with exact medians: two save intervals; a wall-clock or `auto`
    # interval has no batch count, then the window once more.
    saves = ctx.schedule.save_batches if ctx.schedule is not None else None
    keep = 2 * saves if saves is not None else ctx.cfg.guard.window
    guard = SpikeGuard(
        ctx.cfg.guard, rollback_point(ctx.cfg), skips, clip=ctx.cfg.training.grad_clip_norm, keep=keep
    )
    return [guard, skips]


CALLBACK_BUILDERS: list[Callable[[BuildContext], list[Callback]]] = [
    guard_callbacks,  # first: the guard's rollback precedes what the others record
    eval_sources_callbacks,  # next: it puts the eval totals in the state that the others read
    speed_callbacks,
    lr_callbacks,
    memory_callbacks,
    profile_callbacks,
    loss_plot_callbacks,
    generation_callbacks,
    task_eval_callbacks,
    chat_record_callbacks,  # SFT: the chat template and the model shape go into every checkpoint
]


def build_callbacks(ctx: BuildContext) -> list[Callback]:
    return [cb for builder in CALLBACK_BUILDERS for cb in builder(ctx)]


def build_loggers(ctx: BuildContext) -> list[LoggerDestination]:
    cfg = ctx.cfg
    loggers: list[LoggerDestination] = []
    if cfg.loggers.metrics_file:
        loggers.append(MetricsFile(RunDir(ctx.run_dir).metrics, interval=cfg.training.log_interval))
    loggers.extend(build_trackers(cfg, ctx.run_dir))  # TensorBoard, MLflow, W&B: llm/loggers/trackers.py
    loggers.append(ProgressLine(cfg.training.log_interval))  # tokens/s, MFU, time to finish
    return loggers


def records_hooks(cfg: TrainConfig, loggers: Sequence[LoggerDestination]) -> list[Callable[[Any], object]]:
    """What runs before the records are stored with a checkpoint: metrics.jsonl's flush first (a
    checkpoint's stored metrics include its own step), then the loss plot's redraw."""
    hooks: list[Callable[[Any], object]] = [lg.flush for lg in loggers if isinstance(lg, MetricsFile)]
    if cfg.callbacks.loss_plot:
        plot, title = RunDir(cfg.run_dir).loss_plot, f"{cfg.run_name}: loss"

        def redraw_loss_plot(state):
            return draw_run_plot(plot, title)

        hooks.append(redraw_loss_plot)
    return hooks


# --- the trainer ------------------------------------------------------------------------------


@dataclass
class Schedule:
    """Durations of the run in optimizer steps (batches), whatever unit the recipe used."""

    max_batches: int
    warmup_batches: int
    eval_batches: int
    save_batches: int | None  # None: checkpoint.save_interval is wall-clock time or auto


def resolve_schedule(cfg: TrainConfig, batches_per_epoch: int | None) -> Schedule:
    tokens_per_batch = cfg.training.global_batch_size * cfg.model.max_seq_len

    def steps(value: str) -> int:
        return duration_in_batches(value, tokens_per_batch, batches_per_epoch)

    return Schedule(
        max_batches=steps(cfg.training.max_duration),
        warmup_batches=steps(cfg.scheduler.warmup),
        eval_batches=max(1, steps(cfg.training.eval_interval)),
        # Not passed on (llm/checkpoint's saver takes checkpoint.save_interval as written): computed
        # so that an interval in a unit the schedule cannot convert is refused before training.
        save_batches=None
        if counted_in_time(cfg.checkpoint.save_interval)
        else max(1, steps(cfg.checkpoint.save_interval)),
    )


def announce(cfg: TrainConfig, run_dir: Path, print_config: bool = False) -> None:
    """Save the resolved config with the run and name the file in one line (rank 0; credentials
    redacted); `print_config` (`train.py --print-config`): the whole config too. Printed in full
    at every start it was about 160 lines before the first step (issue 39)."""
    if dist.get_global_rank() != 0:
        return
    path = save_resolved(cfg, RunDir(run_dir).config)
    if print_config:
        print(f"resolved config ({cfg.run_name}):\n{to_yaml(cfg)}", flush=True)
    print(f"[config] run {cfg.run_name!r}: the resolved recipe is in {path}", flush=True)


def build_trainer(
    cfg: TrainConfig, extra_callbacks: Sequence[Callback] = (), print_config: bool = False
) -> Trainer:
    """A ready-to-fit Composer Trainer for `cfg` (raises ConfigError on unusable settings);
    `print_config`: print the resolved config in full, not only the line naming its file."""
    # Everything this process puts in the temp folder (streaming's file locks, torch's and Composer's
    # temp folders, the S3 staging folder) goes into one folder of its own, removed when it exits
    # or, after a SIGKILL, by the next start (storage/scratch.py).
    use_own_temp_folder()
    check_extras(cfg)  # a tracker the recipe asks for but is not installed: one line, before any work
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    # The launcher's world size (its environment; the process group, started below, agrees with it).
    world_size = dist.get_world_size()
    # Before anything uses it (the batch checks, the loaders, Composer, the checkpointing plan).
    cfg = resolve_microbatch(cfg, device, world_size)
    per_rank_batch = cfg.check_world_size(world_size)
    cfg.check_profile_ranks(world_size)
    metas = check_streams(cfg)  # before anything slow: refuse mismatched data with a clear message

    # Start the process group now: the datasets' partitioning and checkpointing need it.
    restart.mark("setup")  # imports, recipe and data checks done: the `[restart]` line's first phase
    dist.initialize_dist(device)  # on GPUs it also makes this rank's GPU the current one
    restart.mark("process_group")
    if cfg.training.float8.enabled:  # asks this rank's GPU; refused before the run folder is made
        check_float8(cfg.training.float8.emulate, device)
    parallelism = parallelism_config(cfg, world_size)
    # Where to start (fresh, newest verified checkpoint, or an allowed load_path), and the
    # callbacks that save, publish and handle preemption: see llm/checkpoint and docs/resume.md.
    records = RunRecords.for_run(cfg.run_dir, cfg.checkpoint.save_folder)  # llm/run_dir.py
    checkpointing = plan_checkpointing(
        cfg, rank=dist.get_global_rank(), world_size=world_size, records=records
    )
    run_dir = Path(cfg.run_dir)
    announce(cfg, run_dir, print_config)

    if dist.get_local_rank() == 0:
        clean_stale_shared_memory(all_stream_locals(cfg))
    dist.barrier()
    on_exit(release_shared_memory, fast_only=True)  # streaming's atexit hooks, when os._exit skips them
    train_loader = build_dataloader(cfg, "train", per_rank_batch)
    # One evaluator per eval stream, so each source reports its own loss (EvalSources adds the total).
    evaluators = [
        Evaluator(
            label=source_label(stream.label()),
            dataloader=build_dataloader(cfg, "eval", cfg.training.device_microbatch_size, stream=i),
            metric_names=EVAL_METRICS,
        )
        for i, stream in enumerate(cfg.data.eval)
    ]
    # The run's datasets free their shared memory at Trainer.close (a process may go on after it).
    release = ReleaseDatasets([train_loader.dataset, *(e.dataloader.dataloader.dataset for e in evaluators)])
    schedule = resolve_schedule(cfg, len(train_loader))

    model = build_model(cfg, device, document_eos(cfg, metas))
    optimizer = build_optimizer(model, cfg.optimizer)
    ctx = BuildContext(
        cfg=cfg,
        device=device,
        run_dir=run_dir,
        world_size=world_size,
        model=model,
        train_loader=train_loader,
        schedule=schedule,
    )
    loggers = build_loggers(ctx)
    records.before_store = records_hooks(cfg, loggers)
    quick_cpu_model()  # Composer's own lookup starts a second interpreter (llm/startup.py)
    trainer = Trainer(
        run_name=cfg.run_name,
        model=model,
        train_dataloader=train_data_spec(cfg, train_loader),  # SFT: counts answer tokens
        accumulate_train_batch_on_tokens=cfg.data.kind == "sft",  # SFT: mean over answer tokens
        eval_dataloader=evaluators or None,
        eval_interval=f"{schedule.eval_batches}ba",
        eval_subset_num_batches=cfg.training.eval_subset_num_batches,
        max_duration=f"{schedule.max_batches}ba",
        optimizers=optimizer,
        schedulers=build_scheduler(cfg, schedule.warmup_batches, schedule.max_batches),
        step_schedulers_every_batch=True,
        device=device,
        precision=precision,
        device_train_microbatch_size=cfg.training.device_microbatch_size,
        algorithms=_algorithms(cfg),
        seed=cfg.seed,
        parallelism_config=parallelism,
        callbacks=checkpointing.callbacks_after([*build_callbacks(ctx), *extra_callbacks, release]),
        loggers=loggers,
        # Live bars only on a terminal: in a file (`make demo > log 2>&1`) their carriage returns and
        # cursor moves would surround the [progress] lines, which are printed either way.
        progress_bar=cfg.loggers.progress_bar and draws_bars(sys.stderr),
        load_progress_bar=draws_bars(sys.stderr),
        # The console gets the [progress] line (ProgressLine) instead of Composer's dump of every
        # metric, which would repeat it unlabelled every log_interval when the bar is off.
        log_to_console=False,
        **checkpointing.trainer_kwargs,  # saving, autoresume and loading: decided in llm/checkpoint
        compile_config=None,  # training.compile compiles per block instead (build_model)
        profiler=profiler_for(cfg, dist.get_global_rank()),  # training.profile (llm/profiling.py)
    )
    hooked = all_reduce_between_replicas(trainer.state.model, trainer.state.fsdp_config)  # HSDP only
    if dist.get_global_rank() == 0:  # what Composer applied, read back from the wrapped model
        applied = report(trainer.state.model, world_size, trainer.state.precision, cfg.fsdp, hooked)
        print(applied.line(), flush=True)
    return trainer


def draws_bars(stream) -> bool:
    """Whether `stream` is a terminal, where a progress bar redraws in place."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _algorithms(cfg: TrainConfig) -> list:
    if cfg.training.grad_clip_norm <= 0 or cfg.guard.enabled:  # the guard clips (it needs the norm first)
        return []
    return [GradientClipping(clipping_type="norm", clipping_threshold=cfg.training.grad_clip_norm)]


@dataclass(frozen=True)
class TrainResult:
    """What `train()` returns: where the run ended, its last losses and where its files are."""

    step: int
    tokens: int
    train_loss: float | None
    eval_loss: float | None  # the token-weighted total over the eval streams
    eval_perplexity: float | None
    eval_sources: dict[str, dict[str, float]]  # each eval stream's last loss, perplexity, tokens
    run_dir: str
    config: str  # the resolved recipe saved with the run
    metrics_file: str | None  # None: loggers.metrics_file is off
    loss_plot: str | None  # None: callbacks.loss_plot is off
    samples: str  # the first and the last generation side by side; "" without two generations
    checkpoints: str | None  # checkpoint.save_folder; None: nothing was saved


def train(
    cfg: TrainConfig, extra_callbacks: Sequence[Callback] = (), print_config: bool = False
) -> TrainResult:
    """Fit `cfg`; return the final metrics and where the run's files are (`print_config`: as
    `build_trainer`)."""
    trainer = build_trainer(cfg, extra_callbacks, print_config)
    try:
        trainer.fit()
        result = summarize(trainer, cfg)
    finally:
        trainer.close()
    if dist.get_global_rank() == 0:
        print_summary(result)
    return result


def summarize(trainer: Trainer, cfg: TrainConfig) -> TrainResult:
    state = trainer.state
    run_dir = Path(cfg.run_dir)
    eval_values = state.eval_metric_values
    return TrainResult(
        step=int(state.timestamp.batch),
        tokens=int(state.timestamp.token),
        train_loss=_float(state.total_loss_dict.get("loss/train/total")),
        eval_loss=_float(eval_values.get("LanguageCrossEntropy")),
        eval_perplexity=_float(eval_values.get("LanguagePerplexity")),
        eval_sources=_eval_sources(state),
        run_dir=str(run_dir),
        config=str(RunDir(run_dir).config),
        metrics_file=str(RunDir(run_dir).metrics) if cfg.loggers.metrics_file else None,
        loss_plot=str(RunDir(run_dir).loss_plot) if cfg.callbacks.loss_plot else None,
        samples=first_and_last_samples(RunDir(run_dir).samples),
        checkpoints=cfg.checkpoint.save_folder,
    )


def _eval_sources(state) -> dict[str, dict[str, float]]:
    """Each eval stream's last loss and perplexity (from the EvalSources callback)."""
    for cb in state.callbacks:
        if isinstance(cb, EvalSources):
            return {name: v for name, v in cb.latest.items() if name != "total"}
    return {}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def print_summary(result: TrainResult) -> None:
    lines = [f"finished at step {result.step} ({result.tokens:,} tokens)"]
    if result.train_loss is not None:
        lines.append(f"  train loss       {result.train_loss:.4f}")
    if result.eval_loss is not None:
        lines.append(f"  eval loss        {result.eval_loss:.4f} (perplexity {result.eval_perplexity:.2f})")
    if len(result.eval_sources) > 1:
        for name, v in result.eval_sources.items():
            lines.append(f"    {name:<14} {v['loss']:.4f} (perplexity {v['perplexity']:.2f})")
    if result.samples:
        lines.append(result.samples)
    for path, label in [
        (result.loss_plot, "loss plot"),
        (result.metrics_file, "metrics"),
        (result.config, "config"),
        (result.checkpoints, "checkpoints"),
    ]:
        if path:
            lines.append(f"  {label:<16} {path}")
    print("\n".join(lines), file=sys.stdout, flush=True)
