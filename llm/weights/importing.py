"""What every `llm import` checks before it converts a foreign model's weights.

The adapters (`llm.weights.baby_llama2`, `llm.weights.baichuan`) turn a source into our tensors for
a given recipe; `save_composer_weights` (`llm.weights.composer_layout`) then writes them as a
checkpoint the trainer loads with `checkpoint.load_path=<out> checkpoint.load_weights_only=true`.

Before anything is converted, the source's own description of itself is compared with the recipe,
and the first contradiction is refused in one line naming both values (`refuse_contradictions`);
what each source states is listed in its adapter. A source with its own output matrix goes into a
tied recipe only if that matrix equals the embedding; the tensors then must fit the recipe's
shapes exactly (`check_fits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from llm.weights.build import check_shapes


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


def existing(src: str | Path) -> Path:
    """`src` as a Path (FileNotFoundError if it does not exist)."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    return src


def check_fits(tensors: dict[str, Tensor], cfg: ModelConfig, src: Path) -> None:
    """ConfigError unless `tensors` fit `cfg` exactly (`llm.weights.build.check_shapes`)."""
    with torch.device("meta"):  # shapes only: a 7B model is not allocated twice
        check_shapes(Transformer(cfg), tensors, str(src))
