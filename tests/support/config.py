"""Quantities tests derive from a loaded config: reference values to assert the code against."""

from __future__ import annotations

import math

from llm.config import TrainConfig


def seq_len(cfg: TrainConfig) -> int:
    return cfg.model.max_seq_len


def grad_accum(cfg: TrainConfig) -> int:
    """Micro-batches per optimizer step on one rank at world size 1."""
    return cfg.training.global_batch_size // cfg.training.device_microbatch_size


def lr_at(step: int, lr: float, min_lr: float, warmup_batches: int, max_batches: int) -> float:
    """The learning rate llm.optim's schedule should give at `step`: linear warmup, then cosine."""
    if step < warmup_batches:
        return lr * step / warmup_batches
    frac = min(1.0, (step - warmup_batches) / (max_batches - warmup_batches))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
