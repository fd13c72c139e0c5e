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


@pytest.mark.parametrize("name", ["tiny", "7b", "demo", "template", "qwen2.5-0.5b"])
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
    assert cfg.fsdp.enabled and cfg.fsdp.version == 2 and cfg.fsdp.activation_checkpointing == "auto"
    assert cfg.guard.enabled and cfg.guard.skip == 50  # docs/guard.md: a few batches at this scale


def test_7b_is_baichuan_on_s3_with_fsdp():
    cfg = load_config(RECIPES / "7b.yaml")
    assert _params(cfg) == 7_000_559_616
    assert not cfg.model.tie_embeddings and cfg.model.norm_eps == 1e-6
    assert cfg.training.precision == "amp_bf16"
    assert (
        cfg.fsdp.enabled
        and cfg.fsdp.activation_checkpointing == "auto"
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


def test_the_template_is_a_gqa_model_for_your_own_tokenizer_and_shards():
    cfg = load_config(RECIPES / "template.yaml")
    assert cfg.model.kv_heads < cfg.model.n_heads and _params(cfg) == 336_118_784  # as its comment says
    assert (
        cfg.tokenizer.path == "data/my/tokenizer.model" and cfg.data.train[0].remote == "data/my/shards/train"
    )
    assert cfg.callbacks.eval_tasks.tasks == [] and cfg.checkpoint.load_path is None
    text = (RECIPES / "template.yaml").read_text()
    assert "docs/config.md" in text and "llm import --from hf" in text


# Qwen2.5-0.5B's config.json as published on the Hugging Face Hub (the keys the import reads).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 24,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": True, "vocab_size": 151936, "attention_dropout": 0.0,
}  # fmt: skip


def test_the_qwen_recipe_is_what_the_import_prints_for_qwen25_and_counts_its_parameters(tmp_path):
    import json

    import yaml
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llm.weights.hf import model_section

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    printed = yaml.safe_load(model_section(tmp_path))["model"]
    cfg = load_config(RECIPES / "qwen2.5-0.5b.yaml")
    ours = {k: v for k, v in vars(cfg.model).items() if k in printed}
    assert ours == printed | {"max_seq_len": 4096}  # the context is the shards' choice
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).parameters())
    assert _params(cfg) == theirs == 494_032_768  # Qwen2.5-0.5B's published count
