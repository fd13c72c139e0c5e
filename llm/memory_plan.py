"""Dry-run estimates: memory per GPU under FSDP2 (full shard or HSDP), the model's basic figures,
and what the whole run costs in wall time and GPU-hours.

Nothing is allocated: the model is built on the meta device only to count parameters.
`describe_run` is the whole dry run (`llm inspect`, `train.py --dry-run`) as text.

Notation: P parameters (tied counted once), L layers, h = dim, f = SwiGLU hidden size,
V vocabulary, a = micro_batch * seq_len tokens, n GPUs, cb bytes per element of the compute dtype
(2 for bf16, 4 for fp32), pb bytes of the master weights (4, fp32). "Block" = one
TransformerBlock (B_blk parameters); "root" = the parameters outside the blocks (embedding, output
projection, final norm: R = P - L * B_blk), which FSDP keeps in the root unit.

Per GPU, FSDP FULL_SHARD with mixed precision (sharded sizes round up to whole elements):
- weights     ceil(P / n) * pb                     sharded fp32 master weights
- gradients   ceil(P / n) * pb                     sharded, reduced in fp32
- optimizer   ceil(P / n) * 8                      AdamW exp_avg + exp_avg_sq in fp32
- gathered    cb * (R + 2 * B_blk)                 unsharded compute-dtype params in flight: the root
                                                   (kept gathered through forward and backward),
                                                   the running block and the prefetched one
- grad bufs   cb * R + (cb + r) * B_blk            unsharded gradients before reduce-scatter: the
                                                   root's (live through all of backward) and one
                                                   block's, plus its fp32 copy for the reduction
                                                   (r = 4 when cb != 4, else 0)

Activations per layer, derived from what autograd saves in ``llm/model.py`` with SDPA's
flash/memory-efficient kernels (no T x T score matrix; the small log-sum-exp is ignored):
- each of the 2 RMSNorms: a * h * (4 + cb)        its fp32 input copy + the normalised input
- attention:              a * cb * 5h             qkv input, q, k, v (repeated to full width for
                                                   grouped-query attention), attention output
- feed-forward:           a * cb * (h + 4f)        input, gate, silu(gate), up, silu * up
  => per layer            a * ((8 + 2cb) h + 6 cb h + 4 cb f)
  (bf16: a * (24h + 8f) bytes; 45.5 * a * h for Baichuan-7B's f = 11008; compare Korthikanti et
  al.'s 34 * a * h for a GELU MLP with f = 4h and dropout masks.)
- without checkpointing:  L * per layer
- full checkpointing (fsdp.activation_checkpointing=full): L * a * h * cb (each block's saved
  input) + one block's per-layer activations while it is recomputed during backward
- selective (=selective): each block keeps its input and the outputs of its matmuls and attention
  (q, k, v, attention output, wo, w1, w3, w2): a * cb * (7h + 2f) per layer (bf16: 14h + 4f
  bytes), plus one block's per-layer activations during its recompute; with
  fsdp.checkpoint_full_every=k every k-th block costs the full policy's a * h * cb instead
- auto (=auto): per block, one of the three above: `whole` blocks keep every activation, `full`
  blocks keep their input, the rest are selective; `auto_checkpointing` picks the fewest blocks
  recomputed in full (each costs a forward of the block, `block_forward_flops`), then the most left
  whole, that fit the budget. Its recomputed share of the step's FLOPs (`recompute_share`): full
  blocks x a block's forward over the step's counted FLOPs (selective recomputes elementwise ops,
  no matmul FLOPs). With training.compile only none and full are chosen (selective needs eager ops).
- float8 (training.float8): the matmul inputs that only matmuls keep (the normalised attention
  and feed-forward inputs, silu * up) are saved in float8 (1 byte) instead of cb, and each layer
  that is not fully checkpointed also keeps its float8 weights (1 byte x its linear parameters)
  for backward; with FSDP2 float8 all-gather the gathered block weights are 1 byte, not cb
- loss head (both cases): final norm a * h * (4 + cb) + output input a * h * cb + logits
  a * V * (12 + cb): fp32 logits kept for the loss and metrics, the fp32 log-softmax cross-entropy
  saves, and during backward the fp32 logits gradient and its compute-dtype cast.
- loss head, chunked (model.loss_chunk = c tokens; llm/loss.py): final norm a * h * (4 + cb) +
  output input a * h * cb + 16 a (fp32 log-sum-exp, largest logit and its int64 index per token) +
  one chunk's logits min(c, a) * V * (8 + cb): the compute-dtype matmul output and two fp32
  tensors (its copy and the log-sum-exp's or the gradient's) at a time; nothing of size a * V.

Documents kept apart (model.attention=document; llm/model.py), per micro-batch of b samples of T
tokens, n = ceil(T / 128): the FlexAttention block mask, 4 pairs of int32 tile counts [b, n] and
tile indices [b, n, n] (16 b n (n + 1) bytes), the documents padded to whole tiles and as given
(int64, 8 b (128 n + T)); with positions restarting (model.positions=document) the rotary tables
are per row, 2 b T (h / heads) cb bytes. All layers share them; kilobytes to megabytes at 7B. (CPUs
use a boolean b T^2 mask for SDPA instead, not planned here.) Under the selective policy the
attention is recomputed, not kept (llm/model.py's `flex_attention`): the plan keeps counting it.
The attention FLOPs such a mask saves (`document_attention`) are counted in tiles: for windows
cut from a stream of documents of a given mean length (lengths geometric, a fixed seed), the share
of causal attention's 128 x 128 tiles that the block mask still visits. MFU keeps counting the
causal window's FLOPs, so tokens/s and MFU compare with causal runs directly.

Host memory per rank at start: building on the meta device and materialising per parameter
(``init_parameter_`` draws one full fp32 tensor at a time on the CPU) peaks at 4 * the largest
parameter, versus 4 * P for an ordinary build on every rank.

``fits`` keeps ``reserve_fraction`` (default 10%) of the GPU for the CUDA context, NCCL buffers,
kernels' workspaces and allocator fragmentation, which this plan does not model.

Sharding: n above is the number of GPUs a parameter is sharded over: every GPU with plain FSDP2,
the GPUs of one replica group with HSDP (``fsdp.replicate`` groups, e.g. one per node, each
holding a whole sharded copy), and 1 without FSDP (DDP keeps a full copy on every GPU).

Cost: the run's training FLOPs (steps x FLOPs per step, the model's 6N + attention count) over
``gpus x peak x MFU``. Peaks are dense bf16 tensor-core figures (H100/H200 SXM 989.5 TFLOP/s,
A100 312 TFLOP/s, as Composer's table). Before a measurement the plan uses 40% MFU (the anchors:
llm-foundry 46.4% for MPT-7B on 8 x H100, torchtitan 33.7-39% for Llama-3-8B) and our 50% target;
``make gpu-check`` measures it (pass it with ``--mfu``). GPU-hours do not depend on the GPU count
at a fixed MFU; in practice MFU falls somewhat with more nodes (more communication per step).

Checkpoints (`checkpoint_cost`): 12 bytes a parameter (`llm.checkpoint.sizes`), split over the
writing ranks of a sharded save. A save stalls training while it is written to the local disk
(the node's part at `--disk-bandwidth`); storing it takes the node's part at
`--upload-bandwidth`, on the training step with `checkpoint.background_upload: false`, beside it
otherwise. The save interval that keeps the stall under 1% is the larger of 100 x stall / step time
and (background) the upload time in steps, so that the next save need not wait. A preemption
without a save (no notice, or one too short for write + upload) loses on average half an interval
of steps plus the upload in flight; one with time to save loses nothing but the restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llm.checkpoint.sizes import (
    DEFAULT_DISK_BANDWIDTH,
    DEFAULT_SHARD_BYTES,
    DEFAULT_SNAPSHOT_BANDWIDTH,
    DEFAULT_UPLOAD_BANDWIDTH,
    NOTICES_S,
    STALL_TARGET,
    BandwidthError,
    CheckpointSize,
    RestartCost,
    checkpoint_size,
    first_batch_shards,
    parse_bandwidth,
    stall_free_interval,
)
from llm.config import TrainConfig, parse_duration, wall_clock_seconds
from llm.errors import ConfigError
from llm.model import FLEX_TILE, ModelConfig, Transformer, count_params, document_tiles
from llm.optim import duration_in_batches

GIB = 1024**3
DEFAULT_GPUS = 8
DEFAULT_GPU_GB = 80.0
DEFAULT_GPU_TYPE = "H100"
# What a plan takes: the largest clusters have about 10^5 GPUs and the largest GPUs under 300 GB;
# beyond these a number is a typo (or 1e400), not a machine.
MAX_GPUS = 1_000_000
MAX_GPU_GB = 1024.0
MIN_MFU = 0.01
# Dense bf16 tensor-core peak per GPU (FLOP/s): the denominators of MFU.
PEAK_BF16_FLOPS = {"H100": 989.5e12, "H200": 989.5e12, "H800": 989.5e12, "A100": 312e12, "A800": 312e12}
ANCHOR_MFU = 0.40  # llm-foundry 46.4% (MPT-7B, 8 x H100), torchtitan 33.7-39% (Llama-3-8B)
TARGET_MFU = 0.50


class MemoryPlanError(ValueError):
    """Arguments the memory plan cannot model; the message names the argument and the fix."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU (and per host rank) for one training configuration; see the module docstring."""

    n_gpus: int
    micro_batch: int
    seq_len: int
    compute: str
    activation_checkpointing: str  # none | full | selective | auto (see the module docstring)
    weights: int
    gradients: int
    optimizer: int
    gathered_params: int
    gradient_buffers: int
    activations_no_checkpointing: int
    activations_checkpointing: int  # full
    activations_selective: int
    loss_head: int
    host_memory_per_rank: int
    host_memory_per_rank_eager: int
    full_every: int = 0
    float8: bool = False
    document_mask: int = 0  # the block mask of documents kept apart (module docstring); 0: causal
    loss_chunk: int = 0  # tokens per chunk of the loss head; 0: plain (loss_head is then the plain one)
    loss_head_plain: int = 0  # the plain path's loss head, for comparison (= loss_head when plain)
    blocks: Blocks | None = None  # auto: the per-block choice
    activations_auto: int = 0

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.gathered_params + self.gradient_buffers

    @property
    def per_batch(self) -> int:
        """What each micro-batch adds besides the blocks' activations: the loss head, the mask."""
        return self.loss_head + self.document_mask

    @property
    def total_no_checkpointing(self) -> int:
        return self.static + self.activations_no_checkpointing + self.per_batch

    @property
    def total_checkpointing(self) -> int:
        return self.static + self.activations_checkpointing + self.per_batch

    @property
    def total_selective(self) -> int:
        return self.static + self.activations_selective + self.per_batch

    def activations_for(self, policy: str) -> int:
        return {
            "none": self.activations_no_checkpointing,
            "full": self.activations_checkpointing,
            "selective": self.activations_selective,
            "auto": self.activations_auto,
        }[policy]

    @property
    def activations(self) -> int:
        return self.activations_for(self.activation_checkpointing)

    @property
    def total(self) -> int:
        return self.static + self.activations + self.per_batch

    def fits(self, gpu_bytes: float, reserve_fraction: float = 0.1) -> bool:
        return self.total <= gpu_bytes * (1.0 - reserve_fraction)

    def format(self, gpu_gb: float = 80) -> str:
        """A readable table in GiB; ``gpu_gb`` is the GPU size in GB (1e9 bytes, as marketed)."""
        gpu_bytes = gpu_gb * 1e9
        budget = gpu_bytes * 0.9

        def row(label: str, value: float) -> str:
            return f"  {label:<44}{value / GIB:>9.2f} GiB"

        def verdict(total: int) -> str:
            return "fits" if total <= budget else "does NOT fit"

        ckpt = self.activation_checkpointing + (
            f", 1 block in {self.full_every} full" if self.full_every and ckpt_selective(self) else ""
        )
        if self.blocks is not None:
            ckpt = f"auto: {self.blocks.words()}"
        selective = "activations, selective" + (f" (1 in {self.full_every} full)" if self.full_every else "")
        lines = [
            f"Memory per GPU: parameters sharded over {self.n_gpus} GPU(s), micro-batch {self.micro_batch} x "
            f"{self.seq_len} tokens, {self.compute} compute{', float8 block matmuls' if self.float8 else ''}, "
            f"activation checkpointing {ckpt}",
            row("weights (fp32 master, sharded)", self.weights),
            row("gradients (fp32, sharded)", self.gradients),
            row("AdamW state (2 x fp32, sharded)", self.optimizer),
            row(f"gathered params ({self.compute}, root + 2 blocks)", self.gathered_params),
            row("unsharded gradient buffers", self.gradient_buffers),
            row("activations, no checkpointing", self.activations_no_checkpointing),
            row("activations, full checkpointing", self.activations_checkpointing),
            row(selective, self.activations_selective),
            *([row("activations, auto (as chosen)", self.activations_auto)] if self.blocks else []),
            *self._loss_head_rows(row),
            *(
                [row("document mask (block mask, documents)", self.document_mask)]
                if self.document_mask
                else []
            ),
            row("TOTAL without checkpointing", self.total_no_checkpointing)
            + f"  {verdict(self.total_no_checkpointing)}",
            row("TOTAL with selective checkpointing", self.total_selective)
            + f"  {verdict(self.total_selective)}",
            row("TOTAL with full checkpointing", self.total_checkpointing)
            + f"  {verdict(self.total_checkpointing)}",
            row(f"TOTAL as configured ({ckpt})", self.total) + f"  {verdict(self.total)}",
            row(f"budget: {gpu_gb:g} GB GPU less 10% reserve", budget),
            row("host memory per rank, meta-device init", self.host_memory_per_rank),
            row("host memory per rank, ordinary init", self.host_memory_per_rank_eager),
        ]
        return "\n".join(lines)

    def _loss_head_rows(self, row) -> list[str]:
        plain = row("loss head, plain (every token's logits)", self.loss_head_plain or self.loss_head)
        if not self.loss_chunk:
            return [plain]
        chunked = row(f"loss head, chunked ({self.loss_chunk:,}-token chunks)", self.loss_head)
        return [plain + "  (model.loss_chunk=0)", chunked + f"  (model.loss_chunk={self.loss_chunk})"]


@dataclass(frozen=True)
class Blocks:
    """Activation checkpointing per block: `whole` blocks keep everything, `full` are recomputed in
    full, the rest selective (`auto`; module docstring)."""

    whole: int
    selective: int
    full: int

    def policies(self) -> list[str]:
        """Each block's policy, first to last: the full ones first, the whole ones last (their
        activations are the first backward needs)."""
        return ["full"] * self.full + ["selective"] * self.selective + ["none"] * self.whole

    def words(self) -> str:
        return f"{self.whole} block(s) whole, {self.selective} selective, {self.full} full"


def _check_plan_args(n_gpus: int, micro_batch: int, seq_len: int, compute: str, sharding: str) -> None:
    for name, value in [("n_gpus", n_gpus), ("micro_batch", micro_batch), ("seq_len", seq_len)]:
        if not isinstance(value, int) or value <= 0:
            raise MemoryPlanError(f"{name} must be a positive integer, got {value!r}")
    if compute not in ("bf16", "fp32"):
        raise MemoryPlanError(f"compute must be 'bf16' or 'fp32', got {compute!r}")
    if sharding not in ("full", "full_shard"):
        raise MemoryPlanError(f"sharding {sharding!r} is not modelled; only FSDP full sharding ('full') is")


def ckpt_selective(plan: MemoryPlan) -> bool:
    return plan.activation_checkpointing == "selective"


def layer_activation_bytes(cfg: ModelConfig, tokens: int, cb: int, float8: bool = False) -> int:
    """What autograd keeps for one block without checkpointing (module docstring)."""
    h, f = cfg.dim, cfg.ffn_hidden_dim
    norms = 2 * tokens * h * (4 + cb)
    attention = tokens * cb * 5 * h
    feed_forward = tokens * cb * (h + 4 * f)
    saved = norms + attention + feed_forward
    if float8:  # attention input, feed-forward input and silu * up kept in float8 instead
        saved -= tokens * (cb - 1) * (2 * h + f)
    return saved


def selective_layer_bytes(cfg: ModelConfig, tokens: int, cb: int) -> int:
    """One block under the selective policy: its input and its matmul and attention outputs."""
    return tokens * cb * (7 * cfg.dim + 2 * cfg.ffn_hidden_dim)


def checkpointing_activations(
    cfg: ModelConfig, tokens: int, cb: int, full_every: int = 0, float8: bool = False, linear: int = 0
) -> dict[str, int]:
    """Activation bytes per GPU under each policy; `linear`: one block's linear parameters (float8)."""
    layers = cfg.n_layers
    per_layer = layer_activation_bytes(cfg, tokens, cb, float8)
    kept_input = tokens * cfg.dim * cb
    weights8 = linear if float8 else 0  # float8 weights saved for backward by a layer not recomputed
    full_blocks = layers // full_every if full_every else 0
    selective_blocks = layers - full_blocks
    return {
        "none": layers * (per_layer + weights8),
        "full": layers * kept_input + per_layer + weights8,
        "selective": selective_blocks * (selective_layer_bytes(cfg, tokens, cb) + weights8)
        + full_blocks * kept_input
        + per_layer,
    }


def blocks_activations(
    cfg: ModelConfig, tokens: int, cb: int, blocks: Blocks, float8: bool = False, linear: int = 0
) -> int:
    """Activation bytes per GPU of a per-block choice (module docstring)."""
    per_layer = layer_activation_bytes(cfg, tokens, cb, float8)
    weights8 = linear if float8 else 0
    recomputing = per_layer if blocks.selective or blocks.full else 0
    return (
        blocks.whole * (per_layer + weights8)
        + blocks.selective * (selective_layer_bytes(cfg, tokens, cb) + weights8)
        + blocks.full * tokens * cfg.dim * cb
        + recomputing
    )


def plan_memory(
    cfg: ModelConfig,
    *,
    n_gpus: int,
    micro_batch: int,
    seq_len: int,
    param_dtype_bytes: int = 4,
    compute: str = "bf16",
    activation_checkpointing: str | bool = "full",
    sharding: str = "full",
    full_every: int = 0,
    float8: bool = False,
    documents: str = "causal",
    loss_chunk: int = 0,
    blocks: Blocks | None = None,
) -> MemoryPlan:
    """Estimate memory per GPU for FSDP full sharding (formulas in the module docstring);
    `documents`: causal, document (model.attention=document) or document+positions (and
    model.positions=document); `loss_chunk`: tokens per chunk of the chunked loss head, 0 plain."""
    _check_plan_args(n_gpus, micro_batch, seq_len, compute, sharding)
    if isinstance(activation_checkpointing, bool):  # the old on/off form
        activation_checkpointing = "full" if activation_checkpointing else "none"
    if activation_checkpointing not in ("none", "full", "selective", "auto"):
        raise MemoryPlanError(
            f"activation_checkpointing {activation_checkpointing!r} is not one of none, full, selective, auto"
        )
    if (activation_checkpointing == "auto") != (blocks is not None):
        raise MemoryPlanError("activation_checkpointing=auto comes with its per-block choice (blocks)")
    counts = count_params(cfg)
    cb = 2 if compute == "bf16" else 4
    reduce_copy = 4 if cb != 4 else 0
    shard = math.ceil(counts.total / n_gpus)
    tokens = micro_batch * seq_len
    h = cfg.dim
    linear = counts.block - 2 * h  # a block's parameters less its two norms
    acts = checkpointing_activations(cfg, tokens, cb, full_every, float8, linear)
    gathered_block = (linear + 2 * h * cb) if float8 else cb * counts.block  # float8 all-gather
    return MemoryPlan(
        n_gpus=n_gpus,
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute=compute,
        activation_checkpointing=activation_checkpointing,
        weights=shard * param_dtype_bytes,
        gradients=shard * param_dtype_bytes,
        optimizer=shard * 8,
        gathered_params=cb * counts.root + 2 * gathered_block,
        gradient_buffers=cb * counts.root + (cb + reduce_copy) * counts.block,
        activations_no_checkpointing=acts["none"],
        activations_checkpointing=acts["full"],
        activations_selective=acts["selective"],
        loss_head=loss_head_bytes(cfg, tokens, cb, loss_chunk),
        loss_head_plain=loss_head_bytes(cfg, tokens, cb, 0),
        loss_chunk=loss_chunk,
        blocks=blocks,
        activations_auto=blocks_activations(cfg, tokens, cb, blocks, float8, linear) if blocks else 0,
        host_memory_per_rank=4 * counts.largest,
        host_memory_per_rank_eager=4 * counts.total,
        full_every=full_every,
        float8=float8,
        document_mask=document_mask_bytes(cfg, micro_batch, seq_len, cb, documents),
    )


def loss_head_bytes(cfg: ModelConfig, tokens: int, cb: int, loss_chunk: int = 0) -> int:
    """The loss head of one micro-batch of `tokens`: plain (all logits) or chunked (module docstring)."""
    h, vocab = cfg.dim, cfg.vocab_size
    hidden = tokens * h * (4 + cb) + tokens * h * cb  # the final norm's saved input and its output
    if not loss_chunk:
        return hidden + tokens * vocab * (12 + cb)
    return hidden + 16 * tokens + min(loss_chunk, tokens) * vocab * (8 + cb)


def document_mask_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, cb: int, documents: str) -> int:
    """The block mask and what comes with it for one micro-batch (module docstring); 0 if causal."""
    if documents == "causal":
        return 0
    tiles = -(-seq_len // FLEX_TILE)
    block_mask = 16 * micro_batch * tiles * (tiles + 1)
    ids = 8 * micro_batch * (tiles * FLEX_TILE + seq_len)
    rotary = 2 * micro_batch * seq_len * cfg.head_dim * cb if documents.endswith("positions") else 0
    return block_mask + ids + rotary


@dataclass(frozen=True)
class DocumentAttention:
    """What keeping documents apart computes of causal attention, at one mean document length."""

    mean_tokens: float
    tile_share: float  # the share of causal attention's tiles the block mask visits
    flops_saved: float  # attention FLOPs per token saved against the causal kernel
    step_share: float  # ... as a share of the FLOPs per token counted (flops_per_token)


def document_attention(
    cfg: ModelConfig, seq_len: int, mean_tokens: float, windows: int = 64, per_token: float | None = None
) -> DocumentAttention:
    """The attention FLOPs documents of `mean_tokens` save in windows of `seq_len` (module docstring);
    `per_token`: the model's counted FLOPs per token, when the caller has them."""
    generator = torch.Generator().manual_seed(0)
    ends = (torch.rand(windows * seq_len, generator=generator) < 1.0 / max(mean_tokens, 1.0)).long()
    documents = (ends.cumsum(0) - ends).view(windows, seq_len)
    partial, full = document_tiles(documents - documents[:, :1])
    tiles = partial.shape[-1]
    causal = windows * tiles * (tiles + 1) // 2
    share = float((partial | full).sum()) / causal
    # The counted attention term (12 L h T, not halved) of which the causal kernel visits half the tiles.
    attention = 12.0 * cfg.n_layers * cfg.dim * seq_len * (tiles + 1) / (2 * tiles)
    if per_token is None:
        with torch.device("meta"):
            per_token = Transformer(cfg).flops_per_token(seq_len)
    saved = attention * (1 - share)
    return DocumentAttention(mean_tokens, share, saved, saved / per_token)


# Least recomputation first: none recomputes nothing, selective only the cheap elementwise ops,
# every k-th block in full adds a forward of 1/k of the blocks, full adds a forward of all of them.
POLICY_LADDER = (
    ("none", 0),
    ("selective", 0),
    ("selective", 4),
    ("selective", 3),
    ("selective", 2),
    ("full", 0),
)


def cheapest_policy(cfg: ModelConfig, *, gpu_bytes: float, **plan_args) -> tuple[str, int, MemoryPlan] | None:
    """The first (policy, full_every) of POLICY_LADDER whose plan fits `gpu_bytes`; None if none fits."""
    for policy, every in POLICY_LADDER:
        plan = plan_memory(cfg, activation_checkpointing=policy, full_every=every, **plan_args)
        if plan.fits(gpu_bytes):
            return policy, every, plan
    return None


def block_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs per token of one block's forward, as `flops_per_token` counts them: its matmuls
    (2 x its linear parameters) and a third of its attention term (12 h T, forward + backward)."""
    h, f = cfg.dim, cfg.ffn_hidden_dim
    linear = 2 * h * (cfg.n_heads * cfg.head_dim) + 2 * h * (cfg.kv_heads * cfg.head_dim) + 3 * h * f
    return 2.0 * linear + 4.0 * h * seq_len


def recompute_share(
    cfg: ModelConfig, seq_len: int, full_blocks: int, per_token: float | None = None
) -> float:
    """The share of a step's counted FLOPs spent recomputing `full_blocks` blocks in full."""
    if per_token is None:
        with torch.device("meta"):
            per_token = Transformer(cfg).flops_per_token(seq_len)
    return full_blocks * block_forward_flops(cfg, seq_len) / per_token


def auto_checkpointing(
    cfg: ModelConfig, *, gpu_bytes: float, selective: bool = True, **plan_args
) -> tuple[Blocks, MemoryPlan] | None:
    """The per-block choice with the fewest blocks recomputed in full, then the most left whole,
    whose plan fits `gpu_bytes` (less the 10% reserve); `selective=False` (compile) chooses among
    none and full only. None if even full recomputation of every block does not fit."""
    base = plan_memory(cfg, activation_checkpointing="none", **plan_args)
    room = gpu_bytes * 0.9 - base.static - base.per_batch
    cb = 2 if base.compute == "bf16" else 4
    tokens, layers = base.micro_batch * base.seq_len, cfg.n_layers
    linear = count_params(cfg).block - 2 * cfg.dim
    for full in range(layers + 1):
        wholes = range(layers - full, -1, -1) if selective else [layers - full]
        for whole in wholes:
            blocks = Blocks(whole=whole, selective=layers - full - whole, full=full)
            if blocks_activations(cfg, tokens, cb, blocks, base.float8, linear) <= room:
                return blocks, plan_memory(cfg, activation_checkpointing="auto", blocks=blocks, **plan_args)
    return None


@dataclass(frozen=True)
class ModelSummary:
    params: int
    non_embedding_params: int
    flops_per_token: float
    tokens_per_step: int
    flops_per_step: float

    def format(self) -> str:
        return "\n".join(
            [
                f"  parameters                  {self.params:>16,}",
                f"  non-embedding parameters    {self.non_embedding_params:>16,}",
                f"  training FLOPs per token    {self.flops_per_token:>16.4g}",
                f"  tokens per optimizer step   {self.tokens_per_step:>16,}",
                f"  FLOPs per optimizer step    {self.flops_per_step:>16.4g}",
            ]
        )


def describe(cfg: ModelConfig, seq_len: int, global_batch_tokens: int) -> ModelSummary:
    """Parameters, FLOPs per token at ``seq_len``, and tokens per optimizer step."""
    with torch.device("meta"):
        model = Transformer(cfg)
    per_token = model.flops_per_token(seq_len)
    return ModelSummary(
        params=model.num_params(),
        non_embedding_params=model.num_params(exclude_embeddings=True),
        flops_per_token=per_token,
        tokens_per_step=global_batch_tokens,
        flops_per_step=per_token * global_batch_tokens,
    )


def describe_run(
    cfg: TrainConfig,
    gpus: int = DEFAULT_GPUS,
    gpu_gb: float = DEFAULT_GPU_GB,
    gpu_type: str = DEFAULT_GPU_TYPE,
    mfu: float | None = None,
    upload_bandwidth: str = DEFAULT_UPLOAD_BANDWIDTH,
    disk_bandwidth: str = DEFAULT_DISK_BANDWIDTH,
    snapshot_bandwidth: str = DEFAULT_SNAPSHOT_BANDWIDTH,
) -> str:
    """The dry run of a recipe on `gpus` GPUs of `gpu_gb` GB each: sizes, FLOPs, run length,
    sharding, memory, the run's cost on `gpu_type` at `mfu` (default: 40% and 50%), and what its
    checkpoints cost at `upload_bandwidth` / `disk_bandwidth` per node (sizes per second)."""
    if not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus={gpus} must be a number of GPUs from 1 to {MAX_GPUS:,}")
    if not 0 < gpu_gb <= MAX_GPU_GB:  # nan and inf too
        raise ConfigError(
            f"--gpu-gb={gpu_gb} must be a GPU's memory in GB, above 0 and at most {MAX_GPU_GB:g}"
        )
    if gpu_type not in PEAK_BF16_FLOPS:
        raise ConfigError(f"--gpu-type {gpu_type!r} is not one of {', '.join(PEAK_BF16_FLOPS)}")
    if mfu is not None and not MIN_MFU <= mfu <= 1:  # below 1% a GPU does not train: a typo (1e-300)
        raise ConfigError(f"--mfu must be a fraction in [{MIN_MFU:g}, 1], e.g. 0.45, got {mfu:g}")
    cfg.check_profile_ranks(gpus)
    microbatch = []
    if not cfg.training.device_microbatch_size:  # 0: from the plan, as the trainer resolves it
        choice = plan_microbatch(cfg, gpus, gpu_gb * 1e9)
        cfg, microbatch = with_microbatch(cfg, choice.micro_batch), [choice.line()]
    t = cfg.training
    seq_len = cfg.model.max_seq_len
    tokens_per_step = t.global_batch_size * seq_len
    summary = describe(cfg.model, seq_len, tokens_per_step)
    lines = [f"recipe {cfg.run_name}: model built on the meta device (nothing allocated)", summary.format()]
    lines.append(_batch_line(cfg, gpus))
    lines += microbatch
    lines += attention_lines(cfg)
    total_flops = None
    if not t.max_duration.endswith("ep"):
        steps = duration_in_batches(t.max_duration, tokens_per_step)
        total_flops = steps * summary.flops_per_step
        lines.append(
            f"  run length                  {steps:>16,} steps = {steps * tokens_per_step:,} tokens, "
            f"{total_flops:.4g} FLOPs"
        )
    shards, sharding = sharding_plan(cfg, gpus)
    plan = recipe_plan(cfg, shards, gpu_gb * 1e9)
    verdict = "fits" if plan.fits(gpu_gb * 1e9) else "does NOT fit"
    lines += ["", sharding, plan.format(gpu_gb), f"=> this recipe {verdict} on {gpus} x {gpu_gb:g} GB GPUs"]
    lines += recompute_lines(cfg, plan, summary.flops_per_token)
    if total_flops is None:
        lines += ["", "Cost: max_duration is in epochs; give it in batches or tokens for a cost estimate"]
    else:
        tokens = total_flops / summary.flops_per_token
        lines += ["", format_cost(total_flops, tokens, gpus, gpu_type, mfu)]
    try:
        upload, disk = parse_bandwidth(upload_bandwidth), parse_bandwidth(disk_bandwidth, "--disk-bandwidth")
        snapshot = parse_bandwidth(snapshot_bandwidth, "--snapshot-bandwidth")
    except BandwidthError as err:
        raise ConfigError(str(err)) from None
    step_s = summary.flops_per_step / (gpus * PEAK_BF16_FLOPS[gpu_type] * (mfu or ANCHOR_MFU))
    cost = checkpoint_cost(cfg, gpus, summary.params, step_s, upload, disk, snapshot)
    bandwidths = {"upload": upload_bandwidth, "disk": disk_bandwidth, "snapshot": snapshot_bandwidth}
    notices = tuple(sorted({*NOTICES_S, *([cfg.preemption.notice_s] if cfg.preemption.notice_s else [])}))
    lines += ["", cost.format(bandwidths, mfu or ANCHOR_MFU, cfg.checkpoint.save_interval, notices)]
    return "\n".join(lines)


def recipe_plan(cfg: TrainConfig, shards: int, gpu_bytes: float) -> MemoryPlan:
    """The memory plan of the recipe with its parameters sharded over `shards` GPUs of `gpu_bytes`;
    `fsdp.activation_checkpointing=auto` chooses its blocks here (`auto_checkpointing`; full
    recomputation of every block when nothing fits, which the plan then reports)."""
    t, f = cfg.training, cfg.fsdp
    policy = f.activation_checkpointing if f.enabled else "none"
    args = dict(
        n_gpus=shards,
        micro_batch=t.device_microbatch_size,
        seq_len=cfg.model.max_seq_len,
        compute="fp32" if t.precision == "fp32" else "bf16",
        float8=t.float8.enabled,
        documents=documents_setting(cfg),
        loss_chunk=cfg.model.loss_chunk,
    )
    if policy == "auto":
        chosen = auto_checkpointing(cfg.model, gpu_bytes=gpu_bytes, selective=not t.compile, **args)
        everything = Blocks(whole=0, selective=0, full=cfg.model.n_layers)
        return (
            chosen[1]
            if chosen
            else plan_memory(cfg.model, activation_checkpointing="auto", blocks=everything, **args)
        )
    return plan_memory(
        cfg.model,
        activation_checkpointing=policy,
        full_every=f.checkpoint_full_every if f.enabled else 0,
        **args,
    )


def full_blocks(plan: MemoryPlan, layers: int) -> int:
    """How many of the `layers` blocks the plan's checkpointing recomputes in full."""
    if plan.blocks is not None:
        return plan.blocks.full
    if plan.activation_checkpointing == "full":
        return layers
    if plan.activation_checkpointing == "selective" and plan.full_every:
        return layers // plan.full_every
    return 0


def with_microbatch(cfg: TrainConfig, micro_batch: int) -> TrainConfig:
    """`cfg` with `training.device_microbatch_size=micro_batch` (a copy; `cfg` is left as it is)."""
    return replace(cfg, training=replace(cfg.training, device_microbatch_size=micro_batch))


@dataclass(frozen=True)
class MicrobatchChoice:
    """`training.device_microbatch_size: 0`: each candidate micro-batch's plan, and the one chosen."""

    micro_batch: int
    per_rank: int
    gpu_bytes: float
    rows: tuple[tuple[int, float | None, int], ...]  # (micro-batch, recomputed share or None: no fit, bytes)

    def line(self) -> str:
        """The trade-off in one line: more tokens per micro-batch against more recomputation."""
        cells = ", ".join(
            f"{mb}: " + ("does not fit" if share is None else f"{100 * share:.1f}% {_gib_or_mib(total)}")
            for mb, share, total in self.rows
        )
        chosen = dict((mb, share) for mb, share, _ in self.rows)[self.micro_batch]
        why = (
            "the least recomputation that fits, then the most tokens per micro-batch"
            if chosen is not None
            else "nothing fits, the smallest"
        )
        return (
            f"[micro-batch] from the plan: {self.micro_batch} of {self.per_rank} samples per GPU ({why}); "
            f"each micro-batch's recomputed share of the step's FLOPs and planned memory of "
            f"{self.gpu_bytes / 1e9:g} GB: {cells}"
        )


def _gib_or_mib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def plan_microbatch(cfg: TrainConfig, world_size: int, gpu_bytes: float) -> MicrobatchChoice:
    """`training.device_microbatch_size: 0`: among the divisors of the per-rank batch, the micro-batch
    whose plan (under the recipe's checkpointing; `auto` chooses its blocks per candidate) fits
    `gpu_bytes` with the least share of the step's FLOPs recomputed, then the largest; 1 when none
    fits. ConfigError if the global batch does not divide over `world_size` ranks."""
    per_rank = cfg.check_world_size(world_size)
    shards, _ = sharding_plan(cfg, world_size)
    m = cfg.model
    with torch.device("meta"):
        per_token = Transformer(m).flops_per_token(m.max_seq_len)
    rows = []
    for mb in (d for d in range(1, per_rank + 1) if per_rank % d == 0):
        plan = recipe_plan(with_microbatch(cfg, mb), shards, gpu_bytes)
        share = recompute_share(m, m.max_seq_len, full_blocks(plan, m.n_layers), per_token)
        rows.append((mb, share if plan.fits(gpu_bytes) else None, plan.total))
    fitting = [(share, -mb) for mb, share, _ in rows if share is not None]
    chosen = -min(fitting)[1] if fitting else 1
    return MicrobatchChoice(chosen, per_rank, gpu_bytes, tuple(rows))


def recompute_lines(cfg: TrainConfig, plan: MemoryPlan, per_token: float) -> list[str]:
    """What the recipe's checkpointing recomputes, as a share of the step's FLOPs, beside the
    fixed policies'."""
    m, layers = cfg.model, cfg.model.n_layers
    if plan.activation_checkpointing == "none":
        return []

    def share(full: int) -> str:
        return f"{100 * recompute_share(m, m.max_seq_len, full, per_token):.1f}%"

    full = full_blocks(plan, layers)
    if plan.blocks is not None:
        how = f"auto ({plan.blocks.words()})"
    elif plan.activation_checkpointing == "full":
        how = "full"
    else:
        how = "selective" + (f", 1 block in {plan.full_every} full" if plan.full_every else "")
    return [
        f"  recomputation               {how}: {share(full)} of the step's FLOPs recomputed "
        f"(every block in full: {share(layers)}, every 2nd block in full: {share(layers // 2)}; "
        "selective recomputes elementwise ops only)"
    ]


def documents_setting(cfg: TrainConfig) -> str:
    """`plan_memory`'s `documents` for the recipe: causal, document or document+positions."""
    m = cfg.model
    if cfg.data.kind == "sft":  # the examples are always apart, positions restarting
        return "document+positions"
    if m.attention != "document":
        return "causal"
    return "document+positions" if m.positions == "document" else "document"


def attention_lines(cfg: TrainConfig) -> list[str]:
    """What a token attends to, the kernels, and the attention FLOPs documents kept apart save."""
    m, seq_len, indent = cfg.model, cfg.model.max_seq_len, " " * 30
    kernels = "FlexAttention on GPUs (compiled, one block mask per batch), SDPA + a boolean mask on CPUs"
    if cfg.data.kind == "sft":
        head = [
            "per conversation (data.kind=sft: the segments column), positions restarting at each",
            kernels,
        ]
    elif m.attention == "document":
        positions = (
            "restart at each document" if m.positions == "document" else "count from the sample's start"
        )
        head = [
            "within each document (model.attention=document; the shards' EOS id separates them)",
            f"positions {positions} (model.positions={m.positions})",
            kernels,
        ]
    else:
        head = [f"causal over each {seq_len:,}-token sample (model.attention=causal: SDPA's causal kernel)"]
    lines = [f"  attention                   {head[0]}", *(indent + line for line in head[1:])]
    lengths = [(n, "") for n in (seq_len // 8, seq_len // 4, seq_len // 2) if n >= 1]
    own = shards_mean_document(cfg)
    if own is not None:
        lengths.append((own, " (the shards' mean, data.train.0's meta.json)"))
    verb = "saves" if m.attention == "document" or cfg.data.kind == "sft" else "would save"
    lines.append(f"{indent}documents apart, of a mean length of ... tokens: the share of causal's 128 x 128")
    lines.append(f"{indent}tiles the block mask visits, and the FLOPs per token it {verb}:")
    with torch.device("meta"):
        per_token = Transformer(m).flops_per_token(seq_len)
    for tokens, note in lengths:
        d = document_attention(m, seq_len, tokens, per_token=per_token)
        lines.append(
            f"{indent}  {tokens:>7,.0f}: {100 * d.tile_share:3.0f}% of the tiles, "
            f"{100 * d.step_share:4.1f}% of the FLOPs{note}"
        )
    lines.append(f"{indent}(MFU and the FLOPs per token above count the causal window either way)")
    return lines


def shards_mean_document(cfg: TrainConfig) -> float | None:
    """Mean tokens per document of the first train stream, from its meta.json when it is a local
    folder (a dry run reads nothing remote); None when unknown."""
    from shards.errors import ShardsError
    from shards.meta import read_meta
    from storage import StorageError, is_remote

    remote = cfg.data.train[0].remote
    if is_remote(remote) or not Path(remote, "meta.json").is_file():
        return None
    try:
        meta = read_meta(remote)
    except (ShardsError, StorageError):
        return None
    return meta.num_tokens / meta.num_documents if meta.num_documents else None


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint of a recipe on `size.gpus` GPUs: its size, its seconds, the stall-free interval
    and the work a preemption loses (module docstring)."""

    size: CheckpointSize
    write_s: float  # the node's local write
    upload_s: float  # the node's upload
    step_s: float
    snapshot_s: float = 0.0  # a rank's device-to-host copy: the stall with snapshots
    max_stall: float = STALL_TARGET  # checkpoint.max_stall
    margin_s: float = 5.0  # preemption.margin_s
    node_memory: float | None = None  # checkpoint.node_memory_gb, in bytes
    restart: RestartCost | None = None  # what the restart after a preemption costs

    @property
    def background_s(self) -> float:
        """What a snapshot save does off the training thread: write, then upload."""
        return self.write_s + self.upload_s

    @property
    def sync_stall_s(self) -> float:
        return self.write_s + self.upload_s

    @property
    def stop_save_s(self) -> float:
        """A save on SIGTERM, from the signal to stored: snapshot, write, upload."""
        return self.snapshot_s + self.background_s

    @property
    def interval_snapshot(self) -> int:
        """The stall-free interval with snapshots: what `save_interval: auto` picks at these rates."""
        return stall_free_interval(self.snapshot_s, self.background_s, self.step_s, self.max_stall)

    @property
    def interval_background(self) -> int:
        """Writing on the training step, uploading in the background (`checkpoint.snapshot: false`)."""
        return stall_free_interval(self.write_s, self.upload_s, self.step_s, self.max_stall)

    @property
    def interval_sync(self) -> int:
        return stall_free_interval(self.sync_stall_s, 0.0, self.step_s, self.max_stall)

    def stall(self, mode: str) -> float:
        return {"snapshot": self.snapshot_s, "background": self.write_s, "sync": self.sync_stall_s}[mode]

    def stall_share(self, interval: int, mode: str = "snapshot") -> float:
        stall = self.stall(mode)
        return stall / (stall + interval * self.step_s)

    def fits(self, notice_s: float) -> bool:
        """Whether a save on SIGTERM ends within the notice less its margin (else none is started)."""
        return self.stop_save_s <= notice_s - self.margin_s

    def lost_s(self, interval: int, notice_s: float | None = None) -> float:
        """Expected training time a preemption loses with saves every `interval` batches (snapshots):
        none but the restart when a save fits the notice; else the time since the newest complete
        checkpoint, on average half an interval plus the part of the background save in flight
        that the notice (less its margin) cannot wait for."""
        if notice_s is not None and self.fits(notice_s):
            return 0.0
        usable = max(0.0, notice_s - self.margin_s) if notice_s is not None else 0.0
        return interval * self.step_s / 2 + max(0.0, self.background_s - usable)

    def time_lost_s(self, interval: int, notice_s: float | None = None) -> float:
        """What a preemption costs in all: the work it loses (`lost_s`) and the restart."""
        return self.lost_s(interval, notice_s) + (self.restart.total_s if self.restart else 0.0)

    def format(
        self,
        bandwidths: dict[str, str],
        mfu: float,
        save_interval: str,
        notices: tuple[float, ...] = NOTICES_S,
    ) -> str:
        s, gb = self.size, 1e9
        writers = f"{s.writers} writing rank(s)" if s.writers > 1 else "rank 0 writes it all"
        fits = ", ".join(f"{n:g} s: {'fits' if self.fits(n) else 'does NOT fit'}" for n in notices)
        node = (
            "; the node's memory not given (checkpoint.node_memory_gb)"
            if self.node_memory is None
            else f"; {'fits' if s.per_node <= self.node_memory else 'does NOT fit'} the node's "
            f"{self.node_memory / gb:g} GB (checkpoint.node_memory_gb)"
        )
        lines = [
            f"Checkpoints: {s.total / gb:.1f} GB each ({writers}), {s.per_rank / gb:.2f} GB per rank, "
            f"{s.per_node / gb:.1f} GB per node",
            f"  host memory                 the snapshot: {s.per_rank / gb:.2f} GB per writing rank, "
            f"{s.per_node / gb:.1f} GB per node (checkpoint.snapshot; pinned on GPUs){node}",
            f"  save time                   snapshot {self.snapshot_s:.2f} s at {bandwidths['snapshot']} per GPU "
            f"(--snapshot-bandwidth), the step's only wait; then in the background write {self.write_s:.1f} s "
            f"at {bandwidths['disk']} per node (--disk-bandwidth), store {self.upload_s:.1f} s at "
            f"{bandwidths['upload']} per node (--upload-bandwidth)",
            f"  SIGTERM save ({self.stop_save_s:.0f} s)         {fits} (a notice less preemption.margin_s "
            f"{self.margin_s:g} s; a save that does not fit is not started)",
            f"  step time                   {self.step_s:.2f} s at {100 * mfu:.0f}% MFU",
            f"  stall under {100 * self.max_stall:g}%              save_interval >= {self.interval_snapshot}ba "
            f"with snapshots (what auto picks: the snapshot under checkpoint.max_stall, each write and upload "
            f"done before the next save), >= {self.interval_background}ba writing on the step "
            f"(checkpoint.snapshot=false, background uploads), >= {self.interval_sync}ba with synchronous ones",
        ]
        if self.restart is not None:
            lines.append(self._restart_line(bandwidths))
        batches = self._interval_batches(save_interval)
        if batches is not None:
            lines.append(
                f"  recipe's {save_interval:<18s}every {batches}ba ({_duration(batches * self.step_s)}): stall "
                f"{100 * self.stall_share(batches):.2f}% with snapshots ({100 * self.stall_share(batches, 'background'):.2f}% "
                f"writing on the step); {self._lost_text(batches, notices)}"
            )
        return "\n".join(lines)

    def _lost_text(self, batches: int, notices: tuple[float, ...]) -> str:
        """What a preemption costs on average at this interval, without notice and with each."""
        if self.restart is None:  # the work alone
            lost = [f"{_duration(self.lost_s(batches))} without notice"] + [
                f"restart only with a {n:g} s notice"
                if self.fits(n)
                else f"{_duration(self.lost_s(batches, n))} with a {n:g} s notice"
                for n in notices
            ]
            return f"work lost per preemption on average: {', '.join(lost)}"
        restart = self.restart.total_s
        lost = [
            f"{_duration(self.time_lost_s(batches))} without notice ({self.lost_s(batches) / 60:.1f} of work "
            f"+ {restart / 60:.1f} of restart)"
        ] + [
            f"{_duration(self.time_lost_s(batches, n))} with a {n:g} s notice"
            + (" (the restart only)" if self.fits(n) else "")
            for n in notices
        ]
        return f"time lost per preemption on average: {', '.join(lost)}"

    def _restart_line(self, bandwidths: dict[str, str]) -> str:
        r, s, gb = self.restart, self.size, 1e9
        return (
            f"  restart                     {_duration(r.total_s)} on a warm spare node: process and imports "
            f"{r.imports_s:.0f} s, process group {r.process_group_s:.0f} s, checkpoint load "
            f"{r.download_s + r.load_s:.0f} s ({s.per_node / gb:.1f} GB per node from the store at "
            f"{bandwidths['upload']}, --upload-bandwidth; then {s.per_rank / gb:.2f} GB into each GPU at "
            f"{bandwidths['snapshot']}), data position and stream warm-up {r.data_s:.0f} s (the first "
            f"batch's shards, {r.data_bytes / gb:.1f} GB per node at {bandwidths['upload']}), first step's "
            f"warm-up {r.warmup_s:.0f} s; imports, process group and warm-up assumed (docs/resume.md)"
        )

    def _interval_batches(self, save_interval: str) -> int | None:
        """The recipe's interval in batches at this step time (None: in epochs, unknown here)."""
        if save_interval.strip() == "auto":
            return self.interval_snapshot
        seconds = wall_clock_seconds(save_interval)
        if seconds is not None:
            return max(1, math.ceil(seconds / self.step_s))
        amount, unit = parse_duration(save_interval, "checkpoint.save_interval", ("ba", "tok", "ep"))
        return amount if unit == "ba" else None


def checkpoint_cost(
    cfg: TrainConfig,
    gpus: int,
    params: int,
    step_s: float,
    upload_bw: float,
    disk_bw: float,
    snapshot_bw: float | None = None,
) -> CheckpointCost:
    """What one checkpoint of `cfg` costs on `gpus` GPUs (bandwidths in bytes/s: upload and disk per
    node, the snapshot's device-to-host copy per GPU)."""
    sharded = cfg.fsdp.enabled and cfg.fsdp.state_dict_type == "sharded"
    shards = gpus // cfg.fsdp.replicate if cfg.fsdp.enabled and gpus % cfg.fsdp.replicate == 0 else gpus
    size = checkpoint_size(params, gpus, sharded=sharded, shards=shards)
    snapshot_bw = snapshot_bw or parse_bandwidth(DEFAULT_SNAPSHOT_BANDWIDTH)
    data_bytes = first_batch_bytes(cfg, gpus, size.gpus_per_node)
    restart = RestartCost(
        download_s=size.seconds(upload_bw),
        load_s=size.per_rank / snapshot_bw,
        data_s=data_bytes / upload_bw,
        data_bytes=data_bytes,
    )
    return CheckpointCost(
        size,
        size.seconds(disk_bw),
        size.seconds(upload_bw),
        step_s,
        snapshot_s=size.per_rank / snapshot_bw,
        max_stall=cfg.checkpoint.max_stall,
        margin_s=cfg.preemption.margin_s,
        node_memory=cfg.checkpoint.node_memory_gb * 1e9 if cfg.checkpoint.node_memory_gb else None,
        restart=restart,
    )


def first_batch_bytes(cfg: TrainConfig, gpus: int, gpus_per_node: int) -> int:
    """What a node's ranks read from the store for their first batch after a restart on a node
    without the stream's cache: each rank its first batch's shards (`first_batch_shards`)."""
    per_rank = max(1, cfg.training.global_batch_size // gpus)
    token_bytes = 2 if cfg.model.vocab_size <= 1 << 16 else 4
    shards = first_batch_shards(per_rank, cfg.model.max_seq_len, token_bytes, cfg.data.shuffle_block_size)
    return gpus_per_node * shards * DEFAULT_SHARD_BYTES


def sharding_plan(cfg: TrainConfig, gpus: int) -> tuple[int, str]:
    """(GPUs each parameter is sharded over, a line saying how the recipe spreads the model)."""
    f = cfg.fsdp
    compute = "fp32" if cfg.training.precision == "fp32" else "bf16"
    extras = (
        f"{compute} compute"
        + (", fp32 master weights and gradient reduction" if compute == "bf16" and f.enabled else "")
        + f", activation checkpointing {_policy_words(f) if f.enabled else 'none'}"
        + (", float8 block matmuls" if cfg.training.float8.enabled else "")
        + f", compile {'per block' if cfg.training.compile else 'off'}"
    )
    if not f.enabled:
        return 1, f"Sharding: none (fsdp.enabled=false): DDP, a full copy on each of {gpus} GPU(s); {extras}"
    if gpus % f.replicate:
        raise ConfigError(
            f"fsdp.replicate={f.replicate} does not divide {gpus} GPUs: use one replica group per node"
        )
    shards = gpus // f.replicate
    if f.replicate == 1:
        return shards, f"Sharding: FSDP2 full shard over {gpus} GPU(s); {extras}"
    return shards, (
        f"Sharding: FSDP2 HSDP, {f.replicate} replica groups (fsdp.replicate) x {shards}-way shards "
        f"over {gpus} GPUs: gradients reduce-scattered within a group, all-reduced between groups; {extras}"
    )


def _policy_words(f) -> str:
    if f.activation_checkpointing == "auto":
        return "auto (the plan chooses per block, below)"
    every = f", 1 block in {f.checkpoint_full_every} full" if f.checkpoint_full_every else ""
    return f"{f.activation_checkpointing}{every}"


@dataclass(frozen=True)
class RunCost:
    """Wall time and GPU-hours of `flops` training FLOPs on `gpus` GPUs at `mfu`."""

    flops: float
    gpus: int
    gpu_type: str
    mfu: float

    @property
    def seconds(self) -> float:
        return self.flops / (self.gpus * PEAK_BF16_FLOPS[self.gpu_type] * self.mfu)

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600


def format_cost(flops: float, tokens: float, gpus: int, gpu_type: str, mfu: float | None) -> str:
    peak = PEAK_BF16_FLOPS[gpu_type]
    if mfu is None:
        cases = [(ANCHOR_MFU, "anchors: llm-foundry 46.4%, torchtitan 33.7-39%"), (TARGET_MFU, "our target")]
    else:
        cases = [(mfu, "measured")]
    lines = [
        f"Cost of the whole run: {flops:.4g} FLOPs ({tokens:.4g} tokens) on {gpus} x {gpu_type} "
        f"({peak / 1e12:g} TFLOP/s dense bf16 each)"
    ]
    for fraction, why in cases:
        cost = RunCost(flops, gpus, gpu_type, fraction)
        lines.append(
            f"  at {100 * fraction:4.1f}% MFU {tokens / cost.seconds:>14,.0f} tokens/s   wall "
            f"{_duration(cost.seconds):>13}   {cost.gpu_hours:>12,.0f} GPU-hours   ({why})"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.1f} minutes"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def _batch_line(cfg: TrainConfig, gpus: int) -> str:
    t = cfg.training
    try:
        per_gpu = cfg.check_world_size(gpus)
    except ConfigError as err:
        return f"  batch                       does not divide over {gpus} GPUs: {err}"
    accum = per_gpu // t.device_microbatch_size
    return (
        f"  batch per GPU               {per_gpu:>16,} samples = {accum} micro-batch(es) of "
        f"{t.device_microbatch_size} x {cfg.model.max_seq_len} tokens"
    )
