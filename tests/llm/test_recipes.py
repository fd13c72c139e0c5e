"""The shipped recipes load, and build the models they promise."""

from __future__ import annotations

import pytest
import torch

from llm.config import load_config
from llm.model import Transformer
from tests.support import paths

RECIPES = paths.RECIPES


def _params(cfg) -> int:
    with torch.device("meta"):
        return Transformer(cfg.model).num_params()


@pytest.mark.parametrize("name", ["tiny", "7b", "demo"])
def test_every_recipe_loads(name):
    cfg = load_config(RECIPES / f"{name}.yaml")
    assert cfg.run_dir == f"runs/{cfg.run_name}"
    assert cfg.training.global_batch_size % cfg.training.device_microbatch_size == 0


def test_tiny_is_baby_llama2_chinese():
    cfg = load_config(RECIPES / "tiny.yaml")
    assert _params(cfg) == 58_479_616
    assert cfg.model.tie_embeddings and cfg.model.max_seq_len == 512 and cfg.model.ffn_hidden_dim == 1376
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay) == (3e-4, (0.9, 0.95), 0.1)
    assert (cfg.scheduler.warmup, cfg.scheduler.min_lr, cfg.training.grad_clip_norm) == ("1000ba", 1e-5, 1.0)
    assert cfg.training.device_microbatch_size == 32
    assert cfg.fsdp.enabled and cfg.fsdp.version == 2 and cfg.fsdp.activation_checkpointing == "none"
    assert cfg.guard.enabled and cfg.guard.skip == 50  # docs/guard.md: a few batches at this scale


def test_7b_is_baichuan_on_s3_with_fsdp():
    cfg = load_config(RECIPES / "7b.yaml")
    assert _params(cfg) == 7_000_559_616
    assert not cfg.model.tie_embeddings and cfg.model.norm_eps == 1e-6
    assert cfg.training.precision == "amp_bf16"
    assert (
        cfg.fsdp.enabled
        and cfg.fsdp.activation_checkpointing == "selective"
        and cfg.fsdp.state_dict_type == "sharded"
    )
    assert (cfg.fsdp.version, cfg.fsdp.replicate, cfg.fsdp.mixed_precision) == (2, 1, "DEFAULT")  # FSDP2
    assert all(s.remote.startswith("s3://") for s in cfg.data.train + cfg.data.eval)
    assert cfg.checkpoint.save_folder.startswith("s3://")
    assert cfg.guard.enabled and cfg.guard.skip == 200  # PaLM skipped 200-500 batches
    # Not Baichuan's published 1e-8: a real peak with warmup and cosine decay.
    assert (
        cfg.optimizer.lr == 3e-4 and cfg.scheduler.warmup != "0ba" and cfg.scheduler.min_lr < cfg.optimizer.lr
    )


def test_demo_is_cpu_sized_over_make_demo_outputs():
    cfg = load_config(RECIPES / "demo.yaml")
    assert 1_000_000 < _params(cfg) < 10_000_000
    assert cfg.model.vocab_size == 4096 and cfg.model.max_seq_len == 256
    assert cfg.tokenizer.path == "data/demo/tokenizer.model"
    assert [s.remote for s in cfg.data.train] == ["data/demo/shards/train"]
    assert [s.remote for s in cfg.data.eval] == ["data/demo/shards/val"]
    assert cfg.run_name == "demo" and cfg.checkpoint.save_folder == "runs/demo/checkpoints"
    assert cfg.callbacks.generate.prompts == ["中国", "我们要", "经济"]
    assert cfg.training.precision == "auto" and not cfg.fsdp.enabled


def test_the_7b_recipe_caches_on_a_data_disk_not_tmp(monkeypatch):
    monkeypatch.delenv("LLM_CACHE_ROOT", raising=False)
    cfg = load_config(RECIPES / "7b.yaml")
    assert not cfg.data.cache_root.startswith("/tmp") and cfg.data.cache_limit == "auto"
    monkeypatch.setenv("LLM_CACHE_ROOT", "/nvme/cache")
    assert load_config(RECIPES / "7b.yaml").data.cache_root == "/nvme/cache"
