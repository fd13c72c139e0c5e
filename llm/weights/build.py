"""The one place a model is built from weights: `model_from_weights(weights, ...)`.

The shape comes from the recipe when one is given, else from what the source records. Before a
tensor is copied, tying, names and shapes are checked against that shape; a mismatch names the
first tensors that differ, with both shapes. The importers (`llm.weights.baby_llama2`,
`llm.weights.baichuan`) run the same checks on a shapes-only build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llm.config import load_config
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer


@dataclass
class LoadedWeights:
    tensors: dict[str, Tensor]  # our parameter names
    model_config: ModelConfig | None  # the shape, when the source records it
    chat_template: dict | None = None  # an SFT run's chat template, when recorded (shards.chat_template)


def model_from_weights(
    weights: LoadedWeights, path: str, recipe: str | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """A Transformer in eval mode holding `weights` (read from `path`, named in messages), shaped
    by `recipe` or else by the config the weights record."""
    if recipe:
        cfg = load_config(recipe).model
    elif weights.model_config is not None:
        cfg = weights.model_config
    else:
        raise ConfigError(
            f"{path} does not record the model's shape: pass --recipe with the recipe it was trained with"
        )
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    load_into(model, weights.tensors, source=path)
    return model.eval()


def load_into(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """Copy `tensors` into `model` after checking tying, names and shapes (ConfigError if wrong)."""
    tensors = drop_tied_output(tensors, model.cfg, source)
    check_shapes(model, tensors, source)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


def drop_tied_output(
    tensors: dict[str, Tensor], cfg: ModelConfig, source: str, output_name: str = "output.weight"
) -> dict[str, Tensor]:
    """`tensors` fit for `cfg`: with tied embeddings, `output.weight` is dropped once seen equal to
    the embedding; a different one is a trained output layer the tie would throw away (ConfigError).
    `output_name` is what the source calls that matrix, for the message.
    """
    if not cfg.tie_embeddings or "output.weight" not in tensors:
        return tensors
    tensors = dict(tensors)
    output, embed = tensors.pop("output.weight"), tensors.get("tok_embeddings.weight")
    if embed is not None and not torch.equal(output, embed):
        raise ConfigError(
            f"{source} has its own output matrix ({output_name}), different from its embedding, but "
            f"the recipe ties the two: set model.tie_embeddings: false in the recipe to keep it"
        )
    return tensors


def check_shapes(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """ConfigError naming the first mismatched, missing and unexpected tensors, if any."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    mismatched = [
        f"{name}: checkpoint {tuple(t.shape)} vs model {expected[name]}"
        for name, t in tensors.items()
        if name in expected and tuple(t.shape) != expected[name]
    ]
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    problems = []
    if mismatched:
        problems.append("shape mismatch in " + "; ".join(mismatched[:3]))
    if missing:
        problems.append("missing " + ", ".join(missing[:3]))
    if unexpected:
        problems.append("unexpected " + ", ".join(unexpected[:3]))
    if problems:
        raise ConfigError(
            f"{source} does not fit the model config ({len(mismatched)} mismatched, {len(missing)} "
            f"missing, {len(unexpected)} unexpected tensors): {' | '.join(problems)}; use the recipe "
            f"the checkpoint was trained with"
        )
