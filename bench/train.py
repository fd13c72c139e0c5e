"""Training throughput: our Composer trainer vs a plain PyTorch loop, side by side in one process.

    python -m bench.train [--recipe recipes/demo.yaml] [--steps 30] [--warmup 5] [key=value ...]

Same model (seed), same data (the recipe's shards, same per-device batches), same AdamW groups.
Prints tokens/s of both, their ratio (target >= 0.95), the time the trainer waited for data as
a share of step time (target <= 2%), and peak memory. Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from composer.core import Callback

REPO = Path(__file__).resolve().parents[1]
DEMO_SHARDS = "data/demo/shards/train/index.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def bench_config(args: argparse.Namespace):
    from llm.config import load_config

    total = args.steps + args.warmup
    overrides = [
        "run_dir=/tmp/llm-bench-train",
        "run_name=bench-train",
        "data.eval=[]",
        f"training.max_duration={total}ba",
        "scheduler.warmup=1ba",
        "checkpoint.save_folder=null",
        "callbacks.generate.enabled=false",
        "callbacks.loss_plot=false",
        "loggers.metrics_file=false",
        "loggers.progress_bar=false",
        f"training.log_interval={total}",
        *args.overrides,
    ]
    return load_config(REPO / args.recipe, overrides)


class StepClock(Callback):
    """Wall time of each step and the part of it spent waiting for the dataloader."""

    def __init__(self):
        self.step_ends: list[float] = []
        self.data_wait: list[float] = []
        self._before = 0.0

    def before_dataloader(self, state, logger):
        self._before = time.perf_counter()

    def after_dataloader(self, state, logger):
        self.data_wait.append(time.perf_counter() - self._before)

    def batch_end(self, state, logger):
        self.step_ends.append(time.perf_counter())


def run_ours(cfg, warmup: int) -> dict:
    from llm.trainer import build_trainer

    clock = StepClock()
    trainer = build_trainer(cfg, extra_callbacks=[clock])
    trainer.fit()
    trainer.close()
    timed = clock.step_ends[warmup - 1 :]
    seconds = timed[-1] - timed[0]
    steps = len(timed) - 1
    wait = sum(clock.data_wait[warmup:])
    return {"seconds": seconds, "steps": steps, "data_wait": wait}


def run_plain(cfg, warmup: int, steps: int, device: str) -> dict:
    """The reference: the same model, data and optimizer in a bare loop."""
    from llm.composer_model import LanguageModel
    from llm.data import all_stream_locals, build_dataloader, clean_stale_shared_memory
    from llm.optim import build_optimizer

    clean_stale_shared_memory(all_stream_locals(cfg))
    loader = build_dataloader(cfg, "train", cfg.training.global_batch_size)
    model = LanguageModel.from_config(cfg.model, seed=cfg.seed).model.to(device)
    optimizer = build_optimizer(model, cfg.optimizer)
    micro = cfg.training.device_microbatch_size
    batches = iter(loader)
    start = wait = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start, wait = time.perf_counter(), 0.0
        t0 = time.perf_counter()
        ids = next(batches)["input_ids"].to(device)
        wait += time.perf_counter() - t0
        for chunk in ids.split(micro):
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
            (loss * chunk.shape[0] / ids.shape[0]).backward()
        if cfg.training.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # Composer reads the loss every step too
    _sync(device)
    return {"seconds": time.perf_counter() - start, "steps": steps, "data_wait": wait}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def peak_memory(device: str) -> str:
    if device != "cpu":
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return f"{peak:.2f} GiB GPU"
    return (
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB host RSS (process peak so far)"
    )


def ensure_demo_data(cfg) -> None:
    if cfg.data.train[0].remote == "data/demo/shards/train" and not (REPO / DEMO_SHARDS).exists():
        print("building the demo shards first (make data/demo/shards/train/index.json) ...", flush=True)
        subprocess.run(["make", DEMO_SHARDS], cwd=REPO, check=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = bench_config(args)
    ensure_demo_data(cfg)
    from llm.trainer import resolve_device

    device = "cuda" if resolve_device(cfg) == "gpu" else "cpu"
    tokens_per_step = cfg.training.global_batch_size * cfg.model.max_seq_len
    ours = run_ours(cfg, args.warmup)
    ours_mem = peak_memory(device)
    plain = run_plain(cfg, args.warmup, args.steps, device)
    plain_mem = peak_memory(device)

    def tps(r: dict) -> float:
        return r["steps"] * tokens_per_step / r["seconds"]

    ratio = tps(ours) / tps(plain)
    wait_share = ours["data_wait"] / ours["seconds"]
    print(
        f"\nbench-train: {args.recipe}, {cfg.training.global_batch_size} x {cfg.model.max_seq_len} tokens "
        f"per step, micro-batch {cfg.training.device_microbatch_size}, {args.steps} timed steps on {device}\n"
        f"  ours (Composer trainer)  {tps(ours):>12,.0f} tokens/s   peak {ours_mem}\n"
        f"  plain PyTorch loop       {tps(plain):>12,.0f} tokens/s   peak {plain_mem}\n"
        f"  ratio ours / plain       {ratio:>12.3f}   (target >= 0.95)\n"
        f"  data wait, ours          {wait_share:>12.2%}   of step time (target <= 2%)\n"
        f"  data wait, plain         {plain['data_wait'] / plain['seconds']:>12.2%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
