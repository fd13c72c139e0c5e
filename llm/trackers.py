"""Experiment trackers: MLflow, Weights & Biases and TensorBoard, through Composer's loggers.

`check_extras(cfg)` runs before any work: a tracker the recipe turns on whose package is missing is
one line naming the extra to install (`pip install 'llm-pretrain[mlflow]'`). `build_trackers`
returns the Composer logger destinations:

- TensorBoard: Composer's `TensorboardLogger`, writing to `<run_dir>/tensorboard`.
- W&B: Composer's `WandBLogger` (`WandBTracker` adds the run's record files at the end). The run
  id is made at the first start and kept in `<run_dir>/trackers.json`, which travels with the
  checkpoints (llm/run_dir.py): a resumed run, even on an empty machine, continues the
  same W&B run (`resume="allow"`). `mode: offline` writes the run under `<dir>/wandb/` for a later
  `wandb sync`; W&B's own service buffers and retries when its server is away.
- MLflow: `MLflowTracker`, a Composer `MLFlowLogger` whose sending is replaced. What Composer's
  logger lacks for long runs: it reaches the server in its constructor and raises when the server
  is down (training would not start), and it logs through MLflow's async queue, which drops a
  batch whose request fails (mlflow/utils/async_logging/async_logging_queue.py, `_log_run_data`:
  the error is logged, the batch is not retried). Here every metric and param goes into an outbox
  that one background thread sends with `MlflowClient.log_batch` every `flush_interval` seconds:
  while the server is away the points wait (one warning line; training goes on), and they are sent
  when it answers again (one line saying so). The run is created, or reopened by the id in
  `trackers.json` on a resume, by the same thread, so a server that is down at start is caught up
  too. At the end the thread sends what is left within `close_timeout` seconds, uploads the record
  files (loss plot, samples, metrics, config, task results) as artifacts and closes the run
  (FINISHED, KILLED when the run stopped on a signal, FAILED on an error); if the server is still
  away it says how many points of which steps were not sent (metrics.jsonl has them all), and if it
  answers but refuses (HTTP 401, 403, 404, 5xx: an expired token, a permission, a deleted run),
  that answer, which such points wait on like an outage.
  A request the server refuses (HTTP 400) is not an outage and is not retried as it was: it is
  sent again in halves, down to single points, and a point refused alone is dropped and counted
  in one line at the end. This matters after an outage: a request whose answer was lost (it timed
  out) may have been stored, and MLflow 2.22's SQL store refuses the resend of such a batch when it
  holds more than 100 points (`SqlAlchemyStore._log_metrics`, on a duplicate: for each slice of
  100 points it loads the stored history of that slice's keys only, then inserts every point of
  the whole batch missing from it, so stored points of other keys hit the unique key again:
  IntegrityError, answered as a 400). Retried as it was, the resend was refused until the end's
  `close_timeout` and the run never caught up; its halves of up to 100 points are accepted.

A resumed run sends steps after its checkpoint only, so a run stopped by SIGTERM and resumed has
each step once in the tracker. After a SIGKILL the steps between the last checkpoint and the kill
were sent by the killed process and are sent again by the resumed one (MLflow keeps both values
of such a step; metrics.jsonl is cut back and holds one).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination, MLFlowLogger, TensorboardLogger, WandBLogger
from composer.utils import dist

from llm.checkpoint.preemption import stop_requested
from llm.config import MLflowConfig, TrainConfig, WandBConfig
from llm.errors import ConfigError
from llm.run_dir import METRICS, RECORD_FILES, TRACKERS
from storage import atomic_write_text

IDS_FILE = TRACKERS  # {"mlflow_run_id": ..., "wandb_run_id": ...} in run_dir
# recipe key -> (module to import, extra of this project that installs it)
_EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
_MAX_METRICS_PER_REQUEST = 1000  # MLflow's log_batch limits
_MAX_PARAMS_PER_REQUEST = 100
_MAX_PARAM_CHARS = 6000
_MAX_WAITING_POINTS = 500_000  # ~0.2 GB; beyond this an unreachable server loses the oldest points


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
                f"install the extra: pip install 'llm-pretrain[{extra}]' (or set {switch})"
            ) from None


def build_trackers(cfg: TrainConfig, run_dir: Path) -> list[LoggerDestination]:
    """Composer logger destinations for the trackers the recipe turns on (check_extras first)."""
    check_extras(cfg)
    ids = TrackerIds(run_dir / IDS_FILE)
    params = flatten(cfg.to_dict(redact=True))
    out: list[LoggerDestination] = []
    if cfg.loggers.tensorboard:
        out.append(TensorboardLogger(log_dir=str(run_dir / "tensorboard")))
    if cfg.loggers.mlflow.enabled:
        out.append(MLflowTracker(cfg.loggers.mlflow, cfg.run_name, run_dir, ids, params))
    if cfg.loggers.wandb.enabled:
        out.append(wandb_tracker(cfg.loggers.wandb, cfg.run_name, run_dir, ids, cfg.to_dict(redact=True)))
    return out


# --- run ids that survive a resume -------------------------------------------------------------


class TrackerIds:
    """`<run_dir>/trackers.json`: each tracker's run id, written by rank 0 as soon as it is known."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        try:
            value = json.loads(self.path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and value else None

    def set(self, key: str, value: str) -> None:
        if dist.get_global_rank() != 0:
            return
        with self._lock:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            data = data if isinstance(data, dict) else {}
            data[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as `section.key` -> string, the form tracker params take."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, list | tuple) else str(value)
    return {prefix.rstrip("."): text[:_MAX_PARAM_CHARS]}


def _say(message: str) -> None:
    """One line on the console (the trackers run on rank 0 only)."""
    print(message, flush=True)


# --- W&B ---------------------------------------------------------------------------------------


class WandBTracker(WandBLogger):
    """Composer's WandBLogger, plus the run's record files saved with the W&B run at the end."""

    def __init__(self, run_dir: Path, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = run_dir

    def post_close(self) -> None:
        if self._enabled:
            import wandb

            if wandb.run is not None and not self._is_in_atexit:
                for name in RECORD_FILES:
                    if (self.record_dir / name).is_file():
                        wandb.save(str(self.record_dir / name), base_path=str(self.record_dir), policy="now")
        super().post_close()


def wandb_tracker(
    settings: WandBConfig, run_name: str, run_dir: Path, ids: TrackerIds, config: dict
) -> WandBTracker:
    run_id = ids.get("wandb_run_id") or uuid.uuid4().hex[:12]
    ids.set("wandb_run_id", run_id)
    init_kwargs: dict[str, Any] = {"id": run_id, "resume": "allow", "config": config}
    # Offline, W&B 0.18 asks the server's version before logging a table (the samples) unless
    # this is off: with no server it retries for minutes. Online runs never read the setting.
    init_kwargs["settings"] = {"allow_offline_artifacts": False}
    init_kwargs["dir"] = str(Path(settings.dir or run_dir))
    Path(init_kwargs["dir"]).mkdir(parents=True, exist_ok=True)
    if settings.mode:
        init_kwargs["mode"] = settings.mode
    return WandBTracker(
        run_dir,
        project=settings.project,
        entity=settings.entity,
        name=settings.name or run_name,
        tags=list(settings.tags) or None,
        init_kwargs=init_kwargs,
    )


# --- MLflow ------------------------------------------------------------------------------------


class MLflowTracker(MLFlowLogger):
    """Composer's MLFlowLogger with an outbox that outlives server outages (module docstring)."""

    def __init__(self, settings: MLflowConfig, run_name: str, run_dir: Path, ids: TrackerIds, params: dict):
        # One attempt per request and a bounded wait: the outbox retries, not the HTTP layer.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.settings = settings
        self.record_dir = run_dir
        self.ids = ids
        self._outbox: list[Any] = []  # mlflow Metric entities, in logging order
        # The first this-many outbox points went out in a request that timed out: a frozen server
        # may have them, or store them when it resumes ("no answer", not "not sent"); the same for
        # the params in such a request.
        self._unanswered = 0
        self._params: dict[str, str] = dict(params)
        self._sent_params: dict[str, str] = {}
        self._unanswered_params: dict[str, str] = {}  # params (with the value) in such a request
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time of the first failure of an outage
        self._last_failure: Exception | None = None  # the latest failed send's error (the end names it)
        self._lost = 0  # points dropped past _MAX_WAITING_POINTS
        self._refused: list[int] = []  # steps of the points the server refused alone (dropped)
        self._refusal = ""  # the server's reason for the first of them
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
        except Exception as err:  # the server is down: the outbox thread creates the run later
            self._experiment_id = None
            self._outage(err)

    # Composer calls this from `init` (rank 0): reopen the stored run or create one, if reachable.
    def _start_mlflow_run(self, state: State) -> None:
        self._run_id = None
        if self._down_since is None:
            try:
                self._connect()
            except Exception as err:
                self._outage(err)
        self._thread = threading.Thread(target=self._send_loop, name="llm-mlflow-outbox", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        from mlflow.entities import RunStatus

        client = self._mlflow_client
        if self._experiment_id is None:
            found = client.get_experiment_by_name(self.experiment_name)
            self._experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment_name)
            )
        known = self.ids.get("mlflow_run_id")
        if known and not _run_exists(client, known):
            _say(
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
        self._params.setdefault("mlflow_run_id", self._run_id)

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
        with self._lock:
            self._outbox.extend(points)
            overflow = len(self._outbox) - _MAX_WAITING_POINTS
            self._unanswered = max(0, self._unanswered - max(0, overflow))
            if overflow > 0:
                del self._outbox[:overflow]
                self._lost += overflow

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if not self._enabled:
            return
        with self._lock:
            for key, value in flatten(hyperparameters).items():
                if value != "None":
                    self._params[_metric_key(key)] = value

    def log_table(self, columns, rows, name: str = "Table", step: int | None = None) -> None:
        pass  # samples reach MLflow as the samples.jsonl artifact (the record files, at the end)

    def log_images(self, *args, **kwargs) -> None:
        pass

    def close(self, state: State, logger: Logger) -> None:
        if stop_requested(state):
            self._final_status = "KILLED"  # preempted: the resumed run reopens it

    # --- the outbox thread -------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not self._stop.wait(self.settings.flush_interval):
            self._send_once()

    def _send_once(self) -> bool:
        """Try to send everything waiting; True when the outbox is empty afterwards."""
        sent = 0
        metrics: list = []
        params: list[tuple[str, str]] = []
        try:
            if self._run_id is None:
                self._connect()
            while True:
                with self._lock:
                    metrics = self._outbox[:_MAX_METRICS_PER_REQUEST]
                    params = [(k, v) for k, v in self._params.items() if self._sent_params.get(k) != v]
                    params = params[:_MAX_PARAMS_PER_REQUEST]
                if not metrics and not params:
                    break
                sent += len(metrics) - self._send(metrics, params)  # minus the points refused (dropped)
                with self._lock:
                    del self._outbox[: len(metrics)]
                    self._unanswered = max(0, self._unanswered - len(metrics))
                    self._sent_params.update(params)
                metrics, params = [], []
        except Exception as err:
            self._last_failure = err
            if _reason(err) == "timed out":  # the request went out; its answer did not come
                with self._lock:
                    self._unanswered = max(self._unanswered, len(metrics))
                    self._unanswered_params.update(params)
            self._outage(err)
            return False
        if self._down_since is not None:
            waited = time.monotonic() - self._down_since
            _say(
                f"[mlflow] {self.tracking_uri} answers again after {waited:.0f} s: the {sent} metric "
                "points that waited were sent (caught up)"
            )
            self._down_since = None
        return True

    def _send(self, metrics: list, params: list[tuple[str, str]]) -> int:
        """One request; if the server refuses it, find what it refuses. Returns the points refused."""
        from mlflow.entities import Param
        from mlflow.exceptions import RestException

        try:
            self._mlflow_client.log_batch(
                self._run_id, metrics=metrics, params=[Param(k, v) for k, v in params], synchronous=True
            )
            return 0
        except RestException as err:
            if not _refused(err):
                raise
        refused = len(self._refused)
        self._send_metrics(metrics)
        self._send_params(params)
        return len(self._refused) - refused

    def _send_metrics(self, metrics: list) -> None:
        """Send `metrics`, in halves while the server refuses them; a point refused alone is dropped."""
        from mlflow.exceptions import RestException

        if not metrics:
            return
        try:
            self._mlflow_client.log_batch(self._run_id, metrics=metrics, synchronous=True)
            return
        except RestException as err:
            if not _refused(err):
                raise
            if len(metrics) == 1:
                self._refusal = self._refusal or str(err).splitlines()[0][:200]
                self._refused.append(metrics[0].step)
                return
        half = len(metrics) // 2
        self._send_metrics(metrics[:half])
        self._send_metrics(metrics[half:])

    def _send_params(self, params: list[tuple[str, str]]) -> None:
        """Params one by one: MLflow keeps a param's first value and refuses to change it (a resumed
        run's new max_duration)."""
        from mlflow.entities import Param
        from mlflow.exceptions import RestException

        refused = []
        for key, value in params:
            try:
                self._mlflow_client.log_batch(self._run_id, params=[Param(key, value)], synchronous=True)
            except RestException as err:
                if not _refused(err):
                    raise
                refused.append(key)
        if refused:
            kept = ", ".join(refused)
            _say(f"[mlflow] params kept at their first value (MLflow cannot change them): {kept}")

    def _outage(self, err: Exception) -> None:
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        reason, status = _reason(err), _http_status(err)
        problem = (
            f"cannot reach {self.tracking_uri} ({reason})"
            if status is None
            else f"{self.tracking_uri} refuses the requests (HTTP {status}: {reason})"
        )
        _say(
            f"[mlflow] WARNING {problem}; training goes on, metrics wait and are sent when it "
            f"answers (retrying every {self.settings.flush_interval:g} s)"
        )

    # --- the end ------------------------------------------------------------------------------

    def post_close(self) -> None:
        if not self._enabled or self._thread is None or self._stop.is_set():
            return  # Composer may close twice (the trainer's close, then its atexit hook)
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + self.settings.close_timeout
        done = self._send_once()
        while not done and time.monotonic() < deadline:
            time.sleep(min(1.0, self.settings.flush_interval))
            done = self._send_once()
        if done:
            self._upload_records()
            self._terminate()
        else:
            self._report_unsent()
        if self._lost:
            _say(f"[mlflow] WARNING {self._lost} points were dropped while the server was away (the oldest)")
        if self._refused:
            _say(
                f"[mlflow] WARNING the server refused {len(self._refused)} metric points (steps "
                f"{min(self._refused)}-{max(self._refused)}): {self._refusal}; "
                f"{self.record_dir / METRICS} has them"
            )

    def _upload_records(self) -> None:
        for name in RECORD_FILES:
            path = self.record_dir / name
            if not path.is_file() or self._uploaded.get(name) == path.stat().st_mtime:
                continue
            try:
                self._mlflow_client.log_artifact(self._run_id, str(path))
                self._uploaded[name] = path.stat().st_mtime
            except Exception as err:
                _say(
                    f"[mlflow] WARNING could not upload {name} as an artifact: {str(err).splitlines()[0][:200]}"
                )

    def _terminate(self) -> None:
        import sys

        status = "FAILED" if sys.exc_info()[0] not in (None, SystemExit) else self._final_status
        try:
            self._mlflow_client.set_terminated(self._run_id, status=status)
        except Exception as err:
            _say(f"[mlflow] WARNING could not close the run: {str(err).splitlines()[0][:200]}")

    def _report_unsent(self) -> None:
        with self._lock:
            no_answer = min(self._unanswered, len(self._outbox))  # the head of the outbox went out
            unanswered = [m.step for m in self._outbox[:no_answer]]
            steps = [m.step for m in self._outbox[no_answer:]]
            pending = [(k, v) for k, v in self._params.items() if self._sent_params.get(k) != v]
            params = sum(1 for k, v in pending if self._unanswered_params.get(k) != v)
            params_no_answer = len(pending) - params

        def span(points: list[int]) -> str:
            return f" (steps {min(points)}-{max(points)})" if points else ""

        if steps or params:
            not_sent = (
                f"{len(steps)} metric points{span(steps)} and {params} params were not sent, nor the "
                "record files"
            )
        else:
            not_sent = "the record files were not sent"
        maybe = (
            f"; {len(unanswered)} metric points{span(unanswered)} and {params_no_answer} params were sent "
            "but got no answer (the server may have them, or store them when it resumes)"
            if unanswered or params_no_answer
            else ""
        )
        status = _http_status(self._last_failure)
        if status is None:
            failed = f"did not answer within {self.settings.close_timeout:g} s at the end"
        else:  # it answers, but refuses (a token that expired, a permission, a run deleted...)
            reason = _reason(self._last_failure)
            failed = (
                f"refused the requests until {self.settings.close_timeout:g} s after the end "
                f"(HTTP {status}: {reason})"
            )
        _say(
            f"[mlflow] WARNING {self.tracking_uri} {failed}: {not_sent}{maybe}; "
            f"{self.record_dir / METRICS} has every logged step"
        )


def _reason(err: Exception) -> str:
    """A connection failure in a few words (MLflow's message repeats the URL and urllib3's chain)."""
    text = str(err)
    for marker, short in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
        ("Max retries exceeded", "no connection"),
    ):
        if marker in text:
            return short
    return text.splitlines()[0][:160] if text else type(err).__name__


def _http_status(err: Exception | None) -> int | None:
    """The HTTP status the server answered with, or None when no answer came (refused connection,
    timeout). MLflow raises RestException for its own JSON errors and MlflowException naming the
    code for other answers (a proxy's 403 page)."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(err, RestException):
        return err.get_http_status_code()
    if isinstance(err, MlflowException):
        # "failed with error code 403 != 200"; a 5xx, which the HTTP layer may retry, ends in
        # urllib3's "too many 503 error responses".
        found = re.search(r"failed with error code (\d{3}) != 200|too many (\d{3}) error responses", str(err))
        return int(found[1] or found[2]) if found else None
    return None


def _refused(err: Exception) -> bool:
    """The server answered and refused the request (HTTP 400): sending it again as it is will not
    help. Other answers (401, 403, 404, 5xx) may pass: the points wait."""
    return err.get_http_status_code() == 400


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
