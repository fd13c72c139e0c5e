"""`<run_dir>/loss.png`: the loss curves, drawn from `<run_dir>/metrics.jsonl` at the end of training.

The picture (llm/plots.py) shows train loss, raw and smoothed, the eval total and, with several eval
streams, each source's curve, against tokens, with the learning rate in a panel below. It is drawn
from the run's records, not from a history kept in this callback: nothing of it travels in
checkpoints, and a resumed run's plot still shows the whole run because its metrics.jsonl was
brought back and appended to (llm/run_dir.py). The checkpoint records redraw it at
every save, so the copy beside the checkpoints is never older than the last save.
"""

from __future__ import annotations

from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from llm.plots import draw_run_plot


class LossPlot(Callback):
    """Draw `path` from the metrics.jsonl beside it, on rank 0, when the trainer closes."""

    def __init__(self, path: str | Path, title: str = "loss"):
        self.path = Path(path)
        self.title = title
        self.drawn = False

    def close(self, state: State, logger: Logger) -> None:
        # At close, not fit end: Composer writes the loggers' fit_end (metrics.jsonl's last line)
        # after the callbacks', and a run stopping on a signal exits inside fit_end.
        if dist.get_global_rank() == 0 and not self.drawn:
            self.drawn = draw_run_plot(self.path, self.title) is not None
