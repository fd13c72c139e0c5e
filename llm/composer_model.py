"""The Composer wrapper around `llm.model.Transformer`: next-token loss, metrics and FLOPs.

A batch is `{"input_ids": LongTensor[B, L]}` of packed token samples; the model reads
`input_ids[:, :-1]` and is scored on `input_ids[:, 1:]`.
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
        # Composer's FSDP (1 and 2) wraps each child of a ComposerModel and asks that child which
        # submodules to shard and to recompute: one unit per transformer block.
        model.fsdp_wrap_fn = _is_block
        model.activation_checkpointing_fn = _is_block

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, seed: int, device: str | torch.device | None = None
    ) -> LanguageModel:
        """Build on `device` (None: the current default; "meta": allocate nothing)."""
        with torch.device(device) if device is not None else nullcontext():
            return cls(Transformer(cfg, seed=seed))

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model(batch["input_ids"][:, :-1])

    def loss(self, outputs: Tensor, batch: dict[str, Tensor], *args: Any, **kwargs: Any) -> Tensor:
        targets = batch["input_ids"][:, 1:]
        return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        return self.train_metrics if is_train else self.eval_metrics

    def update_metric(self, batch: dict[str, Tensor], outputs: Tensor, metric: Metric) -> None:
        # LanguageCrossEntropy calls .view() on both: slices must be made contiguous first.
        metric.update(outputs.contiguous(), batch["input_ids"][:, 1:].contiguous())

    def flops_per_batch(self, batch: dict[str, Tensor]) -> float:
        """Training FLOPs of one batch (SpeedMonitor turns this into MFU on known GPUs)."""
        input_ids = batch["input_ids"]
        return self.model.flops_per_batch(input_ids.shape[0], input_ids.shape[1] - 1)


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, TransformerBlock)
