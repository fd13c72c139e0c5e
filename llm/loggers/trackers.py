"""Experiment trackers: MLflow, Weights & Biases and TensorBoard, through Composer's loggers.

`check_extras(cfg)` runs before any work: a tracker the recipe turns on whose package is missing is
one line naming the extra to install from the checkout (`.venv/bin/pip install -c constraints.txt -e
'.[mlflow]'`; `pip install 'llm-pretrain[mlflow]'` would look for the package in the registry). `build_trackers`
returns the Composer logger destinations:

- TensorBoard: Composer's `TensorboardLogger`, writing to `<run_dir>/tensorboard`.
- W&B: `WandBTracker` (llm/loggers/wandb_tracker.py), Composer's `WandBLogger` continuing one run.
- MLflow: `MLflowTracker` (llm/loggers/mlflow_tracker.py), Composer's `MLFlowLogger` whose points
  wait in an outbox while the server is away and catch up when it answers
  (llm/loggers/mlflow_outbox.py).

Both keep their run ids in `<run_dir>/trackers.json` (llm/loggers/tracker_ids.py). A resumed run
sends steps after its checkpoint only, so a run stopped by SIGTERM and resumed has each step once
in the tracker. After a SIGKILL the steps between the last checkpoint and the kill were sent by
the killed process and are sent again by the resumed one (MLflow keeps both values of such a
step; metrics.jsonl is cut back and holds one).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from composer.loggers import LoggerDestination, TensorboardLogger

from llm.config import TrainConfig
from llm.errors import ConfigError
from llm.loggers.mlflow_tracker import MLflowTracker, param_texts
from llm.loggers.tracker_ids import TrackerIds
from llm.loggers.wandb_tracker import wandb_tracker
from llm.run_dir import TRACKERS

# recipe key -> (module to import, extra of this project that installs it)
_EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


def wanted(cfg: TrainConfig) -> list[str]:
    """The trackers the recipe turns on, by recipe key."""
    lg = cfg.loggers
    return [
        k
        for k, on in (
            ("tensorboard", lg.tensorboard),
            ("mlflow", lg.mlflow.enabled),
            ("wandb", lg.wandb.enabled),
        )
        if on
    ]


def check_extras(cfg: TrainConfig) -> None:
    """ConfigError (one line, exit 2) for a tracker the recipe turns on whose package is missing."""
    for key in wanted(cfg):
        module, extra = _EXTRAS[key]
        try:
            importlib.import_module(module)
        except ImportError as err:
            switch = "loggers.tensorboard=false" if key == "tensorboard" else f"loggers.{key}.enabled=false"
            raise ConfigError(
                f"the recipe turns on {key} (loggers.{key}) but its package is not installed ({err}); "
                f"install its extra into .venv from the checkout: .venv/bin/pip install -c constraints.txt "
                f"-e '.[{extra}]' (make install installs all the trackers; or set {switch})"
            ) from None


def build_trackers(cfg: TrainConfig, run_dir: Path) -> list[LoggerDestination]:
    """Composer logger destinations for the trackers the recipe turns on (check_extras first)."""
    check_extras(cfg)
    ids = TrackerIds(run_dir / TRACKERS)
    params = param_texts(cfg.to_dict(redact=True))
    out: list[LoggerDestination] = []
    if cfg.loggers.tensorboard:
        out.append(TensorboardLogger(log_dir=str(run_dir / "tensorboard")))
    if cfg.loggers.mlflow.enabled:
        out.append(MLflowTracker(cfg.loggers.mlflow, cfg.run_name, run_dir, ids, params))
    if cfg.loggers.wandb.enabled:
        out.append(wandb_tracker(cfg.loggers.wandb, cfg.run_name, run_dir, ids, cfg.to_dict(redact=True)))
    return out
