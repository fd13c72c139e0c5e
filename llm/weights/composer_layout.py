"""Our own checkpoint layout: a Composer checkpoint's model, and the file `llm import` writes.

A Composer checkpoint (`ep0-ba100-rank0.pt`, or a sharded folder gathered by
`llm.weights.safe_load`) is a dict whose `state.model` holds the ComposerModel's state dict, keys
behind wrapper levels (`model.`, `_orig_mod.`, FSDP's ...). Our names are llama2.c's
(baby-llama2-chinese uses them too). The model config and an SFT run's chat template are recorded
under `llm.weights.keys`, at the top level (`llm import`) or in a callback's state (training).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig, parameter_name
from llm.weights.build import LoadedWeights
from llm.weights.keys import CHAT_TEMPLATE_KEY, MODEL_CONFIG_KEY


def strip_wrappers(state: dict[str, Any]) -> dict[str, Tensor]:
    """Our parameter names from `model._orig_mod.layers.0...`-style keys (`llm.model.parameter_name`);
    non-tensors dropped."""
    out = {}
    for key, value in state.items():
        name = parameter_name(key)
        if name is not None and isinstance(value, Tensor):
            out[name] = value
    return out


def weights_from_checkpoint(obj: Any, path: str) -> LoadedWeights:
    """Our tensors, and the recorded model config and chat template, of an unpickled checkpoint."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} holds a {type(obj).__name__}, not a checkpoint dict")
    state = obj.get("state", {}).get("model") if isinstance(obj.get("state"), dict) else None
    if state is None:
        raise ConfigError(
            f"{path} is not a Composer checkpoint (no state.model); for baby-llama2-chinese or "
            f"Baichuan weights run `llm import` first"
        )
    return LoadedWeights(strip_wrappers(state), _recorded_config(obj), _recorded(obj, CHAT_TEMPLATE_KEY))


def _recorded(obj: dict[str, Any], key: str) -> Any:
    """What the checkpoint stores under `key`, at its top level or in a callback's state."""
    recorded = obj.get(key)
    callbacks = obj.get("state", {}).get("callbacks") or {}
    for cb_state in callbacks.values():
        if recorded is None and isinstance(cb_state, dict):
            recorded = cb_state.get(key)
    return recorded


def _recorded_config(obj: dict[str, Any]) -> ModelConfig | None:
    """The model config stored by `llm import` or by the generation callback, if any."""
    recorded = _recorded(obj, MODEL_CONFIG_KEY)
    if not recorded:
        return None
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in recorded.items() if k in names})


def save_composer_weights(
    tensors: dict[str, Tensor], cfg: ModelConfig, out: str | os.PathLike, prefix: str = "model."
) -> Path:
    """Write `tensors` (our names) as a Composer checkpoint for `load_weights_only=true`.

    Composer reads `state.model` with the ComposerModel's keys: our `LanguageModel` holds the
    Transformer as `.model`, hence the `model.` prefix. The config is stored alongside so
    `llm generate` needs no recipe.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {prefix + name: t.contiguous() for name, t in tensors.items()}
    if cfg.tie_embeddings:
        state[prefix + "output.weight"] = state[prefix + "tok_embeddings.weight"]
    payload = {"state": {"model": state}, MODEL_CONFIG_KEY: dataclasses.asdict(cfg)}
    torch.save(payload, out)
    return out
