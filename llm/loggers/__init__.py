"""Composer logger destinations: where the values Composer logs go (one small module each).

  metrics_file.py    `MetricsFile`: <run_dir>/metrics.jsonl, one line per logged step
  progress_line.py   `ProgressLine`: the console's [progress] line (tokens/s, MFU, time to finish)
  trackers.py        `build_trackers`, `check_extras`: the experiment trackers a recipe turns on
  mlflow_tracker.py  `MLflowTracker`: Composer's MLflow logger, its run reopened on a resume
  mlflow_outbox.py   what MLflow is sent: points that wait out an outage and catch up
  wandb_tracker.py   `WandBTracker`: Composer's W&B logger, one run across resumes
  tracker_ids.py     `TrackerIds`: the trackers' run ids in <run_dir>/trackers.json

A logger destination receives what Composer logs (`log_metrics`, `log_hyperparameters`,
`log_table`) and sends it somewhere; a callback that only acts on training events lives in
`llm/callbacks/` (docs/architecture.md).
"""

from llm.loggers.metrics_file import MetricsFile
from llm.loggers.mlflow_tracker import MLflowTracker
from llm.loggers.progress_line import ProgressLine
from llm.loggers.tracker_ids import TrackerIds
from llm.loggers.trackers import build_trackers, check_extras
from llm.loggers.wandb_tracker import WandBTracker

__all__ = [
    "MLflowTracker",
    "MetricsFile",
    "ProgressLine",
    "TrackerIds",
    "WandBTracker",
    "build_trackers",
    "check_extras",
]
