"""Storage outages for the outage tests and `make soak-outage`: an S3 endpoint that goes away and
comes back, and a training run that must ride it out.

`Switch` is a TCP forwarder on loopback in front of the S3 server. `down()` closes its listener
and every open connection, so clients get "connection refused" exactly as from a killed server;
`up()` listens again on the same port. The server behind it keeps its objects (moto holds them in
memory, so killing moto itself would lose the bucket). `freeze()` keeps accepting connections and
reads requests but never answers (a hung server).

`outage_run` starts the resume harness's tiny training (scenarios/resume.py) with its shards and
checkpoints on S3 behind a Switch, takes the endpoint down at a given moment for a given time,
and returns the finished run with when the outage really began and ended.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scenarios import resume as rs

# Shards small enough that downloads are still in flight while training runs (about 2 samples a
# shard, 48 shards), fetched lazily: a few samples ahead, small shuffle blocks.
SHARD_BYTES = 200
LAZY = ["data.predownload=2", "data.shuffle_block_size=8"]


class Switch:
    """A forwarder to 127.0.0.1:`upstream_port` that can be taken down and brought back."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = 0
        self.frozen = False
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        self.frozen = False
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            open_now, self._open = self._open, []
        if listener is not None:
            _close(listener)
        for s in open_now:
            _close(s)

    def freeze(self) -> None:
        self.frozen = True

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    return
                self._open.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            while chunk := client.recv(65536):
                if self.frozen:
                    continue  # read and drop: the answer never comes
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    with self._lock:
                        self._open.append(upstream)
                    threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    _close(s)

    @staticmethod
    def _back(upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def upload_split(client, bucket: str, split: Path, prefix: str) -> str:
    """Copy a local split folder to s3://bucket/prefix; return that URL."""
    for path in sorted(split.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(split).as_posix()}")
    return f"s3://{bucket}/{prefix}"


@dataclass
class OutageRun:
    run: rs.Run
    down_at: float | None  # seconds after the process started that the endpoint went down
    down_for: float  # how long it stayed down
    phase: str  # what the run was doing when it went down
    down_wall: float = 0.0  # time.time() when it went down and when it came back (to compare with
    up_wall: float = 0.0  # the recorder's per-batch times)

    def batches_while_down(self) -> list[int]:
        return [b["batch"] for b in self.run.batches() if self.down_wall < b["time"] < self.up_wall]


def outage_run(
    folder: Path, switch: Switch, data_remote: str, save_folder: str, *, at_batch: int | None,
    delay: float, down_for: float, env: dict, tag: str = "outage", timeout: float = 600, overrides=(),
) -> OutageRun:  # fmt: skip
    """Train the harness recipe through `switch`; the endpoint goes down `delay` seconds after the
    run reached batch `at_batch` (None: after the process started) and comes back `down_for`
    seconds later. Returns the finished run (the caller checks rc and weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = rs.write_recipe(folder / "recipe.yaml", data_remote, save_folder, cache=folder / "cache")
    pause = () if at_batch is None else at_batch
    started = time.monotonic()
    proc, record, weights = rs.start(
        recipe,
        tag,
        cwd=folder,
        overrides=[*LAZY, *overrides],
        env={"S3_ENDPOINT_URL": switch.endpoint, **env},
        pause_at=pause,
    )
    try:
        if at_batch is not None:
            rs.wait_for_batch(record, at_batch, proc)
        time.sleep(delay)
        phase = _phase(record, at_batch)
        down_at, down_wall = time.monotonic() - started, time.time()
        switch.down()
        if at_batch is not None:
            rs.release(record, at_batch)
        time.sleep(down_for)
        up_wall = time.time()
        switch.up()
        result = rs.finish(proc, record, weights, started, timeout)
    finally:
        switch.up()
        rs.kill_group(proc)
    return OutageRun(result, down_at, down_for, phase, down_wall, up_wall)


def _phase(record: Path, at_batch: int | None) -> str:
    rows = record.read_text().splitlines() if record.exists() else []
    if not rows:
        return "start (before the first batch)"
    if at_batch is not None and at_batch % rs.SAVE_EVERY == 0:
        return f"the save at batch {at_batch}, with downloads ahead"
    return f"streaming, after batch {len(rows)}"
