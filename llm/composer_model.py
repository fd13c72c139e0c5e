"""The Composer wrapper around `llm.model.Transformer`: next-token loss, metrics and FLOPs.

A batch is `{"input_ids": LongTensor[B, L]}` of packed token samples; the model reads
`input_ids[:, :-1]` and is scored on `input_ids[:, 1:]`.

SFT batches (`llm.data`, data.kind=sft) add `loss_mask [B, L]` (True on the tokens to learn:
the answers and their EOS) and `segments [B, L]` (the example of each token, 1, 2, ...; 0 =
padding). The loss is then the mean over the masked targets only (`loss_mask[:, 1:]`): prompt
tokens and padding contribute nothing, whatever their ids. When a sample packs several examples,
each token attends only to earlier tokens of its own example and rotary positions restart at
every example, so a packed example gets the logits it would get alone.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from composer.metrics import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torch import Tensor, nn
from torchmetrics import Metric

from llm.model import ModelConfig, Transformer, TransformerBlock


class LanguageModel(ComposerModel):
    """`Transformer` as a ComposerModel; its blocks are the FSDP and checkpointing units."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        # No train metrics: Composer already logs the training loss (loss/train/total), and a
        # train LanguageCrossEntropy would recompute the same cross-entropy over the [B, T, V]
        # logits every batch, plus a metric sync, for an identical number (~5% of a CPU step).
        self.train_metrics: dict[str, Metric] = {}
        self.eval_metrics = {
            "LanguageCrossEntropy": LanguageCrossEntropy(),
            "LanguagePerplexity": LanguagePerplexity(),
        }
        # Composer's FSDP2 wraps each child of a ComposerModel and asks that child which submodules
        # to shard: one unit per transformer block (checkpointing: llm/parallelism.py).
        model.fsdp_wrap_fn = _is_block

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, seed: int, device: str | torch.device | None = None
    ) -> LanguageModel:
        """Build on `device` (None: the current default; "meta": allocate nothing)."""
        with torch.device(device) if device is not None else nullcontext():
            return cls(Transformer(cfg, seed=seed))

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        tokens = batch["input_ids"][:, :-1]
        segments = batch.get("segments")
        if segments is None or not bool((segments.amax(dim=1) > 1).any()):
            # One example per row (or plain text): the causal kernel; padding sits after the example,
            # where no real token looks.
            return self.model(tokens)
        mask, positions = packed_attention(segments[:, :-1])
        return self.model(tokens, attention_mask=mask, positions=positions)

    def loss(self, outputs: Tensor, batch: dict[str, Tensor], *args: Any, **kwargs: Any) -> Tensor:
        logits, targets = outputs.reshape(-1, outputs.size(-1)), scored_targets(batch).reshape(-1)
        if "loss_mask" not in batch:
            return F.cross_entropy(logits, targets)
        # Sum over the scored targets / their count (0 when there are none, never NaN); Composer
        # weights micro-batches by their answer tokens (llm.data.train_data_spec).
        total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        return self.train_metrics if is_train else self.eval_metrics

    def update_metric(self, batch: dict[str, Tensor], outputs: Tensor, metric: Metric) -> None:
        # LanguageCrossEntropy calls .view() on both: slices must be made contiguous first. It skips
        # targets equal to its ignore_index (-100), as the loss does.
        metric.update(outputs.contiguous(), scored_targets(batch).contiguous())

    def flops_per_batch(self, batch: dict[str, Tensor]) -> float:
        """Training FLOPs of one batch (SpeedMonitor turns this into MFU on known GPUs)."""
        input_ids = batch["input_ids"]
        return self.model.flops_per_batch(input_ids.shape[0], input_ids.shape[1] - 1)


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, TransformerBlock)


IGNORE_INDEX = -100  # never a token id (ids are >= 0), and LanguageCrossEntropy's default


def scored_targets(batch: dict[str, Tensor]) -> Tensor:
    """`input_ids[:, 1:]`, with IGNORE_INDEX where an SFT batch's `loss_mask[:, 1:]` is False."""
    targets = batch["input_ids"][:, 1:]
    mask = batch.get("loss_mask")
    return targets if mask is None else targets.masked_fill(~mask[:, 1:].bool(), IGNORE_INDEX)


def packed_attention(segments: Tensor) -> tuple[Tensor, Tensor]:
    """For `segments [B, T]`: the `[B, T, T]` mask (a token sees earlier tokens of its own segment,
    and itself) and the `[B, T]` positions counted from each segment's first token."""
    t = segments.shape[1]
    index = torch.arange(t, device=segments.device)
    same = segments[:, :, None] == segments[:, None, :]
    mask = same & (index[None, :] <= index[:, None])[None]
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index[None], torch.zeros_like(index)[None]).cummax(dim=1).values
    return mask, index[None] - first
