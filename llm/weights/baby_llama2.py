"""baby-llama2-chinese / llama2.c weights (`.pth`) as our tensors for a given recipe.

The names are llama2.c's, ours too: only the rotary layout differs. llama2.c rotates the
interleaved pairs (2j, 2j+1) of each head; we rotate (j, j + head_dim/2). Reordering the rows of
wq and wk within each head to [0, 2, 4, ..., 1, 3, 5, ...] maps one onto the other; attention
scores are unchanged because q and k move together.

What the source states about its shape (checked by `llm.weights.importing`): what its tensors
imply (vocab_size, dim, n_layers, hidden_dim) and, in a llama2.c checkpoint, its `model_args`
(n_heads, n_kv_heads, ...). A plain state dict does not record the head count, which no shape
reveals: the recipe's is taken, with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from llm.weights.build import drop_tied_output
from llm.weights.composer_layout import strip_wrappers
from llm.weights.importing import SourceValue, check_fits, existing, refuse_contradictions
from llm.weights.safe_load import load_pickle

log = logging.getLogger(__name__)


def import_baby_llama2(src: str | Path, cfg: ModelConfig, *, trust: bool = False) -> dict[str, Tensor]:
    """Our tensors from a baby-llama2-chinese / llama2.c `.pth`, checked against `cfg` (read without
    running code unless `trust`: see `llm.weights.safe_load.load_pickle`)."""
    src = existing(src)
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
    check_fits(tensors, cfg, src)
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
