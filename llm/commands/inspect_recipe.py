"""`llm inspect RECIPE [key=value ...] [--gpus N] [--gpu-gb GB]`: the dry run of a recipe.

Builds the model on the meta device (nothing allocated, no data read) and prints its parameters,
training FLOPs per token, tokens per optimizer step, the length of the run, and the memory plan
per GPU under FSDP full sharding (`llm.memory_plan.describe_run`, as `train.py --dry-run`).
"""

from __future__ import annotations

import argparse

from llm.config import load_config
from llm.memory_plan import DEFAULT_GPU_GB, DEFAULT_GPUS, describe_run


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
    print(describe_run(load_config(args.recipe, args.overrides), args.gpus, args.gpu_gb))
    return 0
