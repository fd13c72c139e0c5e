"""The Composer wrapper around `llm.model.Transformer`: next-token loss, metrics and FLOPs.

A batch is `{"input_ids": LongTensor[B, L]}` of packed token samples; the model reads
`input_ids[:, :-1]` and is scored on `input_ids[:, 1:]`.

Documents in a packed sample (`Documents`, the recipe's `model.attention` and `model.positions`):
by default every token attends to every earlier token of the window, the previous documents
included (causal over the window: SDPA's causal kernel). With `model.attention=document` a token
attends only to earlier tokens of its own document, documents being separated by the EOS id the
shards' meta.json names; with `model.positions=document` rotary positions also restart at 0 on each
document's first token. The EOS between two documents opens the second: our prompts start with it
too (shards/tokenizer.py, `encode_prompt`), so each document is trained in the context a prompt
gives it, its last token learns to predict the EOS, and that EOS, seeing nothing before it,
predicts how a document begins. The model gets the document of
every token (`documents`) and builds the mask once per batch (`llm.model.document_mask`:
FlexAttention on GPUs, SDPA with a boolean mask on CPUs). A batch whose rows each hold one
document takes the causal kernel: the mask would be the same.

SFT batches (`llm.data`, data.kind=sft) add `loss_mask [B, L]` (True on the tokens to learn:
the answers and their EOS) and `segments [B, L]` (the example of each token, 1, 2, ...; 0 =
padding). The loss is then the mean over the masked targets only (`loss_mask[:, 1:]`): prompt
tokens and padding contribute nothing, whatever their ids. The examples are the documents,
whatever `model.attention` says: when a sample packs several, each token attends only to earlier
tokens of its own example and rotary positions restart at every example, so a packed example gets
the logits it would get alone (the same mechanism as above, with the boundaries from `segments`).

Penalties on the logits (the recipe's `model.z_loss` and `model.max_z_loss`, off by default): PaLM's
z-loss, `z_loss * log(Z)^2` per scored token (Z = sum(exp(logits)), the softmax normaliser), and
Baichuan 2's max-z loss, `max_z_loss * max(logits)^2` per scored token. Each is averaged over the
same tokens as the cross-entropy (all targets; an SFT batch's answer tokens), computed in fp32
from one log-sum-exp pass shared with the cross-entropy, and added to the loss that is
back-propagated. The loss is then a dict (`total`, `cross_entropy`, `z_loss`, `max_z_loss`), which
Composer back-propagates (`total`) and logs each of as `loss/train/<name>`.

Two paths to the same numbers. The plain one (`loss_chunk=0`): `forward` returns the fp32 logits
`[B, L - 1, V]` and `loss` scores them. The chunked one (the recipe's `model.loss_chunk` tokens,
`llm.loss`): `forward` hands the model's final hidden states and output weight to the chunked head
inside the model's forward (where FSDP2 has the weight gathered) and returns the loss itself, never
holding every token's logits; `loss` passes it on. In evaluation (`model.eval()`) the chunked
`forward` returns each target's cross-entropy `[B, L - 1]` (0 where not scored) and `update_metric`
adds them to LanguageCrossEntropy's and LanguagePerplexity's sums: the same metrics.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from composer.metrics import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torch import Tensor, nn
from torchmetrics import Metric

from llm.loss import IGNORE_INDEX, LossTerms, chunked_loss_terms, chunked_token_losses
from llm.model import ModelConfig, Transformer, TransformerBlock, document_positions


@dataclass(frozen=True)
class Documents:
    """Pretraining samples' documents kept apart (`model.attention=document`; module docstring)."""

    eos_id: int  # the token between documents, which opens the next one: the shards' meta.json eos_id
    restart_positions: bool = False  # `model.positions=document`: rotary position 0 at each document


class LanguageModel(ComposerModel):
    """`Transformer` as a ComposerModel; its blocks are the FSDP and checkpointing units."""

    def __init__(
        self,
        model: Transformer,
        z_loss: float = 0.0,
        max_z_loss: float = 0.0,
        documents: Documents | None = None,
        loss_chunk: int = 0,
    ):
        super().__init__()
        self.model = model
        self.loss_chunk = loss_chunk  # tokens per chunk of the chunked loss head (llm.loss); 0: plain
        self.z_loss = z_loss  # the logit penalties' weights (see the module docstring); 0: off
        self.max_z_loss = max_z_loss
        self.documents = documents  # None: causal over the window
        # No train metrics: Composer already logs the training loss (loss/train/total), and a
        # train LanguageCrossEntropy would recompute the same cross-entropy over the [B, T, V]
        # logits every batch, plus a metric sync, for an identical number (~5% of a CPU step).
        self.train_metrics: dict[str, Metric] = {}
        # The chunked path's eval outputs are each target's cross-entropy, not logits: the same
        # metrics, summing those instead (`TokenCrossEntropy`).
        chunked = bool(loss_chunk)
        self.eval_metrics = {
            "LanguageCrossEntropy": TokenCrossEntropy() if chunked else LanguageCrossEntropy(),
            "LanguagePerplexity": TokenPerplexity() if chunked else LanguagePerplexity(),
        }
        # Composer's FSDP2 wraps each child of a ComposerModel and asks that child which submodules
        # to shard: one unit per transformer block (checkpointing: llm/parallelism.py).
        model.fsdp_wrap_fn = _is_block

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        seed: int,
        device: str | torch.device | None = None,
        *,
        z_loss: float = 0.0,
        max_z_loss: float = 0.0,
        documents: Documents | None = None,
        loss_chunk: int = 0,
    ) -> LanguageModel:
        """Build on `device` (None: the current default; "meta": allocate nothing)."""
        with torch.device(device) if device is not None else nullcontext():
            model = Transformer(cfg, seed=seed)
        return cls(model, z_loss=z_loss, max_z_loss=max_z_loss, documents=documents, loss_chunk=loss_chunk)

    def forward(self, batch: dict[str, Tensor]) -> Tensor | dict[str, Tensor]:
        """The logits (plain path); with `loss_chunk`, the loss in training and each target's
        cross-entropy in evaluation (module docstring)."""
        tokens = batch["input_ids"][:, :-1]
        documents, restart = self.documents_of(batch)
        kwargs: dict[str, Any] = {}
        if documents is not None:
            kwargs["documents"] = documents
            kwargs["positions"] = document_positions(documents) if restart else None
        if self.loss_chunk:
            kwargs["head"] = self._chunked_head(scored_targets(batch))
        return self.model(tokens, **kwargs)

    def _chunked_head(self, targets: Tensor):
        chunk, z_loss, max_z_loss = self.loss_chunk, self.z_loss, self.max_z_loss
        if not self.training:
            return lambda hidden, weight: chunked_token_losses(hidden, weight, targets, chunk)

        def head(hidden: Tensor, weight: Tensor) -> Tensor | dict[str, Tensor]:
            terms = chunked_loss_terms(
                hidden, weight, targets, chunk, z_loss=bool(z_loss), max_z_loss=bool(max_z_loss)
            )
            return loss_from_terms(terms, z_loss, max_z_loss)

        return head

    def documents_of(self, batch: dict[str, Tensor]) -> tuple[Tensor | None, bool]:
        """The document of every input token `[B, L - 1]` and whether positions restart at each;
        `(None, False)` where causal attention over the window is what is wanted or is the same."""
        segments = batch.get("segments")
        if segments is not None:  # SFT: the examples, always apart
            if not bool((segments.amax(dim=1) > 1).any()):
                # One example per row: the causal kernel; padding sits after the example, where no
                # real token looks.
                return None, False
            return segment_documents(segments[:, :-1]), True
        if self.documents is None:
            return None, False
        documents = eos_documents(batch["input_ids"][:, :-1], self.documents.eos_id)
        if not bool((documents[:, -1] != documents[:, 0]).any()):  # one document per row: the causal mask
            return None, False
        return documents, self.documents.restart_positions

    def loss(
        self, outputs: Tensor, batch: dict[str, Tensor], *args: Any, **kwargs: Any
    ) -> Tensor | dict[str, Tensor]:
        if self.loss_chunk:  # the chunked head's forward computed it
            return outputs
        logits, targets = outputs.reshape(-1, outputs.size(-1)), scored_targets(batch).reshape(-1)
        if self.z_loss or self.max_z_loss:
            return penalised_loss(logits, targets, self.z_loss, self.max_z_loss)
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


class _TokenLosses:
    """`update(losses, targets)` from each target's cross-entropy (`[B, T]`, 0 where IGNORE_INDEX):
    LanguageCrossEntropy's two sums, as its own update computes them from logits."""

    def update(self, output: Tensor, target: Tensor) -> None:
        self.sum_loss += output.sum()
        self.total_items += (target != IGNORE_INDEX).sum()


class TokenCrossEntropy(_TokenLosses, LanguageCrossEntropy):
    """LanguageCrossEntropy over the chunked head's per-token losses."""


class TokenPerplexity(_TokenLosses, LanguagePerplexity):
    """LanguagePerplexity over the chunked head's per-token losses."""


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, TransformerBlock)


def scored_targets(batch: dict[str, Tensor]) -> Tensor:
    """`input_ids[:, 1:]`, with IGNORE_INDEX where an SFT batch's `loss_mask[:, 1:]` is False."""
    targets = batch["input_ids"][:, 1:]
    mask = batch.get("loss_mask")
    return targets if mask is None else targets.masked_fill(~mask[:, 1:].bool(), IGNORE_INDEX)


def penalised_loss(logits: Tensor, targets: Tensor, z_loss: float, max_z_loss: float) -> dict[str, Tensor]:
    """Cross-entropy plus the logit penalties (module docstring), each a mean over the targets that
    are not IGNORE_INDEX, in fp32: `{"total", "cross_entropy", "z_loss"?, "max_z_loss"?}`.

    `logits [N, V]`, `targets [N]`. The log-sum-exp is computed once and serves both the
    cross-entropy (`log Z - logit of the target`) and the z-loss."""
    logits = logits.float()
    scored = targets != IGNORE_INDEX
    count = scored.sum().clamp(min=1)

    def mean(per_token: Tensor) -> Tensor:  # over the scored targets; 0 when there are none
        return torch.where(scored, per_token, 0.0).sum() / count

    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    terms = {"cross_entropy": mean(log_z - target_logit)}
    if z_loss:
        terms["z_loss"] = z_loss * mean(log_z.square())
    if max_z_loss:
        terms["max_z_loss"] = max_z_loss * mean(logits.amax(dim=-1).square())
    return {"total": sum(terms.values()), **terms}


def loss_from_terms(terms: LossTerms, z_loss: float, max_z_loss: float) -> Tensor | dict[str, Tensor]:
    """The chunked head's sums as `loss` returns them on the plain path: the mean cross-entropy
    over the scored targets, or the dict of `penalised_loss`."""
    cross_entropy = terms.cross_entropy / terms.count
    if not (z_loss or max_z_loss):
        return cross_entropy
    parts = {"cross_entropy": cross_entropy}
    if z_loss:
        parts["z_loss"] = z_loss * terms.z_square / terms.count
    if max_z_loss:
        parts["max_z_loss"] = max_z_loss * terms.max_square / terms.count
    return {"total": sum(parts.values()), **parts}


def eos_documents(tokens: Tensor, eos_id: int) -> Tensor:
    """The document of each token of `tokens [B, T]`: each EOS opens the next one (module docstring)."""
    return (tokens == eos_id).long().cumsum(dim=1)


def segment_documents(segments: Tensor) -> Tensor:
    """An SFT sample's `segments [B, T]` (1, 2, ...; 0 = padding) as documents counted from 0; the
    padding after the last example is one more."""
    starts = torch.zeros_like(segments, dtype=torch.long)
    starts[:, 1:] = (segments[:, 1:] != segments[:, :-1]).long()
    return starts.cumsum(dim=1)
