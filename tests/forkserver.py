"""Training processes without the interpreter's start-up: the suite's fork server.

A `python train.py ...` process spends most of a test's time importing torch, Composer, streaming
and what they pull in (about 8 CPU-seconds each on the 2-core CI machine, against a second or two
of training a tiny model), and the suite starts dozens of them. The server imports those
third-party libraries once; every training process a test asks for is then a fork of it that
runs the requested script as `__main__` with its own arguments, environment, working directory,
session and output files. It is a real process (its own pid and process group, signals, exit
code, atexit handlers, non-daemon threads joined at exit) running the real script and the real
Composer; only the third-party imports are shared. The server imports the project's training
modules too (that is how it finds what they import) but each process drops them from its module
table first, so it imports llm, storage, shards... fresh, as a new interpreter would (environment
read at import time, module state).

What it does not stand in for, and so is not used for: launchers (`composer -n 2`, multi-node),
`python -m ...`, pipes, a third-party module shadowed through PYTHONPATH (the server has the
real one loaded), and processes whose start-up time is what is measured (benchmarks start their
own processes; only tests/conftest.py hands this to the harness).

`popen(cmd, cwd=, env=, stdout=, stderr=)` returns an object with Popen's pid, poll, wait,
returncode, send_signal, terminate and kill; it falls back to `subprocess.Popen` for anything it
does not serve. The server starts on first use (tests/conftest.py stops it at the end).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = {"llm", "convert", "shards", "storage", "scenarios", "bench", "tests", "train"}
# What a training process imports: the server loads the third-party modules of this closure.
CLOSURE = [
    "llm.trainer",
    "llm.checkpoint.plan",
    "llm.data",
    "llm.callbacks",
    "llm.weights.read",
    "llm.trackers",
]


# --- the server -------------------------------------------------------------------------------


def _project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT


def serve(path: str) -> None:
    for name in CLOSURE:  # the project's modules are dropped again in each child (_child)
        importlib.import_module(name)
    base_path = [p for p in sys.path[1:] if p and Path(p).resolve() != REPO]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _monitor(conn, base_path)  # never returns
        conn.close()


def _monitor(conn: socket.socket, base_path: list[str]) -> None:
    """Fork the requested process, tell the client its pid, wait for it, tell its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(msg.decode())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, fds, base_path)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    try:
        conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
    finally:
        os._exit(0)


def _child(request: dict, fds: list[int], base_path: list[str]) -> None:
    import io
    import random
    import runpy
    import traceback

    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name in [m for m in sys.modules if _project_module(m)]:
        del sys.modules[name]  # imported fresh, as by a new interpreter
    script = str(Path(request["argv"][1]).resolve())
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(script).parent), *extra, *base_path]
    sys.argv = request["argv"][1:]
    random.seed()  # a new interpreter seeds from the OS, not from its parent's state
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter's own top-level handler
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


# --- the client -------------------------------------------------------------------------------


class ForkedProcess:
    """A process forked by the server, handled like a `subprocess.Popen`."""

    def __init__(self, args: list[str], conn: socket.socket):
        self.args = args
        self._conn = conn
        self._buffer = b""
        self.returncode: int | None = None
        self.pid = int(self._message(timeout=60)["pid"])

    def _message(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()  # not select.select: a long session's descriptors pass 1024
        poller.register(self._conn, select.POLLIN)
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poller.poll(None if left is None else left * 1000):
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError("the fork server's monitor went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(timeout=0)["returncode"])
            except subprocess.TimeoutExpired:
                return None
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._message(timeout=timeout)["returncode"])
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="llm-forkserver-")
        self.path = os.path.join(self.folder, "socket")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log = open(os.path.join(self.folder, "server.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", self.path], env=env, stdout=subprocess.PIPE, stderr=self.log,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(
                    f"the fork server did not start: {Path(self.log.name).read_text()[-2000:]}"
                )
            self.ready = True

    def spawn(self, args: list[str], cwd, env: dict, stdout, stderr) -> ForkedProcess:
        self.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        opened: list[int] = []
        fds = [_fd(subprocess.DEVNULL, opened, "r"), _fd(stdout, opened), _fd(stderr, opened, stdout=stdout)]
        try:
            request = {"argv": args, "cwd": str(cwd or os.getcwd()), "env": dict(env)}
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
        finally:
            for fd in opened:
                os.close(fd)
        return ForkedProcess(args, conn)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _fd(stream, opened: list[int], mode: str = "w", stdout=None) -> int:
    """The file descriptor a Popen-style stdin/stdout/stderr argument names."""
    if stream is subprocess.STDOUT:
        return _fd(stdout, opened)
    if stream is subprocess.DEVNULL:
        opened.append(os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY))
        return opened[-1]
    if stream is None:
        return 1 if mode == "w" else 0
    if stream is subprocess.PIPE:
        raise ValueError("the fork server does not serve pipes")
    return stream if isinstance(stream, int) else stream.fileno()


_server: _Server | None = None
_lock = threading.Lock()


def _served(args: list[str], env: dict | None) -> bool:
    return (
        len(args) >= 2
        and args[0] == sys.executable
        and args[1].endswith(".py")
        and os.environ.get("LLM_TEST_NO_FORKSERVER") != "1"
    )


def popen(args, *, cwd=None, env=None, stdout=None, stderr=None, **kwargs):
    """`subprocess.Popen(args, ...)`, served by a fork of the server where it can be."""
    args = [str(a) for a in args]
    if not _served(args, env) or set(kwargs) - {"start_new_session"} or subprocess.PIPE in (stdout, stderr):
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, **kwargs)
    return start().spawn(args, cwd, env if env is not None else os.environ, stdout, stderr)


def start() -> _Server:
    """Start the server (in the background: it is waited for at the first process it serves)."""
    global _server
    with _lock:
        if _server is None:
            _server = _Server()
        return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
