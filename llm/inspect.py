"""Dry run of a recipe: `llm inspect RECIPE [key=value ...] [--gpus N]` or `train.py RECIPE --dry-run`.

Builds the model on the meta device (nothing allocated, no data read) and prints its parameters,
training FLOPs per token, tokens per optimizer step, the length of the run, and the memory plan
per GPU under FSDP full sharding for N GPUs.
"""

from __future__ import annotations

import argparse

from llm.errors import ConfigError

DEFAULT_GPUS = 8
DEFAULT_GPU_GB = 80.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/7b.yaml")
    parser.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. training.device_microbatch_size=2"
    )
    parser.add_argument(
        "--gpus", type=int, default=DEFAULT_GPUS, help=f"GPUs to plan for (default {DEFAULT_GPUS})"
    )
    parser.add_argument(
        "--gpu-gb",
        type=float,
        default=DEFAULT_GPU_GB,
        help=f"memory per GPU in GB (default {DEFAULT_GPU_GB:g})",
    )


def run(args: argparse.Namespace) -> int:
    from llm.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    gpus = args.gpus
    if gpus <= 0:
        raise ConfigError(f"--gpus must be a positive number of GPUs, got {gpus}")
    print(report(cfg, gpus, getattr(args, "gpu_gb", DEFAULT_GPU_GB)))
    return 0


def report(cfg, gpus: int, gpu_gb: float) -> str:
    """The dry-run text for `cfg` (a TrainConfig) on `gpus` GPUs of `gpu_gb` GB each."""
    from llm.memory_plan import describe, plan_memory
    from llm.optim import duration_in_batches

    t = cfg.training
    seq_len = cfg.model.max_seq_len
    tokens_per_step = t.global_batch_size * seq_len
    summary = describe(cfg.model, seq_len, tokens_per_step)
    steps = (
        duration_in_batches(t.max_duration, tokens_per_step) if not t.max_duration.endswith("ep") else None
    )
    lines = [f"recipe {cfg.run_name}: model built on the meta device (nothing allocated)", summary.format()]
    lines += _batch_lines(cfg, gpus)
    if steps is not None:
        lines.append(
            f"  run length                  {steps:>16,} steps = {steps * tokens_per_step:,} tokens, "
            f"{steps * summary.flops_per_step:.4g} FLOPs"
        )
    plan = plan_memory(
        cfg.model,
        n_gpus=gpus,
        micro_batch=t.device_microbatch_size,
        seq_len=seq_len,
        compute="fp32" if t.precision == "fp32" else "bf16",
        activation_checkpointing=cfg.fsdp.enabled and cfg.fsdp.activation_checkpointing,
    )
    lines += ["", plan.format(gpu_gb)]
    verdict = "fits" if plan.fits(gpu_gb * 1e9) else "does NOT fit"
    lines.append(f"=> this recipe {verdict} on {gpus} x {gpu_gb:g} GB GPUs")
    return "\n".join(lines)


def _batch_lines(cfg, gpus: int) -> list[str]:
    t = cfg.training
    try:
        per_gpu = cfg.check_world_size(gpus)
    except ConfigError as err:
        return [f"  batch                       does not divide over {gpus} GPUs: {err}"]
    accum = per_gpu // t.device_microbatch_size
    return [
        f"  batch per GPU               {per_gpu:>16,} samples = {accum} micro-batch(es) of "
        f"{t.device_microbatch_size} x {cfg.model.max_seq_len} tokens"
    ]
