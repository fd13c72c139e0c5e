"""Baichuan-7B weights as our tensors for a given recipe.

A Hugging Face folder (safetensors or `.bin`, possibly sharded with an index json): Llama names
with q, k and v fused in `W_pack` (`llm.weights.hf.from_hf` splits it); its rotary embedding is
already rotate_half, so no reordering.

What the source states about its shape (checked by `llm.weights.importing`): its `config.json`
(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
vocab_size, rms_norm_eps, rope_theta). Not max_position_embeddings: RoPE has no learned
positions, and the context to train at is the recipe's choice.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig
from llm.weights.build import drop_tied_output
from llm.weights.hf import HF_CONFIG, HF_DEFAULTS, from_hf, read_hf_tensors
from llm.weights.importing import SourceValue, check_fits, existing, refuse_contradictions

BAICHUAN_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "norm_eps")


def import_baichuan(src: str | Path, cfg: ModelConfig, *, trust: bool = False) -> dict[str, Tensor]:
    """Our tensors from a Baichuan-7B folder (or weights file beside its config.json), checked against `cfg`."""
    src = existing(src)
    refuse_contradictions(_baichuan_values(src), cfg)
    tensors = from_hf(read_hf_tensors(src, trust), str(src))
    tensors = drop_tied_output(tensors, cfg, str(src), output_name="lm_head.weight")
    check_fits(tensors, cfg, src)
    return tensors


def _baichuan_values(src: Path) -> list[SourceValue]:
    """The shape Baichuan's config.json states (absent optional keys: what its code assumes)."""
    path = (src if src.is_dir() else src.parent) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: the import checks the recipe against the model's own config.json; "
            f"copy Baichuan-7B's config.json next to its weights"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    absent = [HF_CONFIG[field] for field in BAICHUAN_REQUIRED if HF_CONFIG[field] not in data]
    if absent:
        raise ConfigError(f"{path} lacks {', '.join(absent)}: is it Baichuan-7B's config.json?")
    values = [
        SourceValue(field, HF_CONFIG[field], data[HF_CONFIG[field]], str(path)) for field in BAICHUAN_REQUIRED
    ]
    heads_key, theta_key = HF_CONFIG["n_kv_heads"], HF_CONFIG["rope_theta"]
    if heads_key in data:
        values.append(SourceValue("n_kv_heads", heads_key, data[heads_key], str(path)))
    else:  # W_pack holds k and v as wide as q: one key/value head per query head
        values.append(
            SourceValue("n_kv_heads", "num_attention_heads", data["num_attention_heads"], str(path))
        )
    theta = float(data.get(theta_key, HF_DEFAULTS["rope_theta"]))
    values.append(
        SourceValue("rope_theta", theta_key, theta, str(path), "" if theta_key in data else " (by default)")
    )
    return values
