"""`llm import`: turn baby-llama2-chinese or Baichuan-7B weights into a checkpoint we train from.

The output is a Composer checkpoint holding only the model (`{"state": {"model": ...}}`), which
the trainer loads with `checkpoint.load_path=<out> checkpoint.load_weights_only=true`.

baby-llama2-chinese (`.pth`, llama2.c names, ours too): only its rotary layout differs. llama2.c
rotates the interleaved pairs (2j, 2j+1) of each head; we rotate (j, j + head_dim/2). Reordering
the rows of wq and wk within each head to [0, 2, 4, ..., 1, 3, 5, ...] maps one onto the other;
attention scores are unchanged because q and k move together.

Baichuan-7B (Hugging Face folder, safetensors or `.bin`, possibly sharded with an index json):
Llama names with query/key/value fused in `W_pack` ([3 * dim, dim], q then k then v); its rotary
embedding is already rotate_half, so no reordering.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from llm.checkpoint_io import check_shapes, save_composer_weights
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer

SOURCES = ("baby-llama2", "baichuan")


# --- baby-llama2-chinese ---------------------------------------------------------------------


def read_baby_llama2(src: Path, cfg: ModelConfig) -> dict[str, Tensor]:
    obj = torch.load(src, map_location="cpu", weights_only=False)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or "tok_embeddings.weight" not in _clean_keys(obj):
        raise ConfigError(
            f"{src} is not a baby-llama2-chinese / llama2.c checkpoint (no tok_embeddings.weight)"
        )
    tensors = _clean_keys(obj)
    tensors = {k: v for k, v in tensors.items() if not k.endswith(("freqs_cos", "freqs_sin"))}
    for name, tensor in tensors.items():
        if name.endswith("attention.wq.weight"):
            tensors[name] = interleaved_to_half(tensor, cfg.head_dim)
        elif name.endswith("attention.wk.weight"):
            tensors[name] = interleaved_to_half(tensor, cfg.head_dim)
    return tensors


def _clean_keys(state: dict) -> dict[str, Tensor]:
    """Drop torch.compile's `_orig_mod.` and DDP's `module.` prefixes."""
    out = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "module."):
            key = key.removeprefix(prefix)
        if isinstance(value, Tensor):
            out[key] = value
    return out


def interleaved_to_half(weight: Tensor, head_dim: int) -> Tensor:
    """Reorder each head's output rows from llama2.c pairs (2j, 2j+1) to rotate_half (j, j+hd/2)."""
    rows, cols = weight.shape
    if rows % head_dim:
        raise ConfigError(f"a q/k weight with {rows} rows does not split into heads of {head_dim}")
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.view(rows // head_dim, head_dim, cols)[:, order].reshape(rows, cols)


# --- Baichuan-7B -----------------------------------------------------------------------------

BAICHUAN_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
BAICHUAN_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def read_baichuan(src: Path) -> dict[str, Tensor]:
    tensors = {}
    for name, tensor in _read_hf_tensors(src).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        tensors.update(_baichuan_to_ours(name, tensor))
    return tensors


def _baichuan_to_ours(name: str, tensor: Tensor) -> dict[str, Tensor]:
    if name in BAICHUAN_TOP:
        return {BAICHUAN_TOP[name]: tensor}
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        prefix, rest = f"layers.{parts[2]}.", parts[3]
        if rest == "self_attn.W_pack.weight":
            q, k, v = tensor.chunk(3, dim=0)
            return {
                prefix + "attention.wq.weight": q,
                prefix + "attention.wk.weight": k,
                prefix + "attention.wv.weight": v,
            }
        if rest in BAICHUAN_LAYER:
            return {prefix + BAICHUAN_LAYER[rest]: tensor}
    raise ConfigError(f"unexpected tensor {name} in a Baichuan-7B checkpoint")


def _read_hf_tensors(src: Path) -> dict[str, Tensor]:
    """All tensors of a HF checkpoint: one file, or a folder (single file or sharded + index)."""
    if src.is_file():
        return _read_one(src)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = src / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in _read_one(src / shard).items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return _read_one(src / single)
    raise FileNotFoundError(
        f"{src} holds no model.safetensors, pytorch_model.bin or their sharded index json"
    )


def _read_one(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


# --- conversion ------------------------------------------------------------------------------


def convert(source: str, src: str | Path, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our-named tensors from `src`, checked against `cfg` (ConfigError names mismatches)."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if source == "baby-llama2":
        tensors = read_baby_llama2(src, cfg)
    elif source == "baichuan":
        tensors = read_baichuan(src)
    else:
        raise ConfigError(f"unknown source {source!r}: use one of {', '.join(SOURCES)}")
    if cfg.tie_embeddings:
        tensors.pop("output.weight", None)  # baby-llama2 stores the tied matrix twice
    with torch.device("meta"):  # shapes only: a 7B model is not allocated twice
        check_shapes(Transformer(cfg), tensors, str(src))
    return tensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="baby-llama2-chinese .pth, or a Baichuan-7B folder / weights file")
    parser.add_argument("--from", dest="source", required=True, choices=SOURCES)
    parser.add_argument("--recipe", required=True, help="the recipe to continue training with")
    parser.add_argument("--out", required=True, help="output .pt for checkpoint.load_path")


def run(args: argparse.Namespace) -> int:
    from llm.config import load_config

    cfg = load_config(args.recipe).model
    tensors = convert(args.source, args.src, cfg)
    out = save_composer_weights(tensors, cfg, args.out)
    print(
        f"wrote {out} ({len(tensors)} tensors); train from it with checkpoint.load_path={out} "
        f"checkpoint.load_weights_only=true checkpoint.allow_untrusted_load_path=true"
    )
    return 0
