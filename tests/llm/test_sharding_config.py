"""What `llm/parallelism.py` hands Composer, without starting ranks (the multi-rank runs are in
tests/llm/test_parallelism.py), and the compiled block's eager path for generation."""

from __future__ import annotations

import pytest
import torch
from composer.core.precision import Precision
from composer.distributed.fsdp2 import create_mixed_precision_policy

from llm.config import load_config
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from llm.parallelism import CompiledBlockForward, HybridShardConfig, compile_blocks, sharding_config
from tests.support import paths

RECIPES = paths.RECIPES


def test_the_7b_recipe_asks_composer_for_fsdp2_with_bf16_params_and_fp32_reduction():
    cfg = load_config(RECIPES / "7b.yaml")
    sharding = sharding_config(cfg.fsdp, world_size=64)
    assert isinstance(sharding, HybridShardConfig)
    assert sharding.data_parallel_replicate_degree is None  # plain FSDP2: one mesh dimension
    # Checkpointing is applied by llm/parallelism.py (per policy), not by Composer's on/off switch.
    assert not sharding.activation_checkpointing and sharding.state_dict_type == "sharded"
    policy = create_mixed_precision_policy(Precision.AMP_BF16, sharding.mixed_precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_replicate_asks_composer_for_a_two_dimensional_mesh_and_must_divide_the_world():
    cfg = load_config(RECIPES / "7b.yaml", ["fsdp.replicate=8"])
    sharding = sharding_config(cfg.fsdp, world_size=64)
    # Composer's State builds (replicate, shard) from these two: 8 x (64 / 8).
    assert (sharding.data_parallel_replicate_degree, sharding.data_parallel_shard_degree) == (8, -1)
    with pytest.raises(ConfigError, match="fsdp.replicate=8 does not divide the world size 12"):
        sharding_config(cfg.fsdp, world_size=12)
    assert sharding_config(load_config(RECIPES / "demo.yaml").fsdp, world_size=2) is None  # DDP


def test_a_compiled_block_runs_generation_eagerly_and_compiles_nothing():
    import torch._dynamo
    from torch._dynamo.utils import counters

    from llm.generate import generate

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32)
    eager, compiled = Transformer(cfg, seed=1), Transformer(cfg, seed=1)
    assert compile_blocks(compiled) == 2
    assert all(isinstance(block.forward, CompiledBlockForward) for block in compiled.layers)
    torch._dynamo.reset()
    counters.clear()
    prompts = [[5, 6, 7], [9]]
    expected = generate(eager, prompts, max_new_tokens=6, temperature=0.0, eos_id=None, seed=0)
    assert generate(compiled, prompts, max_new_tokens=6, temperature=0.0, eos_id=None, seed=0) == expected
    assert counters["frames"]["total"] == 0  # with a KV cache the blocks never entered torch.compile
