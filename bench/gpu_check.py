"""The GPU acceptance run of the real trainer: `make gpu-check` (one H100/H200, under 8 minutes).

Every figure comes from `train.py`'s own code path (`llm.trainer.build_trainer`, FSDP2, the
recipe's precision), each check in its own process, and the script ends with one table:

- tiny:       recipes/tiny.yaml (58.5 M parameters, 32 x 512 tokens a step, bf16, FSDP2 on one
              GPU) for a few hundred steps over synthetic shards: tokens/s, MFU, the share of
              step time spent waiting for the data loader, peak GPU memory; compile off and on.
              Target >= 600,000 tokens/s on one H200 (the seed's blog: 136 M tokens in 15
              minutes on an A100, about 151,000 tokens/s).
- 7b-slice:   recipes/7b.yaml at full width (hidden 4096, 32 heads, SwiGLU 11,008, vocab
              64,000, 4096 tokens, micro-batch 4) with as many layers as the dry-run memory plan
              fits on this GPU (at most 8, to stay within time), FSDP2 with meta-device init:
              MFU and peak memory against the plan's prediction (the ratio). Target MFU >= 50%
              (llm-foundry 46.4% for MPT-7B on 8 x H100 at 2048 tokens; torchtitan 33.7-39%).
              The loss head is the recipes' chunked one (model.loss_chunk); one row runs the plain
              head (every token's logits) beside the selective row: its peak and tokens/s.
- 7b-init:    the full 7B recipe's trainer built on this GPU host (meta device, each parameter
              materialised on the GPU): host memory, against the plan's 4 bytes x the largest
              parameter (0.98 GiB; an ordinary build needs 26 GiB).
- resume:     a save, SIGTERM and resume of the tiny recipe, compared bit for bit with an
              uninterrupted run (the CPU soak's check: scenarios/resume.py), fewer steps.
- generation: the generation callback in that uninterrupted run, on the GPU.
- documents:  the tiny recipe and the 7b-slice (AC selective, the 7B recipe's policy) with documents
              kept apart (model.attention=document, positions restarting: FlexAttention over a
              block mask) against the same runs causal: tokens/s, MFU, peak memory. The shards'
              documents average a quarter of the window (an EOS opens each); MFU counts the causal
              window's FLOPs for both, so its ratio is the tokens/s ratio.
- kernels:    the GPU's kernel for documents (FlexAttention, compiled) against the CPU's (SDPA with
              a boolean mask) on the same GPU, 4,095-token rows: loss and gradient differences.
- snapshot:   the device-to-host rate of a checkpoint's snapshot (llm/checkpoint/saver.py's
              `HostStager`: pinned host buffers allocated once and reused) for 4 GiB of state, the
              stall of a save; against the 7B's 10.5 GB per rank in <= 2 s (issue 32). One GPU
              alone: on an 8-GPU node two GPUs share a PCIe link to the host, so the dry run's
              `--snapshot-bandwidth` should take about half of this figure.

Tokens are uniform random ids written as real MDS shards (speed does not depend on their values),
with an EOS opening a document every seq_len / 4 tokens on average (geometric lengths).
The tokenizer (for generation only) is trained on the repository's own documentation.

`--smoke` runs the same checks on the CPU at toy sizes (fp32, no compile, a few steps; the test
suite runs it so the script cannot rot). `--json FILE` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from llm.config import ModelSection
from llm.memory_plan import DEFAULT_GPU_GB, PEAK_BF16_FLOPS, Blocks, auto_checkpointing, plan_memory
from llm.model import ModelConfig
from scenarios import resume as rs

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("gpu_check_driver.py")
TINY_TARGET_TOKENS_PER_S = 600_000
SLICE_TARGET_MFU = 0.50
BUDGET_SECONDS = 480  # the whole check on one H200: 8 minutes
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """How big and how long each check is: the GPU run, or the CPU smoke run."""

    smoke: bool
    tiny_model: list[str]  # overrides of recipes/tiny.yaml's model and batch (none on the GPU)
    tiny_steps: int
    tiny_warmup: int
    slice_shape: ModelConfig
    slice_batch: int
    slice_steps: int
    slice_warmup: int
    max_layers: int
    init_model: list[str]  # overrides of recipes/7b.yaml's model for the init check (none on the GPU)
    resume_steps: int
    snapshot_bytes: int  # the state a snapshot copies to host memory
    resume_save_every: int
    resume_stop: int
    generate_tokens: int
    compile_modes: tuple[bool, ...]


GPU = Sizes(
    smoke=False,
    tiny_model=[],
    tiny_steps=300,
    tiny_warmup=30,
    slice_shape=ModelConfig(
        vocab_size=64000, dim=4096, n_layers=1, n_heads=32, hidden_dim=11008, max_seq_len=4096, norm_eps=1e-6
    ),
    slice_batch=4,
    slice_steps=10,
    slice_warmup=3,
    max_layers=8,
    init_model=[],
    resume_steps=40,
    snapshot_bytes=4 * GIB,
    resume_save_every=10,
    resume_stop=15,
    generate_tokens=32,
    compile_modes=(False, True),
)
SMOKE_TINY = ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
              "training.global_batch_size=4", "training.device_microbatch_size=4"]  # fmt: skip
SMOKE = Sizes(
    smoke=True,
    tiny_model=SMOKE_TINY,
    tiny_steps=3,
    tiny_warmup=1,
    # The slice's proportions (hidden ~2.7 x dim, 128-wide heads) at toy size.
    slice_shape=ModelConfig(
        vocab_size=512, dim=128, n_layers=1, n_heads=1, hidden_dim=344, max_seq_len=64, norm_eps=1e-6
    ),
    slice_batch=2,
    slice_steps=2,
    slice_warmup=1,
    max_layers=8,
    init_model=[
        "model.vocab_size=512",
        "model.dim=128",
        "model.n_layers=2",
        "model.n_heads=1",
        "model.hidden_dim=344",
        "model.max_seq_len=64",
        "training.precision=auto",
    ],
    resume_steps=6,
    snapshot_bytes=16 * 2**20,
    resume_save_every=2,
    resume_stop=3,
    generate_tokens=8,
    compile_modes=(False,),
)
SNAPSHOT_TARGET_SECONDS = 2.0  # the 7B's 10.5 GB per rank (8 GPUs, sharded) in at most this
SEVEN_B_BYTES_PER_RANK = 12 * 7_000_559_616 / 8
SMOKE_MEMORY_BYTES = 24 * 2**20  # a pretend device, so the smoke run fits some layers, not all


@dataclass
class Row:
    check: str
    setting: str
    result: str = ""
    target: str = ""
    ok: bool | None = None  # None: no verdict (smoke, or no target)
    error: str | None = None
    figures: dict = field(default_factory=dict)


# --- inputs ----------------------------------------------------------------------------------


def write_tokenizer(out: Path) -> Path:
    """A small SentencePiece model trained on the repository's Markdown (for generation only)."""
    from convert.tokens.tokenizer import train_tokenizer

    if out.exists():
        return out
    files = [REPO / "README.md", REPO / "shards" / "FORMAT.md", *sorted((REPO / "docs").glob("*.md"))]
    texts = [p.read_text(encoding="utf-8") for p in files if p.exists()]
    train_tokenizer(texts, vocab_size=512, out=str(out))
    return out


EOS_ID = 2  # the synthetic shards' EOS: it opens each document


def write_token_shards(split: Path, samples: int, seq_len: int, vocab: int, tokenizer: Path) -> Path:
    """`samples` uniform random token samples as an MDS split with its meta.json (shards/FORMAT.md),
    documents of seq_len / 4 tokens on average, an EOS between two."""
    from shards.meta import SplitMeta, now
    from shards.writer import write_token_split
    from storage import open_store

    if (split / "index.json").exists():
        return split
    rng = np.random.default_rng(0)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    tokens = rng.integers(EOS_ID + 1, vocab, size=(samples, seq_len), dtype=dtype)
    tokens[rng.random(size=tokens.shape) < 4 / seq_len] = EOS_ID
    documents = int((tokens == EOS_ID).sum()) + 1
    rows = (tokens[i : i + 1] for i in range(samples))
    meta = SplitMeta(
        split="train", seq_len=seq_len, dtype=dtype, vocab_size=vocab, eos_id=EOS_ID, bos_id=1, add_bos=False,
        tokenizer_sha256=_sha256(tokenizer), num_samples=samples, num_tokens=samples * seq_len,
        num_documents=documents, dropped={}, created_at=now(), command="bench.gpu_check",
    )  # fmt: skip
    write_token_split(open_store(split), rows, meta, size_limit=1 << 26)
    return split


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def common_overrides(work: Path, name: str, shards: Path, tokenizer: Path, device: str) -> list[str]:
    """A bare, local run: no eval, no checkpoints (so no guard: it rolls back to one), no plots,
    its own run and cache folders."""
    return [
        f"run_name={name}",
        f"run_dir={work / 'runs' / name}",
        f"tokenizer.path={tokenizer}",
        f"data.train=[{{remote: {shards}}}]",
        "data.eval=[]",
        f"data.cache_root={work / 'cache' / name}",
        "checkpoint.save_folder=null",
        "guard.enabled=false",
        "callbacks.generate.enabled=false",
        "callbacks.loss_plot=false",
        "loggers.metrics_file=false",
        "loggers.progress_bar=false",
        "training.log_interval=1000",
        "scheduler.warmup=1ba",
        f"training.device={device}",
    ]


# --- one training process ---------------------------------------------------------------------


@dataclass
class Budget:
    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def train_probe(recipe: str, overrides: list[str], warmup: int, work: Path, tag: str, timeout: float) -> dict:
    """Run the real trainer with the probe; returns the probe's figures (raises with the log's tail)."""
    out = work / f"{tag}.probe.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "LLM_GPU_CHECK_PROBE": str(out), "LLM_GPU_CHECK_WARMUP": str(warmup),
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    log = work / f"{tag}.log"
    with log.open("w") as f:  # started as the resume harness starts its runs (rs.SPAWN)
        proc = _wait(rs.SPAWN([sys.executable, str(DRIVER), str(REPO / recipe), *overrides],
                              cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT), timeout)  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"exit {proc.returncode}; {_tail(log)}")
    return json.loads(out.read_text())


def _wait(proc, timeout: float):
    """Wait for a process started with rs.SPAWN (Popen or the test suite's stand-in); kill it on timeout."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return proc


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(line.strip()[:200] for line in text[-lines:]) + f" (log: {log})"


def speed_figures(probe: dict) -> dict:
    seconds = probe["seconds"]
    tokens_per_s = probe["tokens"] / seconds
    flops_per_s = probe["flops_per_batch"] * probe["timed_batches"] / seconds
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in probe["device_name"]), None)
    return {
        **probe,
        "tokens_per_s": tokens_per_s,
        "tflops_per_s": flops_per_s / 1e12,
        "mfu": flops_per_s / peak if peak else None,
        "data_wait_share": probe["data_wait_seconds"] / seconds,
    }


def _mfu(f: dict) -> str:
    return f"{100 * f['mfu']:.1f}%" if f.get("mfu") is not None else "n/a"


def _gib(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 2**20:.1f} MiB"


# --- the checks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What every check needs: sizes, the working folder, the inputs, the device."""

    sizes: Sizes
    work: Path
    data: dict  # tokenizer, tiny and slice shard folders
    device: str  # "gpu" | "cpu"
    memory_bytes: float  # the GPU's memory (a pretend 24 MiB device in the smoke run)
    slice_checkpointing: bool


DOCUMENTS = ["model.attention=document", "model.positions=document"]


def check_tiny(ctx: Context, compiled: bool, timeout: float, documents: bool = False) -> Row:
    sizes = ctx.sizes
    row = Row(
        "tiny",
        f"compile {'on' if compiled else 'off'}{', documents' if documents else ''}",
        target=f">= {TINY_TARGET_TOKENS_PER_S:,} tokens/s",
    )
    tag = f"tiny-compile-{'on' if compiled else 'off'}{'-documents' if documents else ''}"
    overrides = [
        *common_overrides(ctx.work, tag, ctx.data["tiny"], ctx.data["tokenizer"], ctx.device),
        *sizes.tiny_model,
        f"training.max_duration={sizes.tiny_warmup + sizes.tiny_steps}ba",
        f"training.compile={str(compiled).lower()}",
        *(DOCUMENTS if documents else []),
    ]
    f = speed_figures(train_probe("recipes/tiny.yaml", overrides, sizes.tiny_warmup, ctx.work, tag, timeout))
    row.figures = f
    row.result = (
        f"{f['tokens_per_s']:,.0f} tokens/s, MFU {_mfu(f)}, data wait {100 * f['data_wait_share']:.1f}%, "
        f"peak {_gib(f['peak_memory_bytes'])}, loss {f['first_loss']:.2f} -> {f['last_loss']:.2f}"
    )
    row.ok = None if sizes.smoke else f["tokens_per_s"] >= TINY_TARGET_TOKENS_PER_S
    return row


def slice_layers(sizes: Sizes, memory_bytes: float, checkpointing: bool) -> int:
    """Most layers (<= max_layers) whose one-GPU plan fits `memory_bytes` less 15%."""
    best = 0
    for layers in range(1, sizes.max_layers + 1):
        if slice_plan(sizes, layers, checkpointing).fits(memory_bytes, reserve_fraction=0.15):
            best = layers
    if not best:
        raise RuntimeError(f"not even one 7B-shaped layer fits {memory_bytes / GIB:.0f} GiB")
    return best


def slice_plan(
    sizes: Sizes, layers: int, checkpointing: bool | str, float8: bool = False, documents: bool = False,
    loss_chunk: int = 0, gpu_bytes: float = 0.0,
):  # fmt: skip
    """The dry-run memory plan of the slice on one GPU (the prediction the peak is compared with);
    the number of layers is chosen with the plain loss head (loss_chunk 0), so every row fits."""
    shape = replace(sizes.slice_shape, n_layers=layers)
    policy = checkpointing if isinstance(checkpointing, str) else "full" if checkpointing else "none"
    if policy == "auto":  # what the trainer chooses on this GPU (on the CPU: the plan's 80 GB one)
        args = dict(n_gpus=1, micro_batch=sizes.slice_batch, seq_len=shape.max_seq_len, float8=float8,
                    compute="fp32" if sizes.smoke else "bf16", loss_chunk=loss_chunk,
                    documents="document+positions" if documents else "causal")  # fmt: skip
        budget = DEFAULT_GPU_GB * 1e9 if sizes.smoke else gpu_bytes
        chosen = auto_checkpointing(shape, gpu_bytes=budget, **args)
        everything = Blocks(whole=0, selective=0, full=layers)
        return (
            chosen[1]
            if chosen
            else plan_memory(shape, activation_checkpointing="auto", blocks=everything, **args)
        )
    return plan_memory(
        shape, n_gpus=1, micro_batch=sizes.slice_batch, seq_len=shape.max_seq_len,
        compute="fp32" if sizes.smoke else "bf16", activation_checkpointing=policy, float8=float8,
        documents="document+positions" if documents else "causal", loss_chunk=loss_chunk,
    )  # fmt: skip


POLICIES = ("none", "selective", "full")
LOSS_CHUNK = ModelSection.loss_chunk  # the recipes' chunked loss head (model.loss_chunk's default)
PROFILE_STEPS = {"wait": 1, "warmup": 1, "active": 1}  # within the slice's warm-up + timed batches


def check_slice(
    ctx: Context, compiled: bool, timeout: float, policy: str | None = None, float8: bool = False,
    profile: bool = False, documents: bool = False, loss_chunk: int = LOSS_CHUNK,
) -> Row:  # fmt: skip
    """The 7b-slice at one checkpointing policy (the layers fixed by the no-recompute plan), float8 on/off."""
    sizes, shape = ctx.sizes, ctx.sizes.slice_shape
    layers = slice_layers(sizes, ctx.memory_bytes, ctx.slice_checkpointing)
    ac = policy or ("full" if ctx.slice_checkpointing else "none")
    setting = (f"{layers} layers, AC {ac}, {'float8' if float8 else 'bf16' if not sizes.smoke else 'fp32'}, "
               f"compile {'on' if compiled else 'off'}{', profiled' if profile else ''}"
               f"{', documents' if documents else ''}{', plain loss head' if not loss_chunk else ''}")  # fmt: skip
    row = Row("7b-slice", setting, target=f"MFU >= {100 * SLICE_TARGET_MFU:.0f}%")
    tag = (f"slice-{ac}-{'f8' if float8 else 'hp'}-compile-{'on' if compiled else 'off'}{'-prof' if profile else ''}"
           f"{'-documents' if documents else ''}{'-plainloss' if not loss_chunk else ''}")  # fmt: skip
    toy_shape = [f"model.vocab_size={shape.vocab_size}", f"model.dim={shape.dim}", f"model.n_heads={shape.n_heads}",
                 f"model.hidden_dim={shape.hidden_dim}", f"model.max_seq_len={shape.max_seq_len}",
                 "training.precision=auto"]  # fmt: skip
    overrides = [
        *common_overrides(ctx.work, tag, ctx.data["slice"], ctx.data["tokenizer"], ctx.device),
        *(toy_shape if sizes.smoke else []),
        f"model.n_layers={layers}",
        f"training.global_batch_size={sizes.slice_batch}",
        f"training.device_microbatch_size={sizes.slice_batch}",
        f"training.max_duration={sizes.slice_warmup + sizes.slice_steps}ba",
        f"training.compile={str(compiled).lower()}",
        f"fsdp.activation_checkpointing={ac}",
        "fsdp.checkpoint_full_every=0",
        f"training.float8.enabled={str(float8).lower()}",
        f"training.float8.emulate={str(sizes.smoke).lower()}",  # no float8 hardware on the CPU
        *(DOCUMENTS if documents else []),
        f"model.loss_chunk={loss_chunk}",
    ]
    if profile:
        overrides += [
            "training.profile.enabled=true",
            *(f"training.profile.{k}={v}" for k, v in PROFILE_STEPS.items()),
        ]
    f = speed_figures(train_probe("recipes/7b.yaml", overrides, sizes.slice_warmup, ctx.work, tag, timeout))
    if profile:
        f["trace"] = collect_trace(ctx.work / "runs" / tag / "profile")
    plan = slice_plan(sizes, layers, ac, float8, documents, loss_chunk, ctx.memory_bytes)
    planned = plan.total
    if plan.blocks is not None:
        row.setting += f" ({plan.blocks.words()})"
    measured = f["peak_memory_bytes"]
    f.update(planned_bytes=planned, layers=layers, memory_ratio=measured / planned if measured else None)
    ratio = f"{measured / planned:.2f} x the plan's {_gib(planned)}" if measured else f"plan {_gib(planned)}"
    row.figures = f
    row.result = (
        f"MFU {_mfu(f)} ({f['tflops_per_s']:.1f} TFLOP/s, {f['tokens_per_s']:,.0f} tokens/s), "
        f"peak {_gib(measured)} = {ratio}"
    )
    if profile:
        row.result += f"; trace {Path(f['trace']['file']).name}: {f['trace']['events']} events, ops {', '.join(f['trace']['block_ops'])}"
        row.target = "a trace naming the blocks' matmuls and attention"
    row.ok = None if sizes.smoke or f["mfu"] is None or profile else f["mfu"] >= SLICE_TARGET_MFU
    return row


def collect_trace(folder: Path) -> dict:
    """The profiled window's trace: its ops checked, and a copy under $OUT (the device machine's return)."""
    traces = sorted(folder.glob("*.pt.trace.json"))
    if not traces:
        raise RuntimeError(f"no profiler trace under {folder}")
    events = json.loads(traces[-1].read_text()).get("traceEvents", [])
    names = {e.get("name", "") for e in events}
    ops = sorted(n for n in names if n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")
                 or n.startswith("aten::_scaled_dot_product"))  # fmt: skip
    copies = []
    if os.environ.get("OUT"):
        dest = Path(os.environ["OUT"]) / "gpu-check-profile"
        dest.mkdir(parents=True, exist_ok=True)
        for path in folder.iterdir():
            shutil.copy(path, dest / path.name)
            copies.append(str(dest / path.name))
    return {"file": str(traces[-1]), "events": len(events), "block_ops": ops, "copied": copies}


def speedup_row(rows: list[Row]) -> Row:
    """float8's tokens/s over bf16's on the same slice and policy."""
    row = Row("float8", "speed-up over bf16, same slice", target="> 1 (float8 faster)")
    by = {r.setting: r.figures for r in rows if r.check == "7b-slice" and r.figures}
    f8 = next((s for s in by if "float8" in s), None)
    base = f8 and f8.replace("float8", "fp32" if "fp32" in " ".join(by) else "bf16")
    if not f8 or base not in by:
        row.error = "needs both the float8 and the matching high-precision slice rows"
        return row
    ratio = by[f8]["tokens_per_s"] / by[base]["tokens_per_s"]
    row.figures = {"speedup": ratio}
    row.result = f"{ratio:.2f}x ({by[f8]['tokens_per_s']:,.0f} vs {by[base]['tokens_per_s']:,.0f} tokens/s)"
    row.ok = None if "fp32" in base else ratio > 1
    return row


def documents_row(rows: list[Row]) -> Row:
    """Documents apart against causal, for the tiny recipe and the 7b-slice: tokens/s, MFU, memory."""
    row = Row("documents", "against causal, same runs", target=">= 0.9 x causal's tokens/s")
    pairs = []
    for check, base in (("tiny", "compile off"), ("7b-slice", None)):
        found = {r.setting: r.figures for r in rows if r.check == check and r.figures}
        apart = next((k for k in found if k.endswith(", documents")), None)
        causal = apart and (base or apart.removesuffix(", documents"))
        if apart and causal in found:
            pairs.append((check, found[apart], found[causal]))
    if len(pairs) < 2:
        row.error = "needs the tiny and 7b-slice rows with documents and their causal ones"
        return row
    parts, ratios = [], {}
    for check, apart, causal in pairs:
        ratios[check] = apart["tokens_per_s"] / causal["tokens_per_s"]
        parts.append(
            f"{check} {ratios[check]:.2f}x ({apart['tokens_per_s']:,.0f} vs {causal['tokens_per_s']:,.0f} "
            f"tokens/s, MFU {_mfu(apart)} vs {_mfu(causal)}, peak {_gib(apart['peak_memory_bytes'])} vs "
            f"{_gib(causal['peak_memory_bytes'])})"
        )
    row.figures = {"ratios": ratios}
    row.result = "; ".join(parts)
    row.ok = None if any(c["device_name"] == "cpu" for _, c, _ in pairs) else min(ratios.values()) >= 0.9
    return row


def check_kernels(ctx: Context, timeout: float) -> Row:
    """Documents on the GPU's kernel (FlexAttention over the block mask; compiled on a GPU, eager on
    the CPU) against the CPU's (SDPA with a boolean mask), in this process on the same device."""
    import torch

    from llm.composer_model import Documents, LanguageModel
    from llm.model import ModelConfig

    device = "cuda" if ctx.device == "gpu" else "cpu"
    length = 4096 if ctx.device == "gpu" else 64
    dtype = torch.float32 if ctx.sizes.smoke else torch.bfloat16
    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=2, max_seq_len=length)
    tokens = torch.randint(EOS_ID + 1, 512, (2, length), generator=torch.Generator().manual_seed(0))
    tokens[torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) < 4 / length] = EOS_ID
    batch = {"input_ids": tokens.to(device)}
    results = {}
    for kernel in ("sdpa", "flex"):
        lm = LanguageModel.from_config(cfg, seed=3, documents=Documents(EOS_ID, True)).to(device, dtype)
        lm.model.document_kernel = kernel
        loss = lm.loss(lm(batch), batch)
        loss.backward()
        grad = torch.cat([p.grad.float().flatten() for p in lm.parameters()])
        results[kernel] = (loss.float().item(), grad)
    (loss_a, grad_a), (loss_b, grad_b) = results["sdpa"], results["flex"]
    worst = float((grad_a - grad_b).abs().max() / grad_a.abs().max())
    name = str(dtype).removeprefix("torch.")
    row = Row("kernels", f"FlexAttention vs SDPA + mask, {name}, 2 x {length - 1} tokens")
    row.target = "equal within the dtype's rounding (relative 1e-4 fp32, 2e-2 bf16)"
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    row.figures = {"loss_sdpa": loss_a, "loss_flex": loss_b, "grad_relative_difference": worst}
    row.result = f"loss {loss_b:.6f} vs {loss_a:.6f}, gradients differ by up to {worst:.2g} of their largest"
    row.ok = abs(loss_a - loss_b) <= bound * abs(loss_a) and worst <= bound
    return row


def check_init(ctx: Context, timeout: float) -> Row:
    """Build the full 7B recipe's trainer (meta device on GPUs) in its own process; host memory."""
    sizes = ctx.sizes
    row = Row("7b-init", "7b recipe at toy size" if sizes.smoke else "full 7B recipe, one GPU")
    out = ctx.work / "init.json"
    out.unlink(missing_ok=True)
    overrides = [
        *common_overrides(ctx.work, "init", ctx.data["slice"], ctx.data["tokenizer"], ctx.device),
        *sizes.init_model,
        "training.global_batch_size=1",
        "training.device_microbatch_size=1",
        "training.max_duration=2ba",  # never trained: the schedule only has to be valid
    ]
    log = ctx.work / "init.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with log.open("w") as f:
        proc = _wait(rs.SPAWN([sys.executable, __file__, "--init-only", str(out), "recipes/7b.yaml", *overrides],
                       cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT), timeout)  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"exit {proc.returncode}; {_tail(log)}")
    f = json.loads(out.read_text())
    row.figures = f
    grew = f["host_peak_bytes"] - f["host_before_bytes"]
    where = "on the meta device, shards materialised on the GPU" if f["on_meta"] else "built for real (CPU)"
    row.result = (
        f"{f['params']:,} parameters {where}: host memory +{_gib(grew)} "
        f"(plan: {_gib(f['plan_host_meta'])} meta, {_gib(f['plan_host_eager'])} ordinary), "
        f"GPU {_gib(f['device_bytes'])}, {f['seconds']:.0f} s"
    )
    row.target = "host growth < 4 x the plan's meta figure (the CUDA context takes some)"
    row.ok = None if sizes.smoke else grew < 4 * f["plan_host_meta"]
    return row


def init_only(out: Path, recipe: str, overrides: list[str]) -> int:
    """The 7b-init worker: build the trainer, measure, close (no training)."""
    import torch

    from llm.config import load_config
    from llm.model import count_params
    from llm.trainer import build_trainer, resolve_device

    cfg = load_config(REPO / recipe, overrides)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    trainer = build_trainer(cfg)
    seconds = time.monotonic() - started
    counts = count_params(cfg.model)
    device = resolve_device(cfg)
    result = {
        "params": counts.total,
        "on_meta": bool(cfg.fsdp.enabled and cfg.fsdp.init_on_meta and device == "gpu"),
        "host_before_bytes": before,
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device_bytes": torch.cuda.memory_allocated() if device == "gpu" else None,
        "plan_host_meta": 4 * counts.largest,
        "plan_host_eager": 4 * counts.total,
        "seconds": seconds,
    }
    trainer.close()
    out.write_text(json.dumps(result))
    return 0


def check_resume_and_generation(ctx: Context, timeout: float) -> list[Row]:
    """The CPU soak's bit-identity check on fewer steps, and the generation callback in the reference."""
    sizes = ctx.sizes
    folder = ctx.work / "resume"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    recipe = folder / "recipe.yaml"
    shutil.copy(REPO / "recipes" / "tiny.yaml", recipe)
    steps = sizes.resume_steps
    base = [
        *common_overrides(folder, "resume", ctx.data["tiny"], ctx.data["tokenizer"], ctx.device),
        *sizes.tiny_model,
        f"training.max_duration={steps}ba",
        "guard.enabled=true",  # as the recipe has it: its state resumes from a sharded checkpoint too
        f"checkpoint.save_interval={sizes.resume_save_every}ba",
        "checkpoint.num_to_keep=2",
    ]
    env = {"LLM_GPU_CHECK_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    reference = [
        f"checkpoint.save_folder={folder / 'ckpt-reference'}",
        f"run_dir={folder / 'runs' / 'reference'}",
        "callbacks.generate.enabled=true",
        f"callbacks.generate.interval={steps}ba",
        f"callbacks.generate.max_new_tokens={sizes.generate_tokens}",
    ]
    ref = _harness_run(recipe, "reference", [*base, *reference], env, timeout)
    interrupted = [*base, f"checkpoint.save_folder={folder / 'ckpt'}"]
    first = rs.interrupt(recipe, "first", cwd=REPO, at_batch=sizes.resume_stop, sig=signal.SIGTERM,
                         overrides=interrupted, env=env, driver=DRIVER)  # fmt: skip
    stop = first.batches()[-1]["batch"] if first.batches() else None
    second = _harness_run(recipe, "second", interrupted, env, timeout)
    return [_resume_row(ref, first, second, stop, steps), _generation_row(folder / "runs" / "reference", ref)]


def _harness_run(recipe: Path, tag: str, overrides: list[str], env: dict, timeout: float):
    result = rs.run(recipe, tag, cwd=REPO, overrides=overrides, env=env, timeout=timeout, driver=DRIVER)
    if result.returncode != 0:
        raise RuntimeError(f"{tag} run: exit {result.returncode}; {_tail(recipe.parent / f'{tag}.log')}")
    return result


def _resume_row(ref, first, second, stop: int | None, steps: int) -> Row:
    import torch

    row = Row("resume", f"SIGTERM + resume, {steps} steps", target="bit-identical to an uninterrupted run")
    if stop is None or not 0 < stop < steps:
        raise RuntimeError(f"the interrupted run stopped at batch {stop}: {first.output[-300:]}")
    done = [b for b in first.batches() if b["batch"] <= stop]
    combined = [*done, *second.batches()]
    reference = ref.batches()
    same_samples = [b["ids"] for b in combined] == [b["ids"] for b in reference]
    same_losses = [b["loss"] for b in combined] == [b["loss"] for b in reference]
    wa, wb = rs.load_weights(ref.weights), rs.load_weights(second.weights)
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    worst = max((float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if k in wb), default=math.nan)
    row.figures = {"stop": stop, "same_samples": same_samples, "same_losses": same_losses,
                   "same_weights": same_weights, "max_weight_difference": worst}  # fmt: skip
    row.result = (
        f"stopped after batch {stop}, resumed to {steps}: samples {'same' if same_samples else 'DIFFER'}, "
        f"losses {'equal' if same_losses else 'DIFFER'}, final weights "
        f"{'bit-identical' if same_weights else f'differ by up to {worst:.3g}'}"
    )
    row.ok = same_samples and same_losses and same_weights
    return row


def _generation_row(run_dir: Path, ref) -> Row:
    row = Row("generation", "callback at the end of the reference run", target="runs, writes samples.jsonl")
    samples = run_dir / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()] if samples.exists() else []
    announced = [line for line in ref.output.splitlines() if line.startswith("[generate] step")]
    row.figures = {"samples": len(rows), "announced": announced}
    first = f"{rows[0]['prompt']}|{rows[0]['text'][:20]!r}" if rows else "none"
    row.result = (
        f"{len(rows)} continuations written ({announced[-1][11:] if announced else 'no log line'}); {first}"
    )
    row.ok = bool(rows) and all(isinstance(r.get("text"), str) for r in rows)
    return row


# --- orchestration ----------------------------------------------------------------------------


def prepare(sizes: Sizes, work: Path) -> dict:
    tokenizer = write_tokenizer(work / "tokenizer.model")
    tiny_vocab, tiny_seq, batch = (512, 64, 4) if sizes.smoke else (64793, 512, 32)
    tiny_samples = max(sizes.tiny_warmup + sizes.tiny_steps, sizes.resume_steps) * batch + batch
    s = sizes.slice_shape
    slice_samples = (sizes.slice_warmup + sizes.slice_steps) * sizes.slice_batch + sizes.slice_batch
    return {
        "tokenizer": tokenizer,
        "tiny": write_token_shards(work / "tiny" / "train", tiny_samples, tiny_seq, tiny_vocab, tokenizer),
        "slice": write_token_shards(work / "slice" / "train", slice_samples, s.max_seq_len, s.vocab_size, tokenizer),
    }  # fmt: skip


def check_snapshot(ctx: Context, timeout: float) -> Row:
    """The snapshot's device-to-host rate: a state dict of `snapshot_bytes` on the device staged by
    the saver's `HostStager` (the first time allocates its buffers; the next three are timed)."""
    import torch

    from llm.checkpoint.saver import HostStager

    device = "cuda" if ctx.device == "gpu" else "cpu"
    pieces = 8
    numel = ctx.sizes.snapshot_bytes // (pieces * 4)
    state = {"model": {f"w{i}": torch.randn(numel, device=device) for i in range(pieces)}, "step": 7}
    stager = HostStager()
    stager.stage(state)  # allocates (and pins, on a GPU) the buffers once
    seconds = []
    for _ in range(3):
        started = time.monotonic()
        staged = stager.stage(state)
        seconds.append(time.monotonic() - started)
    exact = all(torch.equal(staged["model"][k], state["model"][k].cpu()) for k in state["model"])
    rate = ctx.sizes.snapshot_bytes / sorted(seconds)[1]
    seven_b = SEVEN_B_BYTES_PER_RANK / rate
    row = Row(
        "snapshot", f"{_gib(ctx.sizes.snapshot_bytes)} to host, {'pinned' if stager.pinned else 'memcpy'}"
    )
    row.target = f"7B's {SEVEN_B_BYTES_PER_RANK / 1e9:.1f} GB per rank in <= {SNAPSHOT_TARGET_SECONDS:g} s"
    row.figures = {"bytes": ctx.sizes.snapshot_bytes, "seconds": seconds, "bytes_per_s": rate,
                   "seven_b_seconds": seven_b, "pinned": stager.pinned, "exact": exact}  # fmt: skip
    row.result = (
        f"{rate / 1e9:.1f} GB/s (median of 3), copy exact: {exact}; the 7B's part per rank: {seven_b:.2f} s"
        f" (llm inspect --snapshot-bandwidth {rate / 2e9:.3g}GB/s with two GPUs per link)"
    )
    row.ok = None if ctx.sizes.smoke else exact and seven_b <= SNAPSHOT_TARGET_SECONDS
    return row


def plan_checks(ctx: Context) -> list:
    """(name, estimated seconds on an H200, function of the timeout returning rows), most important first."""
    checks = [
        *[(f"7b-slice, AC {p}", 60, lambda t, p=p: [check_slice(ctx, False, t, policy=p)]) for p in POLICIES],
        ("7b-slice, float8", 60, lambda t: [check_slice(ctx, False, t, policy="selective", float8=True)]),
        ("7b-slice, profiled", 60, lambda t: [check_slice(ctx, False, t, policy="selective", profile=True)]),
        ("tiny, compile off", 40, lambda t: [check_tiny(ctx, False, t)]),
        ("tiny, documents", 40, lambda t: [check_tiny(ctx, False, t, documents=True)]),
        (
            "7b-slice, documents",
            60,
            lambda t: [check_slice(ctx, False, t, policy="selective", documents=True)],
        ),
        (
            "7b-slice, plain loss head",
            60,
            lambda t: [check_slice(ctx, False, t, policy="selective", loss_chunk=0)],
        ),
        ("7b-slice, AC auto", 60, lambda t: [check_slice(ctx, False, t, policy="auto")]),
        ("kernels", 30, lambda t: [check_kernels(ctx, t)]),
        ("7b-init", 90, lambda t: [check_init(ctx, t)]),
        ("resume + generation", 90, lambda t: check_resume_and_generation(ctx, t)),
        ("snapshot", 20, lambda t: [check_snapshot(ctx, t)]),
    ]
    if True in ctx.sizes.compile_modes:
        checks += [
            ("tiny, compile on", 90, lambda t: [check_tiny(ctx, True, t)]),
            ("7b-slice, compile on", 100, lambda t: [check_slice(ctx, True, t, policy="full")]),
        ]
    return checks


def run_checks(checks, budget: Budget, smoke: bool) -> list[Row]:
    rows: list[Row] = []
    for name, estimate, check in checks:
        left = budget.left()
        if not smoke and left < estimate:
            rows.append(
                Row(name, "", error=f"skipped: {left:.0f} s of the time budget left, needs ~{estimate} s")
            )
            continue
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            rows += check(max(60.0, left) if not smoke else 900.0)
        except Exception as err:  # one failed check must not hide the others' figures
            rows.append(Row(name, "", ok=False, error=f"{type(err).__name__}: {err}"))
        print(f"[gpu-check] {name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[Row], header: str) -> str:
    width = max(len(f"{r.check} ({r.setting})") for r in rows) if rows else 10
    lines = [header, f"{'check':<{width}}  {'ok':<4}  result   [target]"]
    for r in rows:
        name = f"{r.check} ({r.setting})" if r.setting else r.check
        ok = "-" if r.ok is None else "yes" if r.ok else "NO"
        body = r.error if r.error else f"{r.result}   [{r.target}]" if r.target else r.result
        lines.append(f"{name:<{width}}  {ok:<4}  {body}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, toy sizes, fp32, no compile (the test suite's run)"
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument(
        "--work", help="working folder (default: a temporary one, removed unless a check failed)"
    )
    parser.add_argument(
        "--slice-checkpointing",
        choices=["on", "off"],
        default="off",
        help="activation checkpointing in the 7b-slice (default off: the layers that fit, no recompute)",
    )
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS, help="seconds for all checks (GPU)")
    parser.add_argument("--init-only", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.init_only:
        out, recipe, *overrides = args.init_only
        return init_only(Path(out), recipe, overrides)
    import torch

    sizes = SMOKE if args.smoke else GPU
    if not args.smoke and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU visible; run on an H100/H200, or pass --smoke for the CPU check",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.smoke else "gpu"
    memory = SMOKE_MEMORY_BYTES if args.smoke else torch.cuda.get_device_properties(0).total_memory
    if args.smoke:
        name = "cpu (smoke: fp32, toy sizes, a pretend 24 MiB device)"
    else:
        name = f"{torch.cuda.get_device_name(0)} ({memory / GIB:.0f} GiB)"
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="llm-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    ctx = Context(sizes, work, prepare(sizes, work), device, memory, args.slice_checkpointing == "on")
    rows = run_checks(plan_checks(ctx), budget, args.smoke)
    rows.insert(5, speedup_row(rows))
    rows.insert(next(i for i, r in enumerate(rows) if r.check == "kernels"), documents_row(rows))
    failed = [r for r in rows if r.error or r.ok is False]
    if not args.work and not failed:  # a failure keeps its logs (named in the table)
        shutil.rmtree(work, ignore_errors=True)
    spent = time.monotonic() - budget.started
    header = (f"gpu-check: {name}, torch {torch.__version__}, "
              f"{len(rows)} checks in {spent:.0f} s (budget {args.budget:.0f} s)")  # fmt: skip
    print(format_table(rows, header), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
