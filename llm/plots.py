"""Loss curves from a run's records: one run's `loss.png`, and `llm plot`'s comparison of runs.

Everything here reads `metrics.jsonl` (llm/loggers/metrics_file.py: one JSON object per logged
step with `step`, `tokens`, `loss`, `lr`, `eval_loss`, `eval_loss/<source>`, `tokens_per_sec`),
never a checkpoint: the curves of a 7B run hold hundreds of thousands of points, which would
otherwise travel in every checkpoint. The x axis is tokens, as baby-llama2-chinese plots it, so
runs with different batch sizes or sequence lengths line up.

A run is found as a folder (local or `s3://`) holding `metrics.jsonl` (a `run_dir`) or
`records/metrics.jsonl` (a checkpoint save folder, llm/run_dir.py). No Composer import:
`llm plot` stays quick. What a run's loss counts comes from its config.yaml (`data.kind`): every
token of pretraining, only the answer tokens of SFT; runs that differ are labelled with it. So
does its tokenizer (`tokenizer.path`; the file's SHA-256 where it is readable here): a loss per
token of one tokenizer does not compare with another's, nor do the token counts of the x axis, so
runs with different tokenizers are labelled with theirs and the figure and the table say so.

The guard's work is marked (llm/callbacks/guard.py, docs/guard.md): each rollback as a dotted line
at its spike, each window of skipped batches as a shaded band. The windows come from the run's
config.yaml (`data.skip`, which the run rewrites with every window it adds) and from the
`guard/skip_from`, `guard/skip_to` fields of metrics.jsonl; batches become tokens at the run's
tokens per batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm.errors import ConfigError
from llm.run_dir import CONFIG, METRICS, RECORDS_DIR
from storage import StorageError, open_store

# What the loss of a run of each `data.kind` averages over (llm/composer_model.py).
LOSS_COUNTS = {"pretrain": "all tokens", "sft": "answer tokens only"}


@dataclass
class RunCurves:
    """One run's records: where they came from, a label, its metrics.jsonl rows, its `data.kind`
    (None when the records hold no config.yaml) and the windows of batches it skipped (`data.skip`)."""

    source: str
    label: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    kind: str | None = None
    skip: list[list[int]] = field(default_factory=list)
    tokenizer: str | None = None  # tokenizer.path as the run's config.yaml has it
    tokenizer_id: str | None = None  # what tells tokenizers apart: the file's SHA-256, else the path

    def rollbacks(self) -> list[tuple[int, int]]:
        """(spike batch, batch rolled back to) of each of the guard's rollbacks."""
        return [
            (int(r["guard/spike_batch"]), int(r["guard/rolled_back_to"]))
            for r in self.rows
            if "guard/rolled_back_to" in r and "guard/spike_batch" in r
        ]

    def skipped(self) -> list[tuple[int, int]]:
        """The windows [from, to) of batches never trained on, merged, in order."""
        windows = [(int(a), int(b)) for a, b in self.skip]
        windows += [
            (int(r["guard/skip_from"]), int(r["guard/skip_to"])) for r in self.rows if "guard/skip_to" in r
        ]
        merged: list[tuple[int, int]] = []
        for start, end in sorted(windows):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def tokens_at(self, batch: int) -> float:
        """Tokens after `batch` batches, at the run's tokens per batch (every batch counts, skipped too)."""
        last = next((r for r in reversed(self.rows) if r["step"] > 0), None)
        return batch * last["tokens"] / last["step"] if last else float(batch)

    def points(self, key: str, kept: bool = False) -> tuple[list[int], list[float]]:
        """(tokens, values) of the rows that hold `key`; `kept`: without the steps a rollback undid
        (after the batch rolled back to, up to the spike's)."""
        undone = self.rollbacks() if kept else []
        rows = [
            r
            for r in self.rows
            if isinstance(r.get(key), int | float)
            and math.isfinite(r[key])
            and not any(back < r["step"] <= spike for spike, back in undone)
        ]
        return [int(r["tokens"]) for r in rows], [float(r[key]) for r in rows]

    def eval_sources(self) -> list[str]:
        names = {k.split("/", 1)[1] for r in self.rows for k in r if k.startswith("eval_loss/")}
        return sorted(names)

    def summary(self) -> dict[str, Any]:
        """Final train and eval loss, tokens, steps and the median logged tokens/s."""
        last = self.rows[-1] if self.rows else {}
        _, train = self.points("loss")
        _, evals = self.points("eval_loss")
        _, speed = self.points("tokens_per_sec")
        return {
            "run": self.label,
            "steps": last.get("step"),
            "tokens": last.get("tokens"),
            "train_loss": train[-1] if train else None,
            "eval_loss": evals[-1] if evals else None,
            "tokens_per_sec": statistics.median(speed) if speed else None,
            "rollbacks": len(self.rollbacks()),
            "skipped": sum(b - a for a, b in self.skipped()),
        }


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl text; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("tokens"), int):
            rows.append(row)
    return rows


def load_run(source: str) -> RunCurves:
    """The records of the run at `source`: a run_dir or a checkpoint save folder, local or s3://.

    ConfigError (one line) when `source` holds neither `metrics.jsonl` nor `records/metrics.jsonl`.
    """
    store = open_store(source)
    for prefix in ("", f"{RECORDS_DIR}/"):
        try:
            text = store.read_text(prefix + METRICS)
        except StorageError as err:
            if err.missing:
                continue
            raise
        if text is None:
            continue
        config = _run_config(store, prefix)
        name = config.get("run_name") or source.rstrip("/").rsplit("/", 1)[-1] or source
        data = config.get("data") if isinstance(config.get("data"), dict) else {}
        kind = str(data.get("kind", "pretrain")) if config else None  # data.kind's default: pretrain
        skip = [list(w) for w in data.get("skip") or [] if isinstance(w, list) and len(w) == 2]
        tokenizer = config.get("tokenizer") if isinstance(config.get("tokenizer"), dict) else {}
        path = str(tokenizer["path"]) if tokenizer.get("path") else None
        return RunCurves(
            source=source,
            label=str(name),
            rows=parse_metrics(text),
            kind=kind,
            skip=skip,
            tokenizer=path,
            tokenizer_id=_tokenizer_id(path),
        )
    raise ConfigError(
        f"{source} is not a run: it has no {METRICS} (a run_dir such as runs/demo) and no "
        f"{RECORDS_DIR}/{METRICS} (a checkpoint save folder, e.g. s3://bucket/ckpt/run)"
    )


def _run_config(store, prefix: str) -> dict[str, Any]:
    """The run's config.yaml (the resolved recipe), or {} if it has none or it cannot be read."""
    try:
        config = yaml.safe_load(store.read_text(prefix + CONFIG) or "") or {}
    except (yaml.YAMLError, StorageError):
        config = {}
    return config if isinstance(config, dict) else {}


def _tokenizer_id(path: str | None) -> str | None:
    """The SHA-256 of the tokenizer file at `path` when it is a file here (copies of one tokenizer
    under other paths are one tokenizer), else the path itself."""
    if path is None or "://" in path or not Path(path).is_file():
        return path
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def different_tokenizers(runs: list[RunCurves]) -> bool:
    """Whether the runs were trained with more than one tokenizer (runs that record none aside)."""
    return len({r.tokenizer_id for r in runs if r.tokenizer_id is not None}) > 1


TOKENIZER_NOTE = (
    "note: these runs use different tokenizers: a loss per token, and the tokens on the x axis, "
    "do not compare between runs of different tokenizers"
)


def label_runs(runs: list[RunCurves]) -> None:
    """Give runs that share a label their source instead, so the legend tells them apart; when
    the runs' losses count different tokens (pretraining and SFT), or tokens of different
    tokenizers, say in each label what it counts and with which tokenizer."""
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = run.source
    kinds, tokenizers = len({r.kind for r in runs}) > 1, different_tokenizers(runs)
    for run in runs:
        notes = [f"loss over {LOSS_COUNTS.get(run.kind or '', 'unrecorded tokens')}"] if kinds else []
        notes += [f"tokenizer {run.tokenizer or 'unrecorded'}"] if tokenizers else []
        if notes:
            run.label += f" ({', '.join(notes)})"


# --- drawing --------------------------------------------------------------------------------


def draw_run_plot(path: str | Path, title: str) -> Path | None:
    """Draw `path` (a run's loss.png) from the metrics.jsonl beside it; None if nothing to draw."""
    path = Path(path)
    if not (path.parent / METRICS).is_file():
        return None
    run = load_run(str(path.parent))
    return plot_run(run, path, title) if run.rows else None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    return plt, EngFormatter


def plot_run(run: RunCurves, path: str | Path, title: str | None = None) -> Path:
    """One run: train loss (raw and smoothed), eval loss (total and each source), lr below."""
    plt, eng = _pyplot()
    fig = run_figure(run, title)
    return _save(fig, plt, eng, fig.axes[1], path)


def run_figure(run: RunCurves, title: str | None = None):
    """The matplotlib figure `plot_run` saves: loss against tokens above, learning rate below."""
    plt, _ = _pyplot()
    fig, (ax, ax_lr) = plt.subplots(
        2, 1, figsize=(8, 6), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    tokens, losses = run.points("loss")
    if losses:  # the smoothed curve leaves out the steps a rollback undid (the raw one shows them)
        ax.plot(tokens, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train")
        kept_tokens, kept = run.points("loss", kept=True)
        ax.plot(kept_tokens, ema(kept), color="tab:blue", linewidth=1.5, label="train (smoothed)")
    sources = run.eval_sources()
    eval_tokens, evals = run.points("eval_loss")
    if evals:
        label = "eval (all sources)" if len(sources) > 1 else "eval"
        ax.plot(eval_tokens, evals, "o-", color="tab:orange", label=label)
    if len(sources) > 1:
        for name in sources:
            ax.plot(*run.points(f"eval_loss/{name}"), "x--", linewidth=1, label=f"eval {name}")
    mark_guard(ax, run, "tab:red")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or f"{run.label}: loss")
    ax.grid(alpha=0.3)
    if losses or evals:
        ax.legend()
    _lr_panel(ax_lr, [(run, "tab:green")])
    ax_lr.set_xlabel("tokens")
    return fig


def plot_compare(runs: list[RunCurves], path: str | Path, title: str = "loss vs tokens") -> Path:
    """Several runs in one figure: smoothed train loss (line) and eval loss (markers), one colour each."""
    plt, eng = _pyplot()
    fig = compare_figure(runs, title)
    return _save(fig, plt, eng, fig.axes[1], path)


def compare_figure(runs: list[RunCurves], title: str = "loss vs tokens"):
    """The matplotlib figure `plot_compare` saves: the runs' losses above, their rates below."""
    plt, _ = _pyplot()
    fig, (ax, ax_lr) = plt.subplots(
        2, 1, figsize=(9, 6.5), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    coloured = [(run, colours[i % len(colours)]) for i, run in enumerate(runs)]
    for run, colour in coloured:
        tokens, losses = run.points("loss")
        if losses:
            ax.plot(tokens, losses, color=colour, alpha=0.15, linewidth=0.8)
            kept_tokens, kept = run.points("loss", kept=True)
            ax.plot(kept_tokens, ema(kept), color=colour, linewidth=1.6, label=f"{run.label} train")
        eval_tokens, evals = run.points("eval_loss")
        if evals:
            ax.plot(eval_tokens, evals, "o--", color=colour, linewidth=1, label=f"{run.label} eval")
        mark_guard(ax, run, colour, f"{run.label} ")
    if different_tokenizers(runs):
        ax.set_ylabel("cross-entropy loss per token of each run's tokenizer")
        ax.set_title(f"{title}\n(different tokenizers: losses per token do not compare)")
    else:
        ax.set_ylabel("cross-entropy loss")
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _lr_panel(ax_lr, coloured)
    return fig


def mark_guard(ax, run: RunCurves, colour: str, prefix: str = "") -> None:
    """The run's skipped windows as shaded bands, its rollbacks as dotted lines at the spike."""
    for i, (start, end) in enumerate(run.skipped()):
        label = f"{prefix}skipped batches" if i == 0 else None
        ax.axvspan(run.tokens_at(start), run.tokens_at(end), color=colour, alpha=0.12, label=label)
    for i, (spike, _) in enumerate(run.rollbacks()):
        label = f"{prefix}rollback" if i == 0 else None
        ax.axvline(run.tokens_at(spike), color=colour, linestyle=":", linewidth=1.2, label=label)


def _lr_panel(ax, runs) -> None:
    for run, colour in runs:
        tokens, lrs = run.points("lr")
        if lrs:
            ax.plot(tokens, lrs, color=colour, linewidth=1.2)
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)


def _save(fig, plt, eng, ax_bottom, path: str | Path) -> Path:
    ax_bottom.set_xlabel("tokens")
    ax_bottom.xaxis.set_major_formatter(eng(sep=""))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def ema(values: list[float], beta: float = 0.9) -> list[float]:
    """Exponential moving average, debiased so the first points are not pulled towards zero."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


# --- the table --------------------------------------------------------------------------------


def summary_table(runs: list[RunCurves]) -> str:
    """A plain-text table: one row per run (final losses, tokens, steps, median tokens/s, the guard's
    rollbacks and the batches skipped)."""
    header = ["run", "steps", "tokens", "train loss", "eval loss", "tokens/s", "rollbacks", "skipped"]
    rows = []
    for run in runs:
        s = run.summary()
        rows.append(
            [
                s["run"],
                _num(s["steps"], "{:,}"),
                _num(s["tokens"], "{:,}"),
                _num(s["train_loss"], "{:.4f}"),
                _num(s["eval_loss"], "{:.4f}"),
                _num(s["tokens_per_sec"], "{:,.0f}"),
                _num(s["rollbacks"], "{:,}"),
                _num(s["skipped"], "{:,}"),
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
