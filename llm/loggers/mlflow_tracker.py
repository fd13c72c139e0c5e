"""MLflow: `MLflowTracker`, a Composer `MLFlowLogger` whose sending is replaced.

What Composer's logger lacks for long runs: it reaches the server in its constructor and raises
when the server is down (training would not start), and its async queue drops a batch whose
request fails. Here the server is not needed to start: every metric and param goes into the
outbox (llm/loggers/mlflow_outbox.py), whose thread sends them, waits out outages and catches up.
The run is created, or reopened by the id in `trackers.json` on a resume (llm/loggers/tracker_ids.py),
when the server first answers. At the end, once the outbox is sent, the record files (loss plot,
samples, metrics, config, task results) are uploaded as artifacts and the run is closed: FINISHED,
KILLED when the run stopped on a signal, FAILED on an error.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, MLFlowLogger

from llm.checkpoint.preemption import stop_requested
from llm.config import MLflowConfig, flatten
from llm.loggers.mlflow_outbox import Outbox, say
from llm.loggers.tracker_ids import TrackerIds
from llm.run_dir import METRICS, RECORD_FILES

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value


class MLflowTracker(MLFlowLogger):
    """Composer's MLFlowLogger with an outbox that outlives server outages (module docstring)."""

    def __init__(self, settings: MLflowConfig, run_name: str, run_dir: Path, ids: TrackerIds, params: dict):
        # One attempt per request and a bounded wait: the outbox retries, not the HTTP layer.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.settings = settings
        self.record_dir = run_dir
        self.ids = ids
        self._uploaded: dict[str, float] = {}  # record file -> mtime uploaded
        self._final_status = "FINISHED"
        self._resumed_at: int | None = None  # the batch a resumed fit started at
        try:
            super().__init__(
                experiment_name=settings.experiment_name,
                run_name=settings.run_name or run_name,
                tracking_uri=settings.tracking_uri,
                log_system_metrics=False,
                logging_buffer_seconds=None,
            )
            failure = None
        except Exception as err:  # the server is down: the outbox thread creates the run later
            self._experiment_id = None
            failure = err
        self.outbox = Outbox(
            client=getattr(self, "_mlflow_client", None),
            tracking_uri=getattr(self, "tracking_uri", str(settings.tracking_uri)),  # Composer's, on rank 0
            settings=settings,
            metrics_file=run_dir / METRICS,
            params=params,
        )
        if failure is not None:
            self.outbox.outage(failure)

    # Composer calls this from `init` (rank 0): reopen the stored run or create one, if reachable.
    def _start_mlflow_run(self, state: State) -> None:
        self._run_id = None
        self.outbox.start(self._open_run)

    def _open_run(self) -> str:
        """Reopen the run `trackers.json` names, or create one; its id."""
        from mlflow.entities import RunStatus

        client = self._mlflow_client
        if self._experiment_id is None:
            found = client.get_experiment_by_name(self.experiment_name)
            self._experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment_name)
            )
        known = self.ids.get("mlflow_run_id")
        if known and not _run_exists(client, known):
            say(
                f"[mlflow] WARNING run {known} (from {self.ids.path}) is not on {self.tracking_uri}; starting a new run"
            )
            known = None
        if known:
            client.update_run(known, status=RunStatus.to_string(RunStatus.RUNNING))
            self._run_id = known
        else:
            run = client.create_run(self._experiment_id, run_name=self.run_name, tags=dict(self.tags))
            self._run_id = run.info.run_id
            self.ids.set("mlflow_run_id", self._run_id)
        return self._run_id

    # --- what Composer logs goes into the outbox ---------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        self._resumed_at = int(state.timestamp.batch) or None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if not self._enabled:
            return
        from mlflow.entities import Metric

        if step is not None and step == self._resumed_at:
            # Composer logs the time/* counters at the end of a fit and again before the next
            # batch: the stopped process sent them for this step already.
            metrics = {k: v for k, v in metrics.items() if not k.startswith("time/")}

        now = int(time.time() * 1000)
        points = []
        for key, value in metrics.items():
            try:
                number = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                points.append(Metric(_metric_key(key), number, now, step or 0))
        self.outbox.add_points(points)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if not self._enabled:
            return
        params = {}
        for key, value in param_texts(hyperparameters).items():
            if value != "None":
                params[_metric_key(key)] = value
        self.outbox.add_params(params)

    def log_table(self, columns, rows, name: str = "Table", step: int | None = None) -> None:
        pass  # samples reach MLflow as the samples.jsonl artifact (the record files, at the end)

    def log_images(self, *args, **kwargs) -> None:
        pass

    def close(self, state: State, logger: Logger) -> None:
        if stop_requested(state):
            self._final_status = "KILLED"  # preempted: the resumed run reopens it

    # --- the end ------------------------------------------------------------------------------

    def post_close(self) -> None:
        if not self._enabled or not self.outbox.running:
            return  # Composer may close twice (the trainer's close, then its atexit hook)
        if self.outbox.drain():
            self._upload_records()
            self._terminate()
        else:
            self.outbox.report_unsent()
        self.outbox.report_dropped()

    def _upload_records(self) -> None:
        for name in RECORD_FILES:
            path = self.record_dir / name
            if not path.is_file() or self._uploaded.get(name) == path.stat().st_mtime:
                continue
            try:
                self._mlflow_client.log_artifact(self._run_id, str(path))
                self._uploaded[name] = path.stat().st_mtime
            except Exception as err:
                say(
                    f"[mlflow] WARNING could not upload {name} as an artifact: {str(err).splitlines()[0][:200]}"
                )

    def _terminate(self) -> None:
        import sys

        status = "FAILED" if sys.exc_info()[0] not in (None, SystemExit) else self._final_status
        try:
            self._mlflow_client.set_terminated(self._run_id, status=status)
        except Exception as err:
            say(f"[mlflow] WARNING could not close the run: {str(err).splitlines()[0][:200]}")


def param_texts(config: dict[str, Any]) -> dict[str, str]:
    """A nested config as `section.key` -> text, the form tracker params take (lists as JSON)."""
    texts = {}
    for key, value in flatten(config).items():
        text = json.dumps(value, ensure_ascii=False) if isinstance(value, list) else str(value)
        texts[key] = text[:MAX_PARAM_CHARS]
    return texts


def _run_exists(client, run_id: str) -> bool:
    from mlflow.exceptions import RestException

    try:
        client.get_run(run_id)
    except RestException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def _metric_key(key: str) -> str:
    """MLflow accepts letters, digits, `_ - . / :` and spaces in names; anything else becomes `_`."""
    return re.sub(r"[^\w\-./: ]", "_", key, flags=re.ASCII)
