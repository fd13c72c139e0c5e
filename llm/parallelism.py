"""How the model is spread over the ranks: FSDP2 or HSDP, activation checkpointing, compile.

One path for CPUs and GPUs. Composer 0.32.1 applies FSDP2 (`torch.distributed.fsdp.fully_shard`)
from the `FSDP2Config` that `sharding_config` returns: one unit per `TransformerBlock` plus the
root (embedding, final norm, output), activation checkpointing wrapped around each block
(`LanguageModel.activation_checkpointing_fn`), parameters gathered in the compute dtype and
gradients reduce-scattered in fp32 (`mixed_precision: DEFAULT`; Composer's
`create_mixed_precision_policy`), sharded checkpoints through torch.distributed.checkpoint. The
same code runs over NCCL on GPUs and over gloo on CPUs, where the tests exercise it.

What Composer 0.32.1 lacks, and this module adds:

- HSDP. Composer's `FSDP2Config.data_parallel_replicate_degree` is a read-only property that is
  always None, and `State.__init__` replaces any `device_mesh` the config carries with a 1-D
  mesh built from it (`composer/core/state.py`, `_create_device_mesh`). torch 2.7's own HSDP
  (`fully_shard` on a 2-D mesh) does not run on CPUs either: it all-reduces between replicas
  with `ReduceOp.AVG`, which gloo refuses ("Cannot use ReduceOp.AVG with Gloo"), and it asserts a
  CUDA event after that all-reduce (`_fsdp_param_group.post_backward`). So HSDP is built here
  from public torch APIs, the same on GPUs and CPUs: `HybridShardConfig` reports the replicate
  degree, so Composer builds the 2-D mesh `(replicate, shard)` under the dimension names its
  checkpoint code understands (only the first replica writes shards; a remote checkpoint is
  downloaded by the first replica and broadcast to the others); the config hands `fully_shard`
  the 1-D shard sub-mesh, so each replica group is an ordinary FSDP2 group; and
  `all_reduce_between_replicas` installs FSDP2's documented all-reduce hook on every unit: after
  the reduce-scatter inside a group it sums the gradient shard over the replicas and divides by
  their number. `init_device_mesh` numbers ranks row-major, so each shard group is a run of
  consecutive global ranks: with `composer --nproc 8` per node and `replicate` = the number of
  nodes, parameters are sharded within a node and replicated across nodes.
- Compiling per block. Composer's `compile_config` compiles the whole model's forward; torchtitan
  compiles each transformer block instead (one small graph reused by every block, no graph
  break at FSDP's per-block hooks). `compile_blocks` does that before Composer wraps anything,
  by compiling each block's `forward` (so FSDP's hooks and the checkpoint wrapper stay outside
  the compiled code and parameter names do not change). Only the training path (no KV cache; no
  mask, or the FlexAttention block mask of documents kept apart) is compiled; generation's
  incremental decoding and the boolean masks of evaluation run eagerly instead of recompiling for
  every cache position or mask shape.

Meta-device initialisation stays Composer's: on GPUs the model is built on the meta device and
each rank materialises only its shards through `Transformer.param_init_fn`
(`composer.distributed.param_init.meta_init`, which hard-codes `to_empty(device="cuda")`; on CPUs
the trainer builds the small models for real, see `llm/meta_init.py` for the CPU-testable twin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from composer.utils import FSDP2Config
from torch import nn

from llm.config import FSDPConfig
from llm.errors import ConfigError
from llm.model import Transformer, TransformerBlock

REPLICATE_DIM = "data_parallel_replicate"  # Composer's mesh dimension names (ParallelismType)
SHARD_DIM = "data_parallel_shard"


@dataclass
class HybridShardConfig(FSDP2Config):
    """Composer's `FSDP2Config` plus a replicate degree (HSDP when > 1): see the module docstring.

    Composer sets `device_mesh` to its 2-D `(replicate, shard)` mesh; the config keeps that as
    `hybrid_mesh` and gives `fully_shard` this rank's 1-D shard group instead.
    """

    replicate: int = 1

    @property
    def data_parallel_replicate_degree(self) -> int | None:
        return self.replicate if self.replicate > 1 else None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "device_mesh" and value is not None and value.ndim == 2:
            object.__setattr__(self, "hybrid_mesh", value)
            value = value[SHARD_DIM]
        super().__setattr__(name, value)


def sharding_config(fsdp: FSDPConfig, world_size: int) -> HybridShardConfig | None:
    """Composer's `parallelism_config["fsdp"]` for the recipe, or None for plain DDP training."""
    if not fsdp.enabled:
        return None
    if world_size % fsdp.replicate:
        raise ConfigError(
            f"fsdp.replicate={fsdp.replicate} does not divide the world size {world_size}: use one "
            "replica group per node (fsdp.replicate=<nodes>), or fsdp.replicate=1 to shard over all ranks"
        )
    return HybridShardConfig(
        replicate=fsdp.replicate,
        activation_checkpointing=False,  # applied by `apply_activation_checkpointing` (build_model)
        state_dict_type=fsdp.state_dict_type,
        mixed_precision=fsdp.mixed_precision,
    )


def all_reduce_between_replicas(model: nn.Module, config: FSDP2Config | None) -> int:
    """HSDP's replica all-reduce on every FSDP unit of `model` (after Composer sharded it).

    Returns the number of units hooked: 0 without HSDP. Summing and dividing (rather than
    `ReduceOp.AVG`) works on NCCL and gloo alike; the hook runs on FSDP2's all-reduce stream.
    """
    from torch.distributed.fsdp import FSDPModule

    mesh = getattr(config, "hybrid_mesh", None)
    if mesh is None:
        return 0
    group, replicas = mesh.get_group(REPLICATE_DIM), mesh.size(0)

    def average_over_replicas(gradient_shard: torch.Tensor) -> None:
        torch.distributed.all_reduce(gradient_shard, group=group)
        gradient_shard.div_(replicas)

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_all_reduce_hook(average_over_replicas)
    return len(units)


# --- activation checkpointing ------------------------------------------------------------------

# The ops whose outputs the selective policy keeps: the matmuls and attention (the expensive ones;
# `_scaled_mm` is float8's matmul). Everything else in a block is recomputed in backward.
SAVED_OPS = frozenset(
    op
    for name in (
        "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
)  # fmt: skip


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def block_policies(n_layers: int, policy: str, full_every: int = 0) -> list[str]:
    """The checkpointing of each block: "none", "full" or "selective" (every k-th full if asked)."""
    if policy != "selective" or not full_every:
        return [policy] * n_layers
    return ["full" if (i + 1) % full_every == 0 else "selective" for i in range(n_layers)]


def apply_activation_checkpointing(model: Transformer, policy: str | list[str], full_every: int = 0) -> int:
    """Wrap the decoder blocks in checkpoint wrappers per `policy` (or a policy per block, as
    `fsdp.activation_checkpointing=auto` chooses them); returns how many were wrapped.

    Done here rather than by Composer's `FSDP2Config.activation_checkpointing`, which only knows
    full recomputation; the wrappers sit where Composer puts its own (inside each FSDP unit), and
    their state-dict hooks keep parameter names unchanged.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrapped = 0
    kinds = policy if isinstance(policy, list) else block_policies(len(model.layers), policy, full_every)
    for i, kind in enumerate(kinds):
        if kind == "none":
            continue
        options = {"context_fn": _selective_context} if kind == "selective" else {}
        block = model.layers[i]
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
        wrapped += 1
    return wrapped


# --- compile -----------------------------------------------------------------------------------


class CompiledBlockForward:
    """A block's `forward`: compiled for training (no KV cache; no mask or a FlexAttention block
    mask), eager otherwise."""

    def __init__(self, block: TransformerBlock):
        self.eager = block.forward
        self.compiled = torch.compile(block.forward)

    def __call__(self, x, cos, sin, mask=None, cache=None):
        # Training passes (x, cos, sin), and the block mask of documents on a GPU (llm/model.py).
        if cache is None and mask is None:
            return self.compiled(x, cos, sin)
        if cache is None and not isinstance(mask, torch.Tensor):
            return self.compiled(x, cos, sin, mask)
        return self.eager(x, cos, sin, mask, cache)


def compile_blocks(model: Transformer) -> int:
    """Compile each decoder block's training forward in place; returns how many were compiled."""
    for block in model.layers:
        if not isinstance(block.forward, CompiledBlockForward):
            block.forward = CompiledBlockForward(block)
    return len(model.layers)


# --- what was applied ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelismReport:
    """What the wrapped model actually has, read back from its modules and parameters."""

    world_size: int
    shard_group: int  # ranks that one parameter is sharded over (its DTensor mesh); 0 without FSDP
    replica_hooked_units: int  # FSDP units whose gradients are all-reduced between replicas (HSDP)
    fsdp_units: int
    blocks: int
    checkpointed_blocks: int
    compiled_blocks: int
    param_dtype: str
    reduce_dtype: str

    def line(self) -> str:
        if not self.fsdp_units:
            kind = f"DDP over {self.world_size} rank(s)" if self.world_size > 1 else "one process"
        else:
            if self.replica_hooked_units:
                replicas = self.world_size // self.shard_group
                layout = (
                    f"HSDP over {self.world_size} ranks: {replicas} replica groups x {self.shard_group}-way "
                    f"shards, replica all-reduce on {self.replica_hooked_units} units"
                )
            else:
                layout = f"full shard over {self.shard_group} rank(s)"
            kind = (
                f"FSDP2 {layout}, {self.fsdp_units} FSDP units; params in {self.param_dtype}, "
                f"gradients reduced in {self.reduce_dtype}"
            )
        return (
            f"parallelism: {kind}; activation checkpointing on {self.checkpointed_blocks}/{self.blocks} "
            f"blocks; compiled {self.compiled_blocks}/{self.blocks} blocks"
        )


def report(
    model: nn.Module, world_size: int, precision: Any, fsdp: FSDPConfig, replica_hooked_units: int = 0
) -> ParallelismReport:
    """Inspect `model` after Composer prepared it (Trainer built): units, mesh, wrappers."""
    from composer.distributed.fsdp2 import create_mixed_precision_policy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    modules = list(model.modules())
    blocks = [m for m in modules if isinstance(m, TransformerBlock)]
    wrapped = {id(m._checkpoint_wrapped_module) for m in modules if isinstance(m, CheckpointWrapper)}
    fsdp_units = sum(isinstance(m, FSDPModule) for m in modules)
    param = next(model.parameters(), None)
    shard_group = param.device_mesh.size() if isinstance(param, DTensor) else 0
    param_dtype = reduce_dtype = "float32"
    if fsdp_units:
        policy = create_mixed_precision_policy(precision, fsdp.mixed_precision)
        # None means "as the parameters": fp32 master weights, gradients reduced in the param dtype.
        param_dtype = _dtype_name(policy.param_dtype)
        reduce_dtype = _dtype_name(policy.reduce_dtype or policy.param_dtype)
    return ParallelismReport(
        world_size=world_size,
        shard_group=shard_group,
        replica_hooked_units=replica_hooked_units,
        fsdp_units=fsdp_units,
        blocks=len(blocks),
        checkpointed_blocks=sum(id(b) in wrapped for b in blocks),
        compiled_blocks=sum(isinstance(b.forward, CompiledBlockForward) for b in blocks),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")
