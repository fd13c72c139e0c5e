"""AdamW with weight decay on 2-D weights only, and the warmup + cosine learning-rate schedule.

The schedule is a Composer scheduler: a pure function of the training timestamp, which Composer
stores in every checkpoint, so a resumed run continues the curve exactly where it stopped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from llm.config import OptimizerConfig, TrainConfig, parse_duration
from llm.errors import ConfigError

if TYPE_CHECKING:
    from composer.optim import ComposerScheduler


def param_groups(model: nn.Module, weight_decay: float, embedding_lr: float | None = None) -> list[dict]:
    """Matrices and embeddings (ndim >= 2) decay; norm gains (1-D) do not, as in baby-llama2.

    With `embedding_lr`, the token embedding matrix (``tok_embeddings.weight``, which is also the
    output projection when the two are tied) gets a group of its own with that peak rate; the
    schedule scales every group's rate by the same factor, so it warms up and decays alike.
    """
    decay, no_decay, embedding = [], [], []
    for name, param in model.named_parameters():  # de-duplicates tied weights
        if not param.requires_grad:
            continue
        if embedding_lr is not None and name.endswith("tok_embeddings.weight"):
            embedding.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if embedding_lr is not None:
        if not embedding:
            raise ConfigError("optimizer.embedding_lr is set but the model has no tok_embeddings.weight")
        groups.append({"params": embedding, "weight_decay": weight_decay, "lr": embedding_lr})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, cfg.embedding_lr),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def duration_in_batches(value: str, tokens_per_batch: int, batches_per_epoch: int | None = None) -> int:
    """A Composer time string ("1000ba", "5000000tok", "2ep") as a whole number of optimizer steps.

    Schedules and durations are all expressed in batches so warmup and decay agree whatever unit
    the recipe used; tokens round up to the step that reaches them.
    """
    amount, unit = parse_duration(value)
    if unit == "ba":
        return amount
    if unit == "tok":
        return math.ceil(amount / tokens_per_batch)
    if unit == "ep" and batches_per_epoch is not None:
        return amount * batches_per_epoch
    raise ConfigError(f"duration {value!r}: unit {unit!r} is not supported here; use ba or tok")


def build_scheduler(cfg: TrainConfig, warmup_batches: int, max_batches: int) -> ComposerScheduler:
    """Linear warmup from 0 to optimizer.lr, then cosine down to scheduler.min_lr at the last step."""
    from composer.optim import CosineAnnealingWithWarmupScheduler

    if warmup_batches >= max_batches:
        raise ConfigError(
            f"scheduler.warmup={cfg.scheduler.warmup} ({warmup_batches} steps) is not shorter than "
            f"training.max_duration={cfg.training.max_duration} ({max_batches} steps); shorten the warmup"
        )
    return CosineAnnealingWithWarmupScheduler(
        t_warmup=f"{warmup_batches}ba",
        t_max=f"{max_batches}ba",
        alpha_f=cfg.scheduler.min_lr / cfg.optimizer.lr,
    )
