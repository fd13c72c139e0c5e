"""A real MLflow tracking server on loopback (SQLite backend, local artifact folder) for the tests.

`mlflow server` runs as its own process group (gunicorn and its workers), so a test can stop it
mid-run and start it again on the same port and database, as an outage and a recovery would look.
Artifacts are served by the server (`--serve-artifacts`): clients upload over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.s3server import free_port


class MLflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> MLflowServer:
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"), "--serve-artifacts", "--workers", "1",
        ]  # fmt: skip
        log = open(self.root / "server.log", "a")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.uri + "/health", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    def runs(self, experiment: str) -> list:
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        return [] if found is None else client.search_runs([found.experiment_id])

    def steps(self, run_id: str, key: str) -> list[int]:
        """The steps of a metric's history, in step order (each logged value once)."""
        return sorted(m.step for m in self.client().get_metric_history(run_id, key))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One MLflow server for the session; each test uses its own experiment name."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    try:
        yield server
    finally:
        server.stop()


def wandb_history(wandb_dir: Path, run_id: str) -> list[dict]:
    """The history rows (`_step` and the logged keys) of every offline W&B run file with `run_id`."""
    import json

    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    rows = []
    for path in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
                )
    return rows
