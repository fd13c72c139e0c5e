"""Memory-safe initialisation: no rank ever holds the whole model (our `deepspeed.zero.Init`).

Baichuan-7B builds its model inside `deepspeed.zero.Init`, so parameters are partitioned as they
are created. The FSDP equivalent: build the model on the meta device (shapes only, no storage),
shard it, then give each parameter storage for this rank's shard and fill it with
`Transformer.param_init_fn`, which draws every parameter from (seed, its name) alone
(`llm.model.init_parameter_`). The weights therefore equal an ordinary single-process
`Transformer(cfg, seed)`, on any number of ranks, and a rank's host memory peaks near one full
parameter (the largest: the 7B embedding, 1 GB in fp32) instead of the 28 GB model.

Two ways in:
- Through Composer (the trainer, on GPUs): `llm.trainer.build_model` builds `LanguageModel` on the
  meta device when `fsdp.enabled and fsdp.init_on_meta`; Composer's FSDP1 (`param_init_fn` of
  `FullyShardedDataParallel`) and FSDP2 (`composer.distributed.param_init.meta_init`) then call
  `Transformer.param_init_fn` on each module after `to_empty`. Both move modules to CUDA, so on the
  CPU the trainer builds the (small) model for real instead.
- Without Composer (any device, CPU included): `build_meta_model`, `shard_fsdp2` and
  `materialize_` below do the same steps with torch's FSDP2 `fully_shard` directly
  (`materialize_` is the per-module walk Composer's `meta_init` does, with the device as a
  parameter). The tests chain them to check, on the CPU over gloo, that the sharded weights equal
  an ordinary init and that host memory stays below the model.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from llm.model import ModelConfig, Transformer


class MetaInitError(RuntimeError):
    """Memory-safe initialisation cannot run as asked; the message says what to do instead."""


def build_meta_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The model with shapes only: no storage, nothing initialised (`init_seed` remembers `seed`)."""
    with torch.device("meta"):
        return Transformer(cfg, seed=seed)


def shard_fsdp2(model: Transformer, mesh=None, mp_policy=None) -> Transformer:
    """FSDP2 `fully_shard` on each decoder block, then on the root (embedding, norm, output).

    The same units Composer's FSDP2 policy picks through `LanguageModel`'s `fsdp_wrap_fn`: one
    all-gather per block in forward and backward, the root kept as its own unit.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch_dist.is_initialized():
        raise MetaInitError(
            "FSDP sharding needs a process group: start the script with `composer -n N ...` "
            "(or call torch.distributed.init_process_group first)"
        )
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@torch.no_grad()
def materialize_(model: Transformer, device: torch.device | str) -> None:
    """Give every meta parameter storage on `device` and initialise it with `param_init_fn`.

    Children before parents, one module's own parameters at a time (`recurse=False`), like
    Composer's `meta_init`, so at most one full parameter exists in host memory at once. FSDP2
    parameters are DTensors: `to_empty` swaps their storage in place, so a tied embedding stays
    tied and each rank allocates only its shard.
    """
    for module in _children_first(model):
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
            model.param_init_fn(module)
    if model.cfg.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        # Plain (unsharded) tensors get new Parameter objects from `to_empty`: tie them again.
        model.tie_weights()


def _children_first(module: nn.Module):
    for child in module.children():
        yield from _children_first(child)
    yield module
