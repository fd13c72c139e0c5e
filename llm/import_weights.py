"""Weights from baby-llama2-chinese or Baichuan-7B, as our tensors for a given recipe.

`save_composer_weights` then writes them as a checkpoint the trainer loads with
`checkpoint.load_path=<out> checkpoint.load_weights_only=true`.

baby-llama2-chinese (`.pth`, llama2.c names, ours too): only its rotary layout differs. llama2.c
rotates the interleaved pairs (2j, 2j+1) of each head; we rotate (j, j + head_dim/2). Reordering
the rows of wq and wk within each head to [0, 2, 4, ..., 1, 3, 5, ...] maps one onto the other;
attention scores are unchanged because q and k move together.

Baichuan-7B (Hugging Face folder, safetensors or `.bin`, possibly sharded with an index json):
Llama names with q, k and v fused in `W_pack` (`llm.weights.from_hf` splits it); its rotary
embedding is already rotate_half, so no reordering.

Before anything is converted, the source's own description of itself is compared with the recipe,
and the first contradiction is refused in one line naming both values:
- Baichuan-7B: its `config.json` (hidden_size, num_hidden_layers, num_attention_heads,
  num_key_value_heads, intermediate_size, vocab_size, rms_norm_eps, rope_theta). Not
  max_position_embeddings: RoPE has no learned positions, and the context to train at is the
  recipe's choice.
- baby-llama2-chinese: what its tensors imply (vocab_size, dim, n_layers, hidden_dim) and, in a
  llama2.c checkpoint, its `model_args` (n_heads, n_kv_heads, ...). A plain state dict does not
  record the head count, which no shape reveals: the recipe's is taken, with a warning.
A source with its own output matrix goes into a tied recipe only if that matrix equals the embedding.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from llm.weights import (
    HF_CONFIG,
    HF_DEFAULTS,
    check_shapes,
    drop_tied_output,
    from_hf,
    load_pickle,
    read_hf_tensors,
    strip_wrappers,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceValue:
    """One value the source states about its shape, and where it says so (for the message)."""

    field: str  # our ModelConfig field
    key: str  # the source's name for it
    value: int | float
    origin: str  # the file that says so
    evidence: str = ""  # e.g. the tensor shape it was read from


def refuse_contradictions(values: list[SourceValue], cfg: ModelConfig) -> None:
    """ConfigError on the first source value that differs from the recipe's, naming both."""
    for v in values:
        ours = _effective(cfg, v.field)
        same = math.isclose(v.value, ours, rel_tol=1e-9) if isinstance(v.value, float) else v.value == ours
        if not same:
            raise ConfigError(
                f"{v.origin} has {v.key}={v.value}{v.evidence} but the recipe has model.{v.field}={ours}: "
                f"set model.{v.field}: {v.value} in the recipe"
            )


def _effective(cfg: ModelConfig, field: str) -> int | float:
    if field == "n_kv_heads":
        return cfg.kv_heads
    if field == "hidden_dim":
        return cfg.ffn_hidden_dim
    return getattr(cfg, field)


def _existing(src: str | Path) -> Path:
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    return src


def _check_fits(tensors: dict[str, Tensor], cfg: ModelConfig, src: Path) -> None:
    with torch.device("meta"):  # shapes only: a 7B model is not allocated twice
        check_shapes(Transformer(cfg), tensors, str(src))


# --- baby-llama2-chinese ---------------------------------------------------------------------


def import_baby_llama2(src: str | Path, cfg: ModelConfig, *, trust: bool = False) -> dict[str, Tensor]:
    """Our tensors from a baby-llama2-chinese / llama2.c `.pth`, checked against `cfg` (read without
    running code unless `trust`: see `llm.weights.load_pickle`)."""
    src = _existing(src)
    obj = load_pickle(src, str(src), trust=trust)
    model_args = obj.get("model_args") if isinstance(obj, dict) else None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    tensors = strip_wrappers(obj) if isinstance(obj, dict) else {}
    if "tok_embeddings.weight" not in tensors:
        raise ConfigError(
            f"{src} is not a baby-llama2-chinese / llama2.c checkpoint (no tok_embeddings.weight)"
        )
    model_args = model_args if isinstance(model_args, dict) else {}
    refuse_contradictions(_llama2c_values(tensors, model_args, cfg, str(src)), cfg)
    if model_args.get("n_heads") is None:
        log.warning(
            "%s does not record its head count: taking model.n_heads=%d from the recipe (another "
            "count loads as well but computes other logits)",
            src,
            cfg.n_heads,
        )
    tensors = drop_tied_output(tensors, cfg, str(src))
    for name, tensor in tensors.items():
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            tensors[name] = interleaved_to_half(tensor, cfg.head_dim)
    _check_fits(tensors, cfg, src)
    return tensors


def _llama2c_values(
    tensors: dict[str, Tensor], model_args: dict, cfg: ModelConfig, src: str
) -> list[SourceValue]:
    """What the tensor shapes imply, then what llama2.c's `model_args` says."""
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}

    def from_shape(field: str, name: str, axis: int) -> list[SourceValue]:
        if name not in tensors:
            return []
        shape = tuple(tensors[name].shape)
        evidence = f" ({name}: checkpoint {shape} vs model {expected.get(name)})"
        return [SourceValue(field, field, shape[axis], src, evidence)]

    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    values = from_shape("vocab_size", "tok_embeddings.weight", 0) + from_shape(
        "dim", "tok_embeddings.weight", 1
    )
    if layers:
        values.append(
            SourceValue("n_layers", "n_layers", len(layers), src, f" (layers.0 to layers.{layers[-1]})")
        )
    values += from_shape("hidden_dim", "layers.0.feed_forward.w1.weight", 0)
    for field in ("n_heads", "n_kv_heads", "norm_eps", "rope_theta"):
        if model_args.get(field) is not None:
            values.append(SourceValue(field, field, model_args[field], f"{src} (model_args)"))
    return values


def interleaved_to_half(weight: Tensor, head_dim: int) -> Tensor:
    """Reorder each head's output rows from llama2.c pairs (2j, 2j+1) to rotate_half (j, j+hd/2)."""
    rows, cols = weight.shape
    if rows % head_dim:
        raise ConfigError(f"a q/k weight with {rows} rows does not split into heads of {head_dim}")
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.view(rows // head_dim, head_dim, cols)[:, order].reshape(rows, cols)


# --- Baichuan-7B -----------------------------------------------------------------------------

BAICHUAN_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "norm_eps")


def import_baichuan(src: str | Path, cfg: ModelConfig, *, trust: bool = False) -> dict[str, Tensor]:
    """Our tensors from a Baichuan-7B folder (or weights file beside its config.json), checked against `cfg`."""
    src = _existing(src)
    refuse_contradictions(_baichuan_values(src), cfg)
    tensors = from_hf(read_hf_tensors(src, trust), str(src))
    tensors = drop_tied_output(tensors, cfg, str(src), output_name="lm_head.weight")
    _check_fits(tensors, cfg, src)
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


# (source, recipe's model config, trust=...) -> our tensors
IMPORTERS: dict[str, Callable[..., dict[str, Tensor]]] = {
    "baby-llama2": import_baby_llama2,
    "baichuan": import_baichuan,
}
