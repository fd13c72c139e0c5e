"""One console line every `log_interval` steps: progress, loss, tokens/s, MFU and time to finish.

    [progress] step 120/600 (20%) | 245.8k tokens | loss 5.1234 | lr 2.95e-03 | 8,412 tokens/s | ETA 3m12s

Composer's progress bar shows only losses and metrics, and its console logger prints every metric
unlabelled; neither says when the run ends. This destination collects what Composer's
`SpeedMonitor` (tokens/s; MFU where the GPU's peak is in its table), `LRMonitor` and
`RuntimeEstimator` (the estimated seconds left, `time/remaining_estimate`: training time per
fraction of the run measured since this process started, plus the evaluations still to come, so a
resumed run estimates from its own speed) logged, and prints them together on rank 0. The same
values reach metrics.jsonl (`tokens_per_sec`, `mfu`, `eta_seconds`) and every tracker.
"""

from __future__ import annotations

from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

ETA_KEY = "time/remaining_estimate"


class ProgressLine(LoggerDestination):
    def __init__(self, interval: int):
        super().__init__()
        self.interval = max(1, interval)
        self.latest: dict[str, float] = {}
        self.last_line = ""
        self.total: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        # Kept from the start: a stop on SIGTERM lowers state.max_duration to the current batch.
        self.total = int(state.max_duration.value) if state.max_duration is not None else None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            try:
                self.latest[key] = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError):
                continue

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch)
        if step % self.interval or dist.get_global_rank() != 0:
            return
        self.last_line = describe(step, self.total, int(state.timestamp.token), self.latest)
        _write(self.last_line)


def describe(step: int, total: int | None, tokens: int, latest: dict[str, float]) -> str:
    """The progress line for `step` of `total` from the latest logged values."""
    where = f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"
    parts = [where, f"{_short(tokens)} tokens"]
    if "loss/train/total" in latest:
        parts.append(f"loss {latest['loss/train/total']:.4f}")
    lr = next((v for k, v in latest.items() if k.startswith("lr-")), None)
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if "throughput/tokens_per_sec" in latest:
        parts.append(f"{latest['throughput/tokens_per_sec']:,.0f} tokens/s")
    if "throughput/device/mfu" in latest:
        parts.append(f"MFU {100 * latest['throughput/device/mfu']:.1f}%")
    if ETA_KEY in latest:
        parts.append(f"ETA {duration(latest[ETA_KEY])}")
    return "[progress] " + " | ".join(parts)


def duration(seconds: float) -> str:
    """`3m12s`, `2h05m`, `3d04h`: the two largest units."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def _short(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _write(line: str) -> None:
    """Print above a progress bar if one is drawn (tqdm clears and redraws it), else plainly."""
    import sys

    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
