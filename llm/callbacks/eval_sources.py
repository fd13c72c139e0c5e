"""Per-source evaluation: each eval stream's loss and perplexity, and their token-weighted total.

The trainer gives every eval stream its own Composer `Evaluator`, labelled `eval/<name>` (the
stream's `name`, or its folder's), so Composer logs `metrics/eval/<name>/LanguageCrossEntropy` and
`.../LanguagePerplexity` for each. This callback adds the total over all sources, weighted by the
tokens each one scored (sum of token losses / number of tokens, as if all were one set), and logs
it as `metrics/eval/LanguageCrossEntropy` and `metrics/eval/LanguagePerplexity`: the names the
single evaluator of earlier versions used, so existing dashboards keep their curve.

After the last evaluator, Composer leaves that evaluator's values in `state.eval_metric_values`;
this callback puts the totals there instead, so whatever reads "the eval loss" from the state (the
loss plot, the end-of-run summary, Composer's early stoppers) reads the total. It must run before
such callbacks (the trainer puts it first). Rank 0 prints one line per evaluation.
"""

from __future__ import annotations

import math

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

LABEL_PREFIX = "eval/"
LOSS, PERPLEXITY = "LanguageCrossEntropy", "LanguagePerplexity"


def source_label(name: str) -> str:
    """The Composer evaluator label of the eval stream `name`."""
    return LABEL_PREFIX + name


class EvalSources(Callback):
    def __init__(self, names: list[str]):
        self.names = list(names)
        self._pending: dict[str, tuple[float, float]] = {}  # name -> (sum of token losses, tokens)
        self.latest: dict[str, dict[str, float]] = {}  # "total" and each name -> loss, perplexity, tokens

    def eval_end(self, state: State, logger: Logger) -> None:
        label = state.dataloader_label or ""
        name = label.removeprefix(LABEL_PREFIX)
        metric = state.eval_metrics.get(label, {}).get(LOSS)
        if not label.startswith(LABEL_PREFIX) or name not in self.names or metric is None:
            return
        # The metric's states are this rank's after compute(); add them over the ranks (every rank
        # runs each evaluator, so every rank makes this call).
        sums = torch.tensor([float(metric.sum_loss), float(metric.total_items)], dtype=torch.float64)
        sums = sums.to(metric.sum_loss.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(sums, reduce_operation="SUM")
        self._pending[name] = (float(sums[0]), float(sums[1]))

    def eval_after_all(self, state: State, logger: Logger) -> None:
        if not self._pending:
            return
        losses = sum(s for s, _ in self._pending.values())
        tokens = sum(n for _, n in self._pending.values())
        latest = {name: _entry(s, n) for name, (s, n) in self._pending.items()}
        latest["total"] = _entry(losses, tokens)
        self._pending = {}
        self.latest = latest
        total = latest["total"]
        logger.log_metrics(
            {f"metrics/eval/{LOSS}": total["loss"], f"metrics/eval/{PERPLEXITY}": total["perplexity"]}
        )
        state.eval_metric_values[LOSS] = torch.tensor(total["loss"])
        state.eval_metric_values[PERPLEXITY] = torch.tensor(total["perplexity"])
        if dist.get_global_rank() == 0:
            print(f"[eval] step {int(state.timestamp.batch)}: {describe(latest)}", flush=True)


def _entry(sum_loss: float, tokens: float) -> dict[str, float]:
    loss = sum_loss / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens}


def describe(latest: dict[str, dict[str, float]]) -> str:
    """`loss 5.1234 (ppl 168.0) | wiki 5.0000 (148.4) | ...`: the total first, then each source."""
    parts = [f"loss {latest['total']['loss']:.4f} (ppl {latest['total']['perplexity']:.1f})"]
    parts += [f"{n} {v['loss']:.4f} ({v['perplexity']:.1f})" for n, v in latest.items() if n != "total"]
    return " | ".join(parts)


def eval_sources_callbacks(ctx) -> list[Callback]:
    """For `llm.trainer.CALLBACK_BUILDERS`: one EvalSources when the recipe has eval streams."""
    streams = ctx.cfg.data.eval
    return [EvalSources([s.label() for s in streams])] if streams else []
