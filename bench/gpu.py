"""One-GPU training throughput: `python -m bench.gpu` (or `make bench-gpu`) on an H100/H200.

Trains a few dozen steps of two models in bf16 (autocast, fp32 master weights, fused AdamW, grad
clipping: the recipe's step without the data loader) and prints, with torch.compile off and on:
tokens/s, model TFLOP/s, MFU against 989 TFLOP/s (dense bf16 of an H100/H200 SXM, Composer's
table) and peak GPU memory.

- tiny:     recipes/tiny.yaml's model (baby-llama2-chinese, 58.5 M parameters), 32 x 512 tokens
- 7b-slice: Baichuan-7B's layer shape (hidden 4096, 32 heads, SwiGLU 11,008, vocab 64,000,
            4096-token context) with as many layers as the memory plan fits on this GPU (at most
            8, so the whole bench stays within about 8 minutes on an H200)

Tokens are synthetic (uniform random ids): throughput does not depend on their values, and the
bench then needs no shards. FLOPs per token are the model's own count (6N plus attention, the
PaLM / llm-foundry convention), so MFU compares with llm-foundry's 46.4% (MPT-7B, 2048 tokens, 8
H100) and torchtitan's 33.7-39% (Llama-3-8B). `--smoke` runs tiny shapes on the CPU in fp32 for a
few steps, without compile: the test suite runs it so the script cannot rot.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from llm.meta_init import build_meta_model
from llm.model import ModelConfig, Transformer

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 (Composer's GPU table: 989.5 TFLOP/s)
MAX_SLICE_LAYERS = 8
ROOT = Path(__file__).resolve().parents[1]

SLICE_SHAPE = ModelConfig(
    vocab_size=64000, dim=4096, n_layers=1, n_heads=32, hidden_dim=11008, max_seq_len=4096, norm_eps=1e-6
)
# The smoke run keeps the 7B slice's proportions (hidden ~2.7 x dim, 128-wide heads) at toy size.
SMOKE_SLICE_SHAPE = ModelConfig(
    vocab_size=512, dim=128, n_layers=1, n_heads=1, hidden_dim=344, max_seq_len=64, norm_eps=1e-6
)
SMOKE_MEMORY_BYTES = 16 * 2**20
SMOKE_TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=True)


@dataclass
class Case:
    name: str
    cfg: ModelConfig
    micro_batch: int


@dataclass
class Result:
    case: str
    compile: bool
    layers: int
    params: int
    micro_batch: int
    seq_len: int
    steps: int
    tokens_per_s: float
    tflops_per_s: float
    mfu: float | None  # None off GPU: no peak to compare with
    peak_memory_gib: float | None
    first_loss: float
    last_loss: float
    error: str | None = None


# --- which models ---------------------------------------------------------------------------


def tiny_case() -> Case:
    from llm.config import load_config

    cfg = load_config(ROOT / "recipes" / "tiny.yaml")
    return Case("tiny", cfg.model, cfg.training.device_microbatch_size)


def slice_layers_that_fit(shape: ModelConfig, micro_batch: int, memory_bytes: float, cap: int) -> int:
    """Most layers (<= cap) whose one-GPU training memory, per the memory plan, fits `memory_bytes`.

    One GPU, no sharding, no activation checkpointing: fp32 weights, gradients and AdamW state
    (16 bytes a parameter) plus bf16 activations and the loss head.
    """
    from llm.memory_plan import plan_memory

    best = 0
    for layers in range(1, cap + 1):
        plan = plan_memory(
            replace(shape, n_layers=layers),
            n_gpus=1,
            micro_batch=micro_batch,
            seq_len=shape.max_seq_len,
            activation_checkpointing=False,
        )
        if plan.fits(memory_bytes, reserve_fraction=0.15):
            best = layers
    if best == 0:
        raise SystemExit(f"error: not even one 7B-shaped layer fits {memory_bytes / 2**30:.0f} GiB")
    return best


def slice_case(shape: ModelConfig, micro_batch: int, memory_bytes: float, cap: int) -> Case:
    layers = slice_layers_that_fit(shape, micro_batch, memory_bytes, cap)
    return Case("7b-slice", replace(shape, n_layers=layers), micro_batch)


# --- one measurement --------------------------------------------------------------------------


def build_model(cfg: ModelConfig, device: torch.device) -> Transformer:
    """Allocate straight on the device with a quick normal fill: values do not change the speed,
    and drawing 2 B parameters on the host (the reproducible init) would cost a minute."""
    model = build_meta_model(cfg, seed=0).to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, cfg.init_std)
    model.tie_weights()
    return model


def train_steps(case: Case, device: torch.device, bf16: bool, compiled: bool, steps: int, warmup: int):
    """Run `warmup` then `steps` timed steps; returns (seconds, losses)."""
    model = build_model(case.cfg, device)
    forward = torch.compile(model) if compiled else model
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused
    )
    seq, vocab = case.cfg.max_seq_len, case.cfg.vocab_size
    losses = []

    def step() -> None:
        tokens = torch.randint(0, vocab, (case.micro_batch, seq + 1), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(warmup):  # compilation, autotuning, allocator warm-up
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = time.perf_counter() - start
    return seconds, [float(x) for x in losses], model


def measure(case: Case, device: torch.device, bf16: bool, compiled: bool, steps: int, warmup: int) -> Result:
    _reset(device)
    seq = case.cfg.max_seq_len
    try:
        seconds, losses, model = train_steps(case, device, bf16, compiled, steps, warmup)
    except torch.cuda.OutOfMemoryError as err:
        return _failed(case, compiled, steps, f"out of memory: {str(err).splitlines()[0]}")
    tokens_per_s = case.micro_batch * seq * steps / seconds
    flops = model.flops_per_token(seq) * tokens_per_s
    on_gpu = device.type == "cuda"
    result = Result(
        case=case.name,
        compile=compiled,
        layers=case.cfg.n_layers,
        params=model.num_params(),
        micro_batch=case.micro_batch,
        seq_len=seq,
        steps=steps,
        tokens_per_s=tokens_per_s,
        tflops_per_s=flops / 1e12,
        mfu=flops / PEAK_BF16_FLOPS if on_gpu else None,
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
        first_loss=losses[0],
        last_loss=losses[-1],
    )
    del model
    return result


def _failed(case: Case, compiled: bool, steps: int, error: str) -> Result:
    nan = math.nan
    return Result(case.name, compiled, case.cfg.n_layers, 0, case.micro_batch, case.cfg.max_seq_len, steps,
                  nan, nan, None, None, nan, nan, error)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset(device: torch.device) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:  # importing dynamo costs seconds: only when compile ran
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32, 3 steps, no compile")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 30; smoke 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5; smoke 1)")
    parser.add_argument("--compile", choices=["off", "on", "both"], help="default both; smoke off")
    parser.add_argument("--cases", default="tiny,7b-slice", help="comma-separated: tiny, 7b-slice")
    parser.add_argument("--slice-batch", type=int, default=4, help="7b-slice micro-batch (x 4096 tokens)")
    parser.add_argument("--max-layers", type=int, default=MAX_SLICE_LAYERS, help="cap on 7b-slice layers")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.steps = args.steps or (3 if smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 5)
    args.compile = args.compile or ("off" if smoke else "both")
    return args


def plan_cases(args: argparse.Namespace, device: torch.device) -> list[Case]:
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = set(names) - {"tiny", "7b-slice"}
    if unknown:
        raise SystemExit(f"error: unknown case {', '.join(sorted(unknown))}; choose from tiny, 7b-slice")
    cases = []
    for name in names:
        if name == "tiny":
            cases.append(Case("tiny", SMOKE_TINY, 2) if args.smoke else tiny_case())
        elif args.smoke:  # a pretend small device: exercises the layer fitting at toy size
            cases.append(slice_case(SMOKE_SLICE_SHAPE, 2, SMOKE_MEMORY_BYTES, args.max_layers))
        else:
            memory = torch.cuda.get_device_properties(device).total_memory
            cases.append(slice_case(SLICE_SHAPE, args.slice_batch, memory, args.max_layers))
    return cases


def pick_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU visible; run on an H100/H200, or pass --smoke for the CPU check")
    return torch.device("cuda", torch.cuda.current_device())


def format_row(r: Result) -> str:
    if r.error:
        return f"{r.case:<9} {'on' if r.compile else 'off':<7} {r.layers:>6}  {r.error}"
    mfu = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "   n/a"
    mem = f"{r.peak_memory_gib:7.1f}" if r.peak_memory_gib is not None else "    n/a"
    return (
        f"{r.case:<9} {'on' if r.compile else 'off':<7} {r.layers:>6} {r.params / 1e6:>9.1f} "
        f"{r.micro_batch:>3}x{r.seq_len:<5} {r.tokens_per_s:>11,.0f} {r.tflops_per_s:>9.2f} {mfu:>6} "
        f"{mem} {r.first_loss:>7.3f} {r.last_loss:>7.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.smoke)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke: fp32)"
    print(f"device: {name}; torch {torch.__version__}; {args.steps} timed steps after {args.warmup}")
    print("tokens are synthetic (uniform random ids); MFU against 989 TFLOP/s dense bf16\n")
    header = "case      compile layers  params(M) batch     tokens/s   TFLOP/s    MFU  peakGiB  loss0  lossN"
    print(header)
    compile_modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results = []
    for case in plan_cases(args, device):
        for compiled in compile_modes:
            result = measure(case, device, not args.smoke, compiled, args.steps, args.warmup)
            results.append(result)
            print(format_row(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
