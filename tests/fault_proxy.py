"""A TCP forwarder in front of the loopback S3 server that misbehaves on request.

Modes (switchable while clients are connected):
  "pass"   forward both ways;
  "error"  answer each request with `503 Slow Down` (S3's throttling reply) and close, `errors`
           times, then pass again;
  "slow"   hold each answer `delay` seconds, then forward it;
  "hang"   accept and read requests, never answer (a frozen server: the process is alive, its
           sockets are open, nothing comes back);
  "cut"    refuse: close the listener and every open connection (a network partition).
`requests` counts the requests that reached the proxy (the first chunk of each, per connection),
so a test can check how many attempts a client made.
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


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.mode = "pass"
        self.errors = 0
        self.delay = 0.0
        self.requests = 0
        self.open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    # --- control -------------------------------------------------------------------------------

    def set(self, mode: str, *, errors: int = 0, delay: float = 0.0) -> FaultProxy:
        with self._lock:
            self.mode, self.errors, self.delay, self.requests = mode, errors, delay, 0
        if mode == "cut":
            self.cut()
        return self

    def cut(self) -> None:
        self.mode = "cut"
        self.listener.close()
        for s in self.open:
            _close(s)

    # --- forwarding ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.open.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            while chunk := client.recv(65536):
                if self._starts_request(chunk):
                    with self._lock:
                        self.requests += 1
                        mode = self.mode
                        if mode == "error":
                            self.errors -= 1
                            if self.errors <= 0:
                                self.mode = "pass"
                    if mode == "error":
                        client.sendall(_503)
                        return
                    if mode == "hang":
                        while client.recv(65536):  # read and drop; the answer never comes
                            pass
                        return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    self.open.append(upstream)
                    threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    _close(s)

    def _back(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                if self.mode == "slow" and self.delay:
                    time.sleep(self.delay)
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)

    @staticmethod
    def _starts_request(chunk: bytes) -> bool:
        return chunk.split(b" ", 1)[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE")


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
