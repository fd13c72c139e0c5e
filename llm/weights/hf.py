"""The Hugging Face Llama layout (and Baichuan-7B's variant of it), both ways.

`HF_TOP` / `HF_LAYER` map our names (llama2.c's) to Hugging Face Llama's: `to_hf` for `llm export`
(`llm.weights.hf_export`), `from_hf` for reading an export back and for importing Baichuan-7B
(`llm.weights.baichuan`), which differs from Llama only in fusing q, k and v into one `W_pack`
matrix. `HF_CONFIG` maps our `ModelConfig` fields to `config.json` keys the same way. (transformers
ships no importable map for these layouts: its Llama conversion is a repository script, absent
from the installed package.) Our rotary embeddings already use HF's rotate_half layout, so q/k rows
are copied as they are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig
from llm.weights.build import LoadedWeights
from llm.weights.safe_load import read_tensor_file
from shards.chat_template import TEMPLATE_FILE

# ours -> Hugging Face Llama, per layer and at the top level
HF_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FUSED_QKV = "self_attn.W_pack.weight"  # Baichuan-7B: [q; k; v] stacked along the rows
FROM_HF_LAYER = {hf: ours for ours, hf in HF_LAYER.items()}
FROM_HF_TOP = {hf: ours for ours, hf in HF_TOP.items()}

# ModelConfig field -> config.json key (Llama's; Baichuan-7B's uses the same keys)
HF_CONFIG = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
# what transformers' LlamaConfig assumes for an absent key
HF_DEFAULTS = {"max_seq_len": 2048, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False}


def to_hf(tensors: dict[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """Our tensors under Hugging Face Llama names, on the CPU (no lm_head when `tied`)."""
    out = {}
    for name, tensor in tensors.items():
        if name in HF_TOP:
            hf = HF_TOP[name]
        else:
            _, index, rest = name.split(".", 2)
            hf = f"model.layers.{index}.{HF_LAYER[rest]}"
        out[hf] = tensor.detach().to("cpu").contiguous()
    if tied:
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return out


def from_hf(tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Our tensors from Hugging Face Llama or Baichuan-7B names (W_pack split into q, k, v)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        if name in FROM_HF_TOP:
            out[FROM_HF_TOP[name]] = tensor
            continue
        parts = name.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"]:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
        prefix, rest = f"layers.{parts[2]}.", parts[3]
        if rest == FUSED_QKV:
            for ours, part in zip(("wq", "wk", "wv"), tensor.chunk(3, dim=0), strict=True):
                out[f"{prefix}attention.{ours}.weight"] = part
        elif rest in FROM_HF_LAYER:
            out[prefix + FROM_HF_LAYER[rest]] = tensor
        else:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
    return out


class SpecialIds(NamedTuple):
    """The BOS, EOS and pad ids an export's files name (each None when the tokenizer has none)."""

    bos: int | None
    eos: int | None
    pad: int | None


def hf_config(cfg: ModelConfig, ids: SpecialIds, dtype: str) -> dict[str, Any]:
    """`config.json` for `transformers.LlamaForCausalLM`."""
    values = dataclasses.asdict(cfg) | {"n_kv_heads": cfg.kv_heads, "hidden_dim": cfg.ffn_hidden_dim}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{key: values[field] for field, key in HF_CONFIG.items()},
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(data: dict[str, Any]) -> ModelConfig:
    """Our model config from a Llama `config.json` (absent optional keys: transformers' defaults)."""
    values = {field: data[key] for field, key in HF_CONFIG.items() if data.get(key) is not None}
    values = HF_DEFAULTS | values
    values.setdefault("n_kv_heads", values["n_heads"])
    return ModelConfig(**values)


def read_hf_tensors(src: Path, trust: bool = False) -> dict[str, Tensor]:
    """All tensors of a HF checkpoint: one file, or a folder (single file or shards + index json)."""
    if src.is_file():
        return read_tensor_file(src, trust)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = src / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in read_tensor_file(src / shard, trust).items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return read_tensor_file(src / single, trust)
    raise FileNotFoundError(
        f"{src} holds no model.safetensors, pytorch_model.bin or their sharded index json"
    )


def read_hf_folder(folder: Path, trust: bool = False) -> LoadedWeights:
    """Our tensors, config and chat template (if any) from a Llama folder such as `llm export` writes."""
    data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    template_file = folder / TEMPLATE_FILE
    template = json.loads(template_file.read_text(encoding="utf-8")) if template_file.is_file() else None
    return LoadedWeights(from_hf(read_hf_tensors(folder, trust), str(folder)), config_from_hf(data), template)
