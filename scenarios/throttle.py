"""A TCP forwarder that caps bandwidth: what a node's link to S3 looks like, on loopback.

    throttle = Throttle(upstream_port, rate=25e6)   # 25 MB/s each way, all connections together
    env = {"S3_ENDPOINT_URL": throttle.endpoint}

Each direction has one token bucket shared by every connection, so parallel uploads share the cap
as the streams of one node share its network interface. Used by `make bench-checkpoint` (the
test suite's `tests/fault_proxy.py` injects faults and delays single answers, but has no
bandwidth cap, and benchmarks do not import the tests).
"""

from __future__ import annotations

import socket
import threading
import time


class _Bucket:
    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def take(self, size: int) -> None:
        """Block until `size` bytes fit under the rate (pacing: the time the link would take)."""
        with self.lock:
            now = time.monotonic()
            start = max(now, self.free_at)
            self.free_at = start + size / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


class Throttle:
    """Forward 127.0.0.1:<port> to 127.0.0.1:<upstream_port> at most `rate` bytes/s each way."""

    CHUNK = 1 << 16

    def __init__(self, upstream_port: int, rate: float):
        self.upstream = ("127.0.0.1", upstream_port)
        self.rate = rate
        self.up, self.down = _Bucket(rate), _Bucket(rate)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            for src, dst, bucket in ((client, upstream, self.up), (upstream, client, self.down)):
                threading.Thread(target=self._pump, args=(src, dst, bucket), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: _Bucket) -> None:
        try:
            while data := src.recv(self.CHUNK):
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
