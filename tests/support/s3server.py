"""The suite's S3 servers on loopback: SeaweedFS for every S3 scenario, moto where a test needs it.

`S3Server` is the real object store of `scenarios/local_s3.py` (SeaweedFS's `weed server -s3`),
started once per pytest session and xdist worker by the `s3_server` fixture (tests/conftest.py).
It runs as its own process, so code under test, its worker processes and Composer's spawned
uploaders all reach it over HTTP exactly as they would reach AWS or MinIO.

`MotoServer` is moto's emulator in server mode, kept only for what SeaweedFS does not give: the
answers of AWS itself where the two differ (tests/README.md names each place). Tests start it
themselves (`moto_server` fixture in the file that needs it); no S3 scenario runs on it.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from scenarios.local_s3 import LocalS3, apply_env, free_port, restore_env

__all__ = ["S3Server", "MotoServer", "apply_env", "restore_env", "free_port"]

S3Server = LocalS3


@dataclass
class MotoServer:
    """A moto S3 server process (any keys accepted); `client()` talks to it."""

    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str | None]:
        return {
            "S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "moto",
            "AWS_SECRET_ACCESS_KEY": "moto",
        }

    def start(self, timeout: float = 60.0) -> MotoServer:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self.process.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint} within {timeout:.0f}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="moto",
            aws_secret_access_key="moto",
            region_name="us-east-1",
        )
