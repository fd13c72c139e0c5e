"""A TCP forwarder on loopback in front of the S3 server, which misbehaves on request: the one
proxy of the storage-fault tests, the outage scenarios and the checkpoint benchmark.

    proxy = Proxy(s3_port)                 # env: {"S3_ENDPOINT_URL": proxy.endpoint}
    proxy = Proxy(s3_port, rate=25e6)      # at most 25 MB/s each way, all connections together

Modes, switchable while clients are connected (`set`):
  "pass"   forward both ways;
  "error"  answer each request with `503 Slow Down` (S3's throttling reply) and close, `errors`
           times, then pass again (`status=`: another answer, e.g. 403, with a plain-text body;
           `methods=("PUT",)`: only requests of those methods, the others pass: writes refused
           while reads succeed; `paths=("/bkt/ckpt/",)`: only requests whose path starts with one
           of those: checkpoint uploads refused while other writes succeed);
  "slow"   hold each answer chunk `delay` seconds, then forward it;
  "hang"   accept and read requests, never answer (a frozen server: the process is alive, its
           sockets are open, nothing comes back); a connection that hung stays hung.
`down()` closes the listener and every open connection, so clients get "connection refused" as
from a killed server (a network partition); `up()` listens again on the same port. The server
behind keeps running and keeps its objects (one server serves a whole test session).
`requests` counts the requests that reached the proxy since the last `set` (the first chunk of
each), so a test can check how many attempts a client made.

With `rate`, each direction has one token bucket shared by every connection, so parallel uploads
share the cap as the streams of one node share its network interface.
"""

from __future__ import annotations

import socket
import threading
import time

_503 = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: 103\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>SlowDown</Code><Message>busy</Message></Error>\n"
)


def _answer(status: int) -> bytes:
    body = f"answered {status} by the test proxy\n".encode()
    head = f"HTTP/1.1 {status} Proxy Answer\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


_METHODS = (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE")
CHUNK = 1 << 16


class _Bucket:
    """A byte rate shared by every connection in one direction (pacing: the time the link takes)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def take(self, size: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.free_at)
            self.free_at = start + size / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


class Proxy:
    """Forward 127.0.0.1:<port> to 127.0.0.1:`upstream_port`, with the faults set on it."""

    def __init__(self, upstream_port: int, *, rate: float | None = None):
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = "pass"
        self.errors = 0
        self.delay = 0.0
        self.requests = 0
        self.methods: frozenset[bytes] = frozenset()  # "error" only for these methods (empty: all)
        self.paths: tuple[bytes, ...] = ()  # "error" only for paths starting with one of these (empty: all)
        self.port = 0
        self._buckets = (_Bucket(rate), _Bucket(rate)) if rate else (None, None)
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    # --- control -------------------------------------------------------------------------------

    def set(
        self,
        mode: str,
        *,
        errors: int = 0,
        delay: float = 0.0,
        status: int = 503,
        methods: tuple = (),
        paths: tuple = (),
    ) -> Proxy:
        if mode not in ("pass", "error", "slow", "hang"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        with self._lock:
            self.mode, self.errors, self.delay, self.requests = mode, errors, delay, 0
            self.answer = _503 if status == 503 else _answer(status)
            self.methods = frozenset(m.encode() for m in methods)
            self.paths = tuple(p.encode() for p in paths)
        return self

    def freeze(self) -> None:
        self.set("hang")

    def up(self) -> None:
        """Listen (again, on the same port) and forward."""
        self.set("pass")
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
        """Refuse: close the listener and every open connection."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_now, self._open = self._open, []
        for s in [listener, *open_now] if listener is not None else open_now:
            _close(s)

    cut = down
    close = down

    # --- forwarding ----------------------------------------------------------------------------

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
        mode = "pass"  # what this connection does with the request it is carrying
        try:
            while chunk := client.recv(CHUNK):
                with self._lock:
                    method, _, rest = chunk.partition(b" ")
                    if method in _METHODS:  # a new request: the mode now applies to it
                        self.requests += 1
                        mode = self.mode
                        spared = (self.methods and method not in self.methods) or (
                            self.paths and not rest.startswith(self.paths)
                        )
                        if mode == "error" and spared:
                            mode = "pass"
                        elif mode == "error":
                            self.errors -= 1
                            if self.errors <= 0:
                                self.mode = "pass"
                    elif self.mode == "hang" or (self.mode == "error" and not (self.methods or self.paths)):
                        mode = self.mode  # a request's body: cut as it goes, as before
                if mode == "error":
                    client.sendall(self.answer)
                    return
                if mode == "hang":
                    while client.recv(CHUNK):  # read and drop; the answer never comes
                        pass
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    with self._lock:
                        self._open.append(upstream)
                    threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
                self._pace(0, len(chunk))
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    _close(s)

    def _back(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(CHUNK):
                if self.mode == "slow" and self.delay:
                    time.sleep(self.delay)
                self._pace(1, len(data))
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)

    def _pace(self, direction: int, size: int) -> None:
        bucket = self._buckets[direction]
        if bucket is not None:
            bucket.take(size)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
