"""The loss head computed over chunks of tokens: output projection + cross-entropy (+ the logit
penalties) without ever holding the logits of every token.

The plain path (`llm.composer_model`) projects all `N` tokens to `[N, V]` fp32 logits and keeps
them, their log-softmax and, in backward, their gradient: at 7B (4 x 4,096 tokens, V = 64,000)
about 14 GiB per GPU. Here the tokens are taken `chunk` at a time: in forward a chunk's logits
give its log-sum-exp, its target logit and its largest logit, and are dropped; backward
recomputes each chunk's logits from the saved hidden states and output weight, turns them into
their gradient in place (softmax scaled by the cross-entropy's and z-loss's weights, minus the
one-hot target, plus the max-z term at the argmax) and folds it into the hidden states' and the
weight's gradients at once. Alive at any time: one chunk's logits (`chunk x V`, in fp32 and in
the compute dtype) and a few numbers per token. The price: one more output projection per step
(2 N V h FLOPs of recomputation, ~1% of a 7B step).

Why an autograd Function, not `torch.utils.checkpoint` per chunk: `bench/loss.py` measures both.
Checkpointing a chunk keeps the same peak but its backward goes through autograd's generic
slicing (a zero-filled `[N, h]` hidden gradient per chunk, summed) and a fresh `[V, h]` weight
gradient per chunk added to the running one; here the weight's gradient accumulates in place
(`addmm_`) and each chunk writes its rows of the hidden gradient. The same arithmetic as the
plain path: the matmul in the dtype the plain `Linear` would use (the autocast dtype under
autocast, else the operands'), its output cast to fp32 for the log-sum-exp.

What it supports: IGNORE_INDEX targets (SFT's mask: they add nothing and are not counted), the
z-loss and max-z loss (`llm.composer_model`'s module docstring), tied and untied embeddings (the
weight is whatever `Transformer.output.weight` is), FSDP2 (called inside `Transformer.forward`,
the root unit's forward, where the output weight is gathered: once per step, as the plain path
gathers it) and `training.compile` (which compiles the blocks; the loss head runs eagerly, as the
plain path's does).

Neither Composer nor torch 2.7 has a chunked or fused linear cross-entropy; Liger Kernel's and
Apple's Cut Cross-Entropy are Triton kernels (GPU only, and a new dependency for one function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # never a token id (ids are >= 0), and LanguageCrossEntropy's default


@dataclass(frozen=True)
class LossTerms:
    """What the chunked head computes: the sums over the scored tokens of each term, and their count."""

    cross_entropy: Tensor  # sum of log Z - target logit
    z_square: Tensor  # sum of log(Z)^2 (0 unless asked)
    max_square: Tensor  # sum of max(logits)^2 (0 unless asked)
    count: Tensor  # scored targets (not IGNORE_INDEX), at least 1


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in: autocast's when it is on, else the operands'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sums `[3]` (cross-entropy, log(Z)^2, max^2 over the scored tokens) of `hidden [N, h] @ weight.T`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, want_z, want_max):
        dtype = _matmul_dtype(hidden, weight)
        h, w = hidden.to(dtype), weight.to(dtype)
        scored = targets != IGNORE_INDEX
        safe = targets.clamp(min=0)
        log_z = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        peak = torch.empty_like(log_z) if want_max else None
        argmax = torch.empty(targets.shape, dtype=torch.long, device=hidden.device) if want_max else None
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, targets.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = F.linear(h[rows], w).float()
                lse = torch.logsumexp(logits, dim=-1)
                log_z[rows] = lse
                target = logits.gather(1, safe[rows, None]).squeeze(1)
                keep = scored[rows]
                sums[0] += torch.where(keep, lse - target, 0.0).sum()
                if want_z:
                    sums[1] += torch.where(keep, lse.square(), 0.0).sum()
                if want_max:
                    best = logits.max(dim=-1)
                    peak[rows], argmax[rows] = best.values, best.indices
                    sums[2] += torch.where(keep, best.values.square(), 0.0).sum()
                del logits
        ctx.save_for_backward(hidden, weight, targets, log_z, peak, argmax)
        ctx.chunk, ctx.dtype = chunk, dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        hidden, weight, targets, log_z, peak, argmax = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        g_ce, g_z, g_max = grad_sums.float().unbind()
        scored = (targets != IGNORE_INDEX).float()
        safe = targets.clamp(min=0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, targets.shape[0], chunk):
                rows = slice(start, start + chunk)
                keep, lse = scored[rows], log_z[rows]
                # d/dlogits of ce + z * lse^2: softmax * (g_ce + 2 g_z lse) - g_ce * onehot(target)
                grad = F.linear(h[rows], w).float().sub_(lse[:, None]).exp_()
                grad.mul_(((g_ce + 2 * g_z * lse) * keep)[:, None])
                grad.scatter_add_(1, safe[rows, None], (-g_ce * keep)[:, None])
                if peak is not None:  # d/dlogits of max^2: 2 max at the argmax
                    grad.scatter_add_(1, argmax[rows, None], (2 * g_max * peak[rows] * keep)[:, None])
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    if dtype == weight.dtype:
                        grad_weight.addmm_(grad.t(), h[rows])
                    else:
                        grad_weight += (grad.t() @ h[rows]).to(weight.dtype)
                del grad
        return grad_hidden, grad_weight, None, None, None, None


def chunked_loss_terms(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk: int,
    *,
    z_loss: bool = False,
    max_z_loss: bool = False,
) -> LossTerms:
    """The loss's sums for `hidden [..., h]` (after the final norm), `weight [V, h]` (the output
    projection) and `targets [...]` (IGNORE_INDEX: not scored), `chunk` tokens at a time."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    sums = _ChunkedLinearCrossEntropy.apply(flat, weight, flat_targets, chunk, z_loss, max_z_loss)
    count = (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
    return LossTerms(sums[0], sums[1], sums[2], count)


@torch.no_grad()
def chunked_token_losses(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Evaluation: the cross-entropy of every token `[...]` (0 where IGNORE_INDEX), `chunk` tokens
    at a time, never holding every token's logits."""
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    losses = torch.empty(flat_targets.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, flat_targets.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = F.linear(flat[rows], weight).float()
        losses[rows] = F.cross_entropy(
            logits, flat_targets[rows], ignore_index=IGNORE_INDEX, reduction="none"
        )
    return losses.view(targets.shape)
