"""`llm inspect RECIPE [key=value ...] [--gpus N] [--gpu-gb GB]`: the dry run of a recipe.

Builds the model on the meta device (nothing allocated, no data read) and prints its parameters,
training FLOPs per token, tokens per optimizer step, the length of the run, and the memory plan
per GPU under the recipe's sharding (FSDP2 or HSDP), and the run's wall time and GPU-hours on
`--gpus` GPUs of `--gpu-type` at `--mfu`, and what a checkpoint costs: bytes per rank and in
total, its save time at `--upload-bandwidth` / `--disk-bandwidth` per node, whether a SIGTERM save
fits a 30 s and a 120 s notice, and the save interval that keeps the stall under 1%
(`llm.memory_plan.describe_run`, as `train.py --dry-run`).
"""

from __future__ import annotations

import argparse

from llm.checkpoint.sizes import DEFAULT_DISK_BANDWIDTH, DEFAULT_SNAPSHOT_BANDWIDTH, DEFAULT_UPLOAD_BANDWIDTH
from llm.config import load_config
from llm.memory_plan import (
    DEFAULT_GPU_GB,
    DEFAULT_GPU_TYPE,
    DEFAULT_GPUS,
    MAX_GPU_GB,
    MAX_GPUS,
    PEAK_BF16_FLOPS,
    describe_run,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/7b.yaml")
    parser.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. training.device_microbatch_size=2"
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=DEFAULT_GPUS,
        help=f"GPUs to plan for, 1 to {MAX_GPUS:,} (default {DEFAULT_GPUS})",
    )
    parser.add_argument(
        "--gpu-gb",
        type=float,
        default=DEFAULT_GPU_GB,
        help=f"memory per GPU in GB, at most {MAX_GPU_GB:g} (default {DEFAULT_GPU_GB:g})",
    )
    add_cost_arguments(parser)


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """`--gpu-type`, `--mfu` and the bandwidths, for the run's and its checkpoints' cost (shared
    with `train.py --dry-run`)."""
    parser.add_argument(  # checked by describe_run, so that a wrong one is one line like the rest
        "--gpu-type",
        default=DEFAULT_GPU_TYPE,
        help=f"GPU model for the cost estimate: {', '.join(sorted(PEAK_BF16_FLOPS))} (default {DEFAULT_GPU_TYPE})",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        help="measured MFU as a fraction from 0.01 to 1 (e.g. 0.45 from make gpu-check); default: 40%% and 50%%",
    )
    parser.add_argument(
        "--upload-bandwidth",
        default=DEFAULT_UPLOAD_BANDWIDTH,
        help="a node's upload rate to the checkpoint store, a size per second from 1MB/s to 1TB/s "
        f"(default {DEFAULT_UPLOAD_BANDWIDTH}: 10 Gbit/s)",
    )
    parser.add_argument(
        "--disk-bandwidth",
        default=DEFAULT_DISK_BANDWIDTH,
        help="a node's local disk write rate for a save, a size per second from 1MB/s to 1TB/s "
        f"(default {DEFAULT_DISK_BANDWIDTH})",
    )
    parser.add_argument(
        "--snapshot-bandwidth",
        default=DEFAULT_SNAPSHOT_BANDWIDTH,
        help="one GPU's device-to-host copy rate into pinned memory while all copy, a size per second "
        f"(default {DEFAULT_SNAPSHOT_BANDWIDTH}; make gpu-check measures it)",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    print(
        describe_run(
            cfg,
            args.gpus,
            args.gpu_gb,
            gpu_type=args.gpu_type,
            mfu=args.mfu,
            upload_bandwidth=args.upload_bandwidth,
            disk_bandwidth=args.disk_bandwidth,
            snapshot_bandwidth=args.snapshot_bandwidth,
        )
    )
    return 0
