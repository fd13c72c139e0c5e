"""Training throughput: our Composer trainer vs a plain PyTorch loop, interleaved in one process.

    python -m bench.train [--recipe recipes/demo.yaml] [--steps 10] [--rounds 3] [--warmup 3] [key=value ...]

Same model (seed), same data (the recipe's shards, same per-device batches), same loss (the
`LanguageModel` wrapper's forward and loss), same gradient clipping, same AdamW groups. The two
contenders take turns: after the warmup, each round times `--steps` steps of ours, then
`--steps` of the plain loop (A B A B ...), so load from other processes on a shared machine hits
both alike. Prints the best and the spread of tokens/s of both, their ratio (target >= 0.95), the
time the trainer waited for data as a share of step time (target <= 2%), and peak memory. A third
contender, the plain loop with documents kept apart (`model.attention=document`,
`model.positions=document`: on the CPU, SDPA with a boolean mask), takes its turn after the plain
loop in every round: its tokens/s against the plain loop's is what keeping documents apart costs
(target >= 0.8). A fourth, the plain loop with the plain loss head (`model.loss_chunk=0`: every
token's logits), takes its turn last: the chunked head's tokens/s against it (target >= 0.95). All
read through fresh stream caches, so the data wait includes copying each shard into the cache
and checking its hash (`data.validate_hash`, xxh64 by default); the cost of that check alone is
measured apart (the split read cold with and without it, in turns) and printed as a share of
step time. Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from composer.core import Callback

REPO = Path(__file__).resolve().parents[1]
DEMO_SHARDS = "data/demo/shards/train/index.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per contender per round")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (the best round counts)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each contender first")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        parser.error("--steps, --rounds and --warmup must each be at least 1")
    return args


DOCUMENTS = ["model.attention=document", "model.positions=document"]


def bench_config(args: argparse.Namespace, run_name: str = "bench-train", extra: list[str] = ()):
    """The recipe trimmed to a bare training run; `run_name` also names the stream cache folder."""
    from llm.config import load_config

    total = args.warmup + args.rounds * args.steps
    overrides = [
        "run_dir=/tmp/llm-bench-train",
        f"data.cache_root={tempfile.mkdtemp(prefix='llm-bench-cache-')}",  # cold: shards enter it
        f"run_name={run_name}",
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
        *extra,
    ]
    return load_config(REPO / args.recipe, overrides)


@dataclass
class Segment:
    """One contender's timed steps in one round."""

    step_seconds: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this process's CPU time: barely moved by other processes' load
    data_wait: float = 0.0
    peak_bytes: int = 0

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)


@dataclass
class Results:
    ours: list[Segment] = field(default_factory=list)
    plain: list[Segment] = field(default_factory=list)
    documents: list[Segment] = field(default_factory=list)  # the plain loop, documents apart
    unchunked: list[Segment] = field(default_factory=list)  # the plain loop, model.loss_chunk=0


def planned_microbatch(cfg, device: str) -> int:
    """The recipe's micro-batch on one device; 0 in the recipe: the plan's, as the trainer chooses it."""
    from llm.trainer import resolve_microbatch

    gpu = "gpu" if str(device).startswith("cuda") else "cpu"
    return resolve_microbatch(cfg, gpu, 1, announce=False).training.device_microbatch_size


class PlainLoop:
    """The reference: the same model, loss, clipping and optimizer in a bare loop."""

    def __init__(self, cfg, device: str, eos_id: int | None = None):
        from llm.composer_model import LanguageModel
        from llm.data import build_dataloader
        from llm.optim import build_optimizer
        from llm.trainer import documents_for

        self.device = device
        documents = documents_for(cfg, eos_id)  # None: causal over the window
        self.wrapper = LanguageModel.from_config(
            cfg.model, seed=cfg.seed, documents=documents, loss_chunk=cfg.model.loss_chunk
        ).to(device)
        self.wrapper.train()
        self.optimizer = build_optimizer(self.wrapper, cfg.optimizer)
        self.micro = planned_microbatch(cfg, device)
        self.clip = cfg.training.grad_clip_norm
        self.batches = iter(build_dataloader(cfg, "train", cfg.training.global_batch_size))

    def run(self, steps: int) -> Segment:
        _reset_peak(self.device)
        segment = Segment()
        for _ in range(steps):
            t0, cpu0 = time.perf_counter(), time.process_time()
            ids = next(self.batches)["input_ids"].to(self.device)
            segment.data_wait += time.perf_counter() - t0
            for chunk in ids.split(self.micro):
                batch = {"input_ids": chunk}
                loss = self.wrapper.loss(self.wrapper(batch), batch)
                (loss * chunk.shape[0] / ids.shape[0]).backward()
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.wrapper.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()  # Composer reads the loss every step too (and so syncs a GPU)
            segment.step_seconds.append(time.perf_counter() - t0)
            segment.cpu_seconds += time.process_time() - cpu0
        segment.peak_bytes = _peak(self.device)
        return segment


class Interleave(Callback):
    """Times our trainer's steps and, between rounds, runs the plain loop's segments.

    A step of ours is timed from the moment the previous step's BATCH_END returned control to
    Composer until this step's BATCH_END: all of Composer's work between steps counts, the plain
    loop's segments (run inside this callback) do not.
    """

    def __init__(
        self,
        plain: PlainLoop,
        documents: PlainLoop,
        unchunked: PlainLoop,
        warmup: int,
        steps: int,
        device: str,
    ):
        self.plain, self.warmup, self.steps, self.device = plain, warmup, steps, device
        self.documents, self.unchunked = documents, unchunked
        self.results = Results()
        self._done = 0
        self._resume = self._resume_cpu = 0.0
        self._before_data = 0.0
        self._segment = Segment()

    def fit_start(self, state, logger):
        self._resume, self._resume_cpu = time.perf_counter(), time.process_time()

    def before_dataloader(self, state, logger):
        self._before_data = time.perf_counter()

    def after_dataloader(self, state, logger):
        self._segment.data_wait += time.perf_counter() - self._before_data

    def batch_end(self, state, logger):
        _sync(self.device)
        now, cpu_now = time.perf_counter(), time.process_time()
        self._done += 1
        if self._done > self.warmup:
            self._segment.step_seconds.append(now - self._resume)
            self._segment.cpu_seconds += cpu_now - self._resume_cpu
        if self._done == self.warmup:
            self.plain.run(self.warmup)
            self.documents.run(self.warmup)
            self.unchunked.run(self.warmup)
            self._start_segment()
        elif self._done > self.warmup and self._segment.steps == self.steps:
            self._segment.peak_bytes = _peak(self.device)
            self.results.ours.append(self._segment)
            self.results.plain.append(self.plain.run(self.steps))
            self.results.documents.append(self.documents.run(self.steps))
            self.results.unchunked.append(self.unchunked.run(self.steps))
            self._start_segment()
        self._resume, self._resume_cpu = time.perf_counter(), time.process_time()

    def _start_segment(self) -> None:
        self._segment = Segment()
        _reset_peak(self.device)


def run_bench(args: argparse.Namespace, device: str) -> Results:
    from llm.data import all_stream_locals, check_streams, clean_stale_shared_memory, document_eos
    from llm.trainer import build_trainer

    cfg = bench_config(args)
    plain_cfg = bench_config(args, run_name="bench-train-plain")  # its own stream cache folder
    apart_cfg = bench_config(args, run_name="bench-train-documents", extra=DOCUMENTS)
    unchunked_cfg = bench_config(args, run_name="bench-train-unchunked", extra=["model.loss_chunk=0"])
    locals_ = [
        *all_stream_locals(plain_cfg),
        *all_stream_locals(apart_cfg),
        *all_stream_locals(unchunked_cfg),
    ]
    clean_stale_shared_memory(locals_)
    plain = PlainLoop(plain_cfg, device)
    documents = PlainLoop(apart_cfg, device, eos_id=document_eos(apart_cfg, check_streams(apart_cfg)))
    unchunked = PlainLoop(unchunked_cfg, device)
    clock = Interleave(plain, documents, unchunked, args.warmup, args.steps, device)
    trainer = build_trainer(cfg, extra_callbacks=[clock])
    try:
        trainer.fit()
    finally:
        trainer.close()
    return clock.results


def hash_check_seconds(args: argparse.Namespace, rounds: int = 3) -> tuple[float, float, int]:
    """Best seconds to read every train sample through a fresh cache with and without the hash
    check (in turns), and the number of samples."""
    from llm.data import build_dataset

    best = {"xxh64": float("inf"), "null": float("inf")}
    samples = 0
    for _ in range(rounds):
        for setting in best:
            cfg = bench_config(args, run_name=f"bench-hash-{setting}")
            cfg.data.validate_hash = None if setting == "null" else setting
            dataset = build_dataset(cfg, "train", cfg.training.global_batch_size)
            start = time.perf_counter()
            for i in range(dataset.num_samples):
                dataset[i]
            best[setting] = min(best[setting], time.perf_counter() - start)
            samples = dataset.num_samples
            del dataset
            gc.collect()
    return best["xxh64"], best["null"], samples


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device != "cpu" else 0


def peak_memory(device: str, segments: list[Segment]) -> str:
    if device != "cpu":
        return f"{max(s.peak_bytes for s in segments) / 2**30:.2f} GiB GPU"
    # The CPU has no per-contender peak: both live in this process.
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB host RSS (process, both)"


def ensure_demo_data(cfg) -> None:
    if cfg.data.train[0].remote == "data/demo/shards/train" and not (REPO / DEMO_SHARDS).exists():
        print("building the demo shards first (make data/demo/shards/train/index.json) ...", flush=True)
        subprocess.run(["make", DEMO_SHARDS], cwd=REPO, check=True)


def report(args: argparse.Namespace, cfg, device: str, results: Results, hashing: tuple) -> str:
    tokens_per_step = cfg.training.global_batch_size * cfg.model.max_seq_len

    def tps(s: Segment) -> float:
        return s.steps * tokens_per_step / s.seconds

    def fastest_step(segments: list[Segment]) -> float:
        return tokens_per_step / min(t for s in segments for t in s.step_seconds)

    def line(label: str, segments: list[Segment]) -> str:
        rates = [tps(s) for s in segments]
        best, worst = max(rates), min(rates)
        return (
            f"  {label:<24} {best:>10,.0f} tokens/s best round   spread {(best - worst) / best:>6.1%}   "
            f"fastest step {fastest_step(segments):>10,.0f}   peak {peak_memory(device, segments)}"
        )

    best_ours = max(tps(s) for s in results.ours)
    best_plain = max(tps(s) for s in results.plain)
    best_apart = max(tps(s) for s in results.documents)
    apart_pairs = [tps(a) / tps(b) for a, b in zip(results.documents, results.plain, strict=True)]
    step_ratio = fastest_step(results.ours) / fastest_step(results.plain)
    best_unchunked = max(tps(s) for s in results.unchunked)
    chunk_pairs = [tps(a) / tps(b) for a, b in zip(results.plain, results.unchunked, strict=True)]

    def per_cpu_second(segments: list[Segment]) -> float:
        return sum(s.steps for s in segments) * tokens_per_step / sum(s.cpu_seconds for s in segments)

    cpu_ratio = per_cpu_second(results.ours) / per_cpu_second(results.plain)
    pairs = [tps(a) / tps(b) for a, b in zip(results.ours, results.plain, strict=True)]
    wait = sum(s.data_wait for s in results.ours) / sum(s.seconds for s in results.ours)
    plain_wait = sum(s.data_wait for s in results.plain) / sum(s.seconds for s in results.plain)
    with_hash, without_hash, samples = hashing
    step_seconds = sum(s.seconds for s in results.ours) / sum(s.steps for s in results.ours)
    hash_share = max(0.0, with_hash - without_hash) / samples * cfg.training.global_batch_size / step_seconds
    return (
        f"\nbench-train: {args.recipe}, {cfg.training.global_batch_size} x {cfg.model.max_seq_len} tokens "
        f"per step, micro-batch {planned_microbatch(cfg, device)}, {args.rounds} rounds of "
        f"{args.steps} timed steps per contender (interleaved) on {device}, "
        f"{torch.get_num_threads()} torch threads\n"
        f"{line('ours (Composer trainer)', results.ours)}\n"
        f"{line('plain PyTorch loop', results.plain)}\n"
        f"{line('plain, documents apart', results.documents)}\n"
        f"{line('plain, loss unchunked', results.unchunked)}\n"
        f"  ratio ours / plain       {best_ours / best_plain:>10.3f}   best vs best (target >= 0.95); "
        f"per round: {', '.join(f'{r:.3f}' for r in pairs)}\n"
        f"  ratio, fastest steps     {step_ratio:>10.3f}   (the least disturbed step of each)\n"
        f"  documents apart / causal {best_apart / best_plain:>10.3f}   plain loops, best vs best (target >= 0.8); "
        f"per round: {', '.join(f'{r:.3f}' for r in apart_pairs)}; fastest steps "
        f"{fastest_step(results.documents) / fastest_step(results.plain):.3f}; CPU time "
        f"{per_cpu_second(results.documents) / per_cpu_second(results.plain):.3f}\n"
        f"  loss chunked / unchunked {best_plain / best_unchunked:>10.3f}   plain loops, model.loss_chunk="
        f"{cfg.model.loss_chunk} vs 0, best vs best (target >= 0.95); per round: "
        f"{', '.join(f'{r:.3f}' for r in chunk_pairs)}; fastest steps "
        f"{fastest_step(results.plain) / fastest_step(results.unchunked):.3f}; CPU time "
        f"{per_cpu_second(results.plain) / per_cpu_second(results.unchunked):.3f}\n"
        f"  ratio, CPU time          {cpu_ratio:>10.3f}   tokens per CPU-second of this process "
        f"(ours {per_cpu_second(results.ours):,.0f}, plain {per_cpu_second(results.plain):,.0f})\n"
        f"  data wait, ours          {wait:>10.2%}   of step time (target <= 2%)\n"
        f"  data wait, plain         {plain_wait:>10.2%}\n"
        f"  hash check (xxh64)       {hash_share:>10.2%}   of step time: {samples} samples read cold in "
        f"{with_hash:.3f} s with it, {without_hash:.3f} s without (data.validate_hash=null)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = bench_config(args)
    ensure_demo_data(cfg)
    from llm.trainer import resolve_device

    device = "cuda" if resolve_device(cfg) == "gpu" else "cpu"
    results = run_bench(args, device)
    hashing = hash_check_seconds(args)
    print(report(args, cfg, device, results, hashing), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
