"""The MLflow tracker's outbox: metric points and params that wait while the server is away.

What Composer's `MLFlowLogger` lacks for long runs: it logs through MLflow's async queue, which
drops a batch whose request fails (mlflow/utils/async_logging/async_logging_queue.py,
`_log_run_data`: the error is logged, the batch is not retried). Here every metric and param the
tracker (llm/loggers/mlflow_tracker.py) is given goes into an `Outbox` that one background thread
sends with `MlflowClient.log_batch` every `flush_interval` seconds: while the server is away the
points wait (one warning line; training goes on), and they are sent when it answers again (one
line saying so). The same thread creates the run, or reopens it, when the server was down at
start. At the end (`drain`) what is left is sent within `close_timeout` seconds; if the server is
still away, `report_unsent` says how many points of which steps were not sent (metrics.jsonl has
them all), and if it answers but refuses (HTTP 401, 403, 404, 5xx: an expired token, a
permission, a deleted run), that answer, which such points wait on like an outage.

A request the server refuses (HTTP 400) is not an outage and is not retried as it was: it is sent
again in halves, down to single points, and a point refused alone is dropped and counted in one
line at the end. This matters after an outage: a request whose answer was lost (it timed out) may
have been stored, and MLflow 2.22's SQL store refuses the resend of such a batch when it holds
more than 100 points (`SqlAlchemyStore._log_metrics`, on a duplicate: for each slice of 100 points
it loads the stored history of that slice's keys only, then inserts every point of the whole batch
missing from it, so stored points of other keys hit the unique key again: IntegrityError, answered
as a 400). Retried as it was, the resend was refused until the end's `close_timeout` and the run
never caught up; its halves of up to 100 points are accepted.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm.config import MLflowConfig

_MAX_METRICS_PER_REQUEST = 1000  # MLflow's log_batch limits
_MAX_PARAMS_PER_REQUEST = 100
_MAX_WAITING_POINTS = 500_000  # ~0.2 GB; beyond this an unreachable server loses the oldest points


def say(message: str) -> None:
    """One line on the console (the trackers run on rank 0 only)."""
    print(message, flush=True)


class Outbox:
    """Points and params on their way to one MLflow run (module docstring).

    `client` is the tracker's `MlflowClient`, `tracking_uri` the server named in the lines,
    `metrics_file` the run's metrics.jsonl (named at the end: it has every step) and `params` the
    recipe's params to send. `start(open_run)` starts the sending thread; `open_run()` creates or
    reopens the run and returns its id (called again by the thread while the server is away).
    """

    def __init__(
        self,
        client: Any,
        tracking_uri: str,
        settings: MLflowConfig,
        metrics_file: Path,
        params: dict[str, str],
    ):
        self.client = client
        self.tracking_uri = tracking_uri
        self.settings = settings
        self.metrics_file = metrics_file
        self.run_id: str | None = None
        self._open_run: Callable[[], str] | None = None
        self._points: list[Any] = []  # mlflow Metric entities, in logging order
        # The first this-many points went out in a request that timed out: a frozen server may
        # have them, or store them when it resumes ("no answer", not "not sent"); the same for the
        # params in such a request.
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

    # --- what the tracker hands in -------------------------------------------------------------

    def add_points(self, points: list[Any]) -> None:
        with self._lock:
            self._points.extend(points)
            overflow = len(self._points) - _MAX_WAITING_POINTS
            self._unanswered = max(0, self._unanswered - max(0, overflow))
            if overflow > 0:
                del self._points[:overflow]
                self._lost += overflow

    def add_params(self, params: dict[str, str]) -> None:
        with self._lock:
            self._params.update(params)

    # --- the sending thread ----------------------------------------------------------------------

    def start(self, open_run: Callable[[], str]) -> None:
        """Open the run now if the server answers, then start the thread that sends."""
        self._open_run = open_run
        if self._down_since is None:
            try:
                self._connect()
            except Exception as err:
                self.outage(err)
        self._thread = threading.Thread(target=self._send_loop, name="llm-mlflow-outbox", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """The thread was started and `drain` has not run yet."""
        return self._thread is not None and not self._stop.is_set()

    def _connect(self) -> None:
        self.run_id = self._open_run()
        self._params.setdefault("mlflow_run_id", self.run_id)

    def _send_loop(self) -> None:
        while not self._stop.wait(self.settings.flush_interval):
            self._send_once()

    def _send_once(self) -> bool:
        """Try to send everything waiting; True when nothing waits afterwards."""
        sent = 0
        metrics: list = []
        params: list[tuple[str, str]] = []
        try:
            if self.run_id is None:
                self._connect()
            while True:
                with self._lock:
                    metrics = self._points[:_MAX_METRICS_PER_REQUEST]
                    params = [(k, v) for k, v in self._params.items() if self._sent_params.get(k) != v]
                    params = params[:_MAX_PARAMS_PER_REQUEST]
                if not metrics and not params:
                    break
                sent += len(metrics) - self._send(metrics, params)  # minus the points refused (dropped)
                with self._lock:
                    del self._points[: len(metrics)]
                    self._unanswered = max(0, self._unanswered - len(metrics))
                    self._sent_params.update(params)
                metrics, params = [], []
        except Exception as err:
            self._last_failure = err
            if _reason(err) == "timed out":  # the request went out; its answer did not come
                with self._lock:
                    self._unanswered = max(self._unanswered, len(metrics))
                    self._unanswered_params.update(params)
            self.outage(err)
            return False
        if self._down_since is not None:
            waited = time.monotonic() - self._down_since
            say(
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
            self.client.log_batch(
                self.run_id, metrics=metrics, params=[Param(k, v) for k, v in params], synchronous=True
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
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
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
                self.client.log_batch(self.run_id, params=[Param(key, value)], synchronous=True)
            except RestException as err:
                if not _refused(err):
                    raise
                refused.append(key)
        if refused:
            kept = ", ".join(refused)
            say(f"[mlflow] params kept at their first value (MLflow cannot change them): {kept}")

    def outage(self, err: Exception) -> None:
        """The server did not answer, or refused: one line at the start of an outage."""
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        reason, status = _reason(err), _http_status(err)
        problem = (
            f"cannot reach {self.tracking_uri} ({reason})"
            if status is None
            else f"{self.tracking_uri} refuses the requests (HTTP {status}: {reason})"
        )
        say(
            f"[mlflow] WARNING {problem}; training goes on, metrics wait and are sent when it "
            f"answers (retrying every {self.settings.flush_interval:g} s)"
        )

    # --- the end ---------------------------------------------------------------------------------

    def drain(self) -> bool:
        """Stop the thread and send what waits, within `close_timeout` s; True when all was sent."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + self.settings.close_timeout
        done = self._send_once()
        while not done and time.monotonic() < deadline:
            time.sleep(min(1.0, self.settings.flush_interval))
            done = self._send_once()
        return done

    def report_dropped(self) -> None:
        """One line each for points dropped while waiting and points the server refused."""
        if self._lost:
            say(f"[mlflow] WARNING {self._lost} points were dropped while the server was away (the oldest)")
        if self._refused:
            say(
                f"[mlflow] WARNING the server refused {len(self._refused)} metric points (steps "
                f"{min(self._refused)}-{max(self._refused)}): {self._refusal}; "
                f"{self.metrics_file} has them"
            )

    def report_unsent(self) -> None:
        """The line for a server still away (or refusing) at the end: what was not sent, and why."""
        with self._lock:
            no_answer = min(self._unanswered, len(self._points))  # the head of the points went out
            unanswered = [m.step for m in self._points[:no_answer]]
            steps = [m.step for m in self._points[no_answer:]]
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
        say(
            f"[mlflow] WARNING {self.tracking_uri} {failed}: {not_sent}{maybe}; "
            f"{self.metrics_file} has every logged step"
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
