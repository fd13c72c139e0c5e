"""`<run_dir>/metrics.jsonl`: one JSON object per logged step, for scripts and plots.

Composer logs values from many places at slightly different moments of a batch (the loss before
the batch counter advances, throughput and learning rate after it, evaluation after that). This
destination remembers the latest value of each and writes one line at `BATCH_CHECKPOINT`, the last
event of a batch, when everything for that step is known.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from llm.checkpoint.preemption import stop_requested
from llm.run_dir import STOPPED

# metrics.jsonl field -> Composer metric name (lr is matched by prefix: "lr-AdamW/group0"). Also
# written: each eval stream's `eval_loss/<name>` and `eval_perplexity/<name>` (from
# metrics/eval/<name>/...; eval_loss itself is their token-weighted total, llm/callbacks/eval_sources.py),
# every multiple-choice result under its own name, `tasks/<task>/acc` ... (llm/callbacks/task_eval.py),
# and the guard's events on the step of the spike, `guard/rolled_back_to` ... (llm/callbacks/guard.py).
FIELDS = {
    "loss": "loss/train/total",  # what is back-propagated: the cross-entropy plus the logit penalties
    "cross_entropy": "loss/train/cross_entropy",  # the three below: with model.z_loss / max_z_loss only
    "z_loss": "loss/train/z_loss",
    "max_z_loss": "loss/train/max_z_loss",
    "eval_loss": "metrics/eval/LanguageCrossEntropy",
    "eval_perplexity": "metrics/eval/LanguagePerplexity",
    "tokens_per_sec": "throughput/tokens_per_sec",
    "mfu": "throughput/device/mfu",
    "eta_seconds": "time/remaining_estimate",  # Composer's RuntimeEstimator (llm/trainer.py: seconds)
}
_EVAL_KEYS = ("eval_loss", "eval_perplexity")
_EVAL_METRICS = {FIELDS[k] for k in _EVAL_KEYS}
_SOURCE_FIELDS = {"LanguageCrossEntropy": "eval_loss", "LanguagePerplexity": "eval_perplexity"}


def _per_run_field(key: str) -> str | None:
    """The metrics.jsonl field of a per-source, task or guard metric, or None for other metrics.
    Such a value belongs to the step it was logged at only, and that step's line is always written."""
    if key.startswith(("tasks/", "guard/")):
        return key
    parts = key.split("/")
    if len(parts) == 4 and parts[:2] == ["metrics", "eval"] and parts[3] in _SOURCE_FIELDS:
        return f"{_SOURCE_FIELDS[parts[3]]}/{parts[2]}"
    return None


class MetricsFile(LoggerDestination):
    """Write step, tokens, loss, lr, eval loss/perplexity and tokens/s every `interval` steps.

    Steps with an evaluation and the final step are always written. A resumed run appends; a run
    that starts from step 0 starts a fresh file. A run stopping on SIGTERM/SIGINT between logged
    steps writes the step it stopped at, where its checkpoint is, marked `"stopped": true`, so its
    records (and `llm plot`) reach its checkpoint rather than the last logged step; a resume drops
    that line (llm/run_dir.py's `cut_after`, with the lines past the checkpoint resumed from) and
    writes the lines an uninterrupted run would have, so the file of a run preempted any number of
    times equals an uninterrupted run's.
    """

    def __init__(self, path: str | Path, interval: int = 1):
        super().__init__()
        self.path = Path(path)
        self.interval = max(1, interval)
        self._latest: dict[str, float] = {}
        self._last_written = -1

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) or hasattr(value, "item"):
                self._latest[key] = float(value.item() if hasattr(value, "item") else value)

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if int(state.timestamp.batch) == 0:
            self.path.write_text("", encoding="utf-8")

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self.flush(state)

    def flush(self, state: State) -> None:
        """Write this step's line now if it is due (the run records call this before a checkpoint's
        records are stored: Composer runs loggers after the other callbacks of an event)."""
        step = int(state.timestamp.batch)
        has_eval = any(key in _EVAL_METRICS or _per_run_field(key) for key in self._latest)
        if step == self._last_written:
            return
        if step % self.interval == 0 or has_eval:
            self._write(state)
        elif stop_requested(state):  # the step its checkpoint is saved at; a resume drops the line
            self._write(state, stopped=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        if stop_requested(state):
            return
        if int(state.timestamp.batch) != self._last_written:
            self._write(state)

    def _write(self, state: State, stopped: bool = False) -> None:
        step = int(state.timestamp.batch)
        record: dict[str, Any] = {"step": step, "tokens": int(state.timestamp.token)}
        if stopped:
            record[STOPPED] = True
        for name, key in FIELDS.items():
            if key in self._latest:
                record[name] = self._latest[key]
        lr = next((v for k, v in self._latest.items() if k.startswith("lr-")), None)
        if lr is not None:
            record["lr"] = lr
        for key in [k for k in self._latest if _per_run_field(k)]:  # an evaluation belongs to its step
            value = self._latest.pop(key)
            record[_per_run_field(key)] = int(value) if key.startswith("guard/") else value  # batches
        for name in _EVAL_KEYS:  # an evaluation belongs to the step it ran at only
            self._latest.pop(FIELDS[name], None)
        self._last_written = step
        if dist.get_global_rank() == 0:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
