"""`<run_dir>/loss.png`: train and eval loss curves, drawn once at the end of training.

With several eval streams the plot has one curve per source (evaluators labelled `eval/<name>`)
and the token-weighted total (what `llm.callbacks.eval_sources` leaves in the state after all
evaluators).

The history travels in checkpoints (Composer saves each callback's `state_dict`), so the plot of a
resumed run shows the whole run, not only the part after the restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class LossPlot(Callback):
    """Record train loss per step and eval loss per evaluation; plot both on rank 0 at fit end."""

    def __init__(self, path: str | Path, title: str = "loss"):
        self.path = Path(path)
        self.title = title
        self.train: list[tuple[int, float]] = []
        self.eval: list[tuple[int, float]] = []  # the total over eval sources
        self.sources: dict[str, list[tuple[int, float]]] = {}  # each eval source's own

    def batch_end(self, state: State, logger: Logger) -> None:
        loss = state.total_loss_dict.get("loss/train/total")
        if loss is not None:
            self.train.append((int(state.timestamp.batch), float(loss)))

    def eval_end(self, state: State, logger: Logger) -> None:
        loss = state.eval_metric_values.get("LanguageCrossEntropy")
        label = state.dataloader_label or ""
        if loss is None:
            return
        point = (int(state.timestamp.batch), float(loss))
        if label.startswith("eval/"):
            self.sources.setdefault(label.removeprefix("eval/"), []).append(point)
        else:  # a single evaluator: its loss is the total
            self.eval.append(point)

    def eval_after_all(self, state: State, logger: Logger) -> None:
        loss = state.eval_metric_values.get("LanguageCrossEntropy")
        step = int(state.timestamp.batch)
        if self.sources and loss is not None and (not self.eval or self.eval[-1][0] != step):
            self.eval.append((step, float(loss)))

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0 and self.train:
            plot_losses(self.train, self.eval, self.path, self.title, self.sources)

    def state_dict(self) -> dict[str, Any]:
        return {"train": list(self.train), "eval": list(self.eval), "sources": dict(self.sources)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train = [tuple(p) for p in state.get("train", [])]
        self.eval = [tuple(p) for p in state.get("eval", [])]
        self.sources = {n: [tuple(p) for p in v] for n, v in state.get("sources", {}).items()}


def plot_losses(
    train: list[tuple[int, float]],
    evals: list[tuple[int, float]],
    path: Path,
    title: str = "loss",
    sources: dict[str, list[tuple[int, float]]] | None = None,
) -> Path:
    """Save a PNG of the train curve (raw and smoothed), the eval total and each eval source."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    steps, losses = [s for s, _ in train], [v for _, v in train]
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train")
    ax.plot(steps, _ema(losses), color="tab:blue", linewidth=1.5, label="train (smoothed)")
    if evals:
        eval_steps, eval_losses = [s for s, _ in evals], [v for _, v in evals]
        label = "eval (all sources)" if sources and len(sources) > 1 else "eval"
        ax.plot(eval_steps, eval_losses, "o-", color="tab:orange", label=label)
    if sources and len(sources) > 1:
        for name, points in sources.items():
            ax.plot([s for s, _ in points], [v for _, v in points], "x--", linewidth=1, label=f"eval {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, avg = [], values[0]
    for v in values:
        avg = beta * avg + (1 - beta) * v
        out.append(avg)
    return out
