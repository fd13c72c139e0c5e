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

Besides `python script.py ...` it serves `python -m <project module> ...` and the `composer`
launcher (`composer -n 2 script.py ...`, alone or under scenarios.resume.PRIVATE_SHM, which puts a
"node" in its own /dev/shm). The launcher is the real one, run in a served process; only its
`subprocess.Popen` of a rank (`python script.py ...`) becomes a fork of the launcher's own process,
which then runs the rank as a served process does. So a rank is the launcher's child, in its
process group, mount namespace and environment, with the descriptors the launcher gave it, and the
launcher monitors, signals and reaps it as it would a Popen.

What it does not stand in for, and so is not used for: `python -c`, pipes and stdin input, a
third-party module shadowed through PYTHONPATH (the server has the real one loaded), environment
variables that act only when a process starts (MALLOC_*, LD_*), and processes whose start-up time
or import cost is what is measured (benchmarks start their own processes; only tests/conftest.py
hands this to the harness).

`popen(cmd, cwd=, env=, stdout=, stderr=)` returns an object with Popen's pid, poll, wait,
returncode, send_signal, terminate and kill; `run(cmd, ...)` is `subprocess.run` with
`capture_output` through files. Both fall back to `subprocess` for anything not served. The
server starts on first use (tests/conftest.py stops it at the end).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import logging
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
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = {"llm", "convert", "shards", "storage", "scenarios", "bench", "tests", "train"}
COMPOSER = str(Path(sys.executable).with_name("composer"))
# What the served processes import (training, the launcher, the converter, the commands): the
# server loads the third-party modules of this closure.
CLOSURE = [
    "llm.trainer",
    "llm.checkpoint.plan",
    "llm.data",
    "llm.callbacks",
    "llm.weights.read",
    "llm.loggers",
    "llm.commands",
    "convert.cli",
    "convert.run.conversion",
    "composer.cli.launcher",
]


# --- the server -------------------------------------------------------------------------------


def _project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT


def serve(path: str) -> None:
    for name in CLOSURE:  # the project's modules are dropped again in each child (_run)
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

    os.setsid()
    try:
        if request["private_shm"]:
            _private_shm()
    except OSError as err:  # reported as the process's own failure, like unshare(1) would
        os.write(fds[2], f"{err}\n".encode())
        os._exit(1)
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
    tempfile.tempdir = None  # TMPDIR read again, as a new interpreter would
    if request["kind"] == "launcher":
        _serve_ranks(base_path)
    _run(request["kind"], request["argv"], base_path)


def _private_shm() -> None:
    """This process in a new mount namespace with a fresh tmpfs on /dev/shm (PRIVATE_SHM's work)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    for call, args in (
        (libc.unshare, (clone_newns,)),
        (libc.mount, (b"none", b"/", None, ms_rec | ms_private, None)),  # stop propagation to the host
        (libc.mount, (b"tmpfs", b"/dev/shm", b"tmpfs", 0, None)),
    ):
        if call(*args) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"private /dev/shm: {call.__name__} failed: {os.strerror(errno)}")


def _run(kind: str, argv: list[str], base_path: list[str]) -> None:
    """Run `argv` (a script and its arguments, or a module's name and its arguments) as `__main__`
    with fresh project modules, then exit as the interpreter would."""
    import random
    import runpy
    import traceback

    for name in [m for m in sys.modules if _project_module(m)]:
        del sys.modules[name]  # imported fresh, as by a new interpreter
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if kind == "module":
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        sys.argv = [argv[0], *argv[1:]]  # runpy puts the module's file in argv[0]
    else:
        script = str(Path(argv[0]).resolve())
        sys.path[:] = [str(Path(script).parent), *extra, *base_path]
        sys.argv = list(argv)
    random.seed()  # a new interpreter seeds from the OS, not from its parent's state
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    code = 0
    try:
        if kind == "module":
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
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


# --- a launcher whose ranks are forks of itself -------------------------------------------------


class _Rank:
    """A rank forked by a served launcher, handled by the launcher like its `subprocess.Popen`."""

    def __init__(self, args: list[str], pid: int):
        self.args, self.pid = args, pid
        self.returncode: int | None = None
        self.stdout = self.stderr = None  # the launcher sets the files it gave the rank

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve_ranks(base_path: list[str]) -> None:
    """Prepare this process to run the `composer` launcher: its signal handling as in a new
    `composer` process, and each rank it starts (`python script.py ...`) forked from here."""
    from composer.core import engine

    real_popen = subprocess.Popen
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    finalizers = set(weakref.finalize._registry)  # type: ignore[attr-defined]
    log_handlers, log_level = list(logging.root.handlers), logging.root.level

    def start_rank(cmd, stdout=None, stderr=None, **kwargs):
        cmd = [str(c) for c in cmd]
        if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py") or kwargs.get("env"):
            return real_popen(cmd, stdout=stdout, stderr=stderr, **kwargs)
        pid = os.fork()
        if pid == 0:  # the rank: undo what the launcher changed in this process, then run as served
            subprocess.Popen = real_popen
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for finalizer in set(weakref.finalize._registry) - finalizers:  # type: ignore[attr-defined]
                finalizer.detach()  # the launcher's temporary folder is the launcher's to remove
            logging.root.handlers[:] = log_handlers
            logging.root.setLevel(log_level)
            _reread_rank()
            if stdout is not None:
                os.dup2(stdout.fileno(), 1)
            if stderr is subprocess.STDOUT:
                os.dup2(1, 2)
            elif stderr is not None:
                os.dup2(stderr.fileno(), 2)
            _run("script", cmd[1:], base_path)  # never returns
        return _Rank(cmd, pid)

    subprocess.Popen = start_rank  # type: ignore[misc]
    for sig in (signal.SIGTERM, signal.SIGINT):  # what importing composer does in a new process
        signal.signal(sig, engine.sigterm_handler)


def _reread_rank() -> None:
    """What the third-party libraries computed from the rank when the server imported them, computed
    again for this rank (a new interpreter imports them with its own RANK). One value so far:
    Composer's name for a rank's sharded checkpoint file."""
    import composer.utils.checkpoint as composer_checkpoint

    composer_checkpoint._TORCH_DISTRIBUTED_CHECKPOINTS_FILENAME = f"__{os.environ.get('RANK', '0')}_0.distcp"


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

    def spawn(self, request: dict, cwd, env: dict, stdout, stderr) -> ForkedProcess:
        self.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        opened: list[int] = []
        fds = [_fd(subprocess.DEVNULL, opened, "r"), _fd(stdout, opened), _fd(stderr, opened, stdout=stdout)]
        try:
            request = {**request, "cwd": str(cwd or os.getcwd()), "env": dict(env)}
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
        finally:
            for fd in opened:
                os.close(fd)
        return ForkedProcess(request["args"], conn)

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


def _request(args: list[str]) -> dict | None:
    """What the server runs for the command line `args`, or None where it does not serve it."""
    from scenarios.resume import PRIVATE_SHM

    if os.environ.get("LLM_TEST_NO_FORKSERVER") == "1":
        return None
    private_shm = args[: len(PRIVATE_SHM)] == PRIVATE_SHM
    command = args[len(PRIVATE_SHM) :] if private_shm else args
    request = {"args": args, "private_shm": private_shm}
    if command[:1] == [COMPOSER]:
        return {**request, "kind": "launcher", "argv": command}
    if private_shm or len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1].endswith(".py"):
        return {**request, "kind": "script", "argv": command[1:]}
    if command[1] == "-m" and len(command) > 2 and _project_module(command[2]):
        return {**request, "kind": "module", "argv": command[2:]}
    return None


def popen(args, *, cwd=None, env=None, stdout=None, stderr=None, **kwargs):
    """`subprocess.Popen(args, ...)`, served by a fork of the server where it can be."""
    args = [str(a) for a in args]
    request = _request(args)
    if request is None or set(kwargs) - {"start_new_session"} or subprocess.PIPE in (stdout, stderr):
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, **kwargs)
    return start().spawn(request, cwd, env if env is not None else os.environ, stdout, stderr)


def run(args, *, cwd=None, env=None, timeout=None, capture_output=False, text=False, check=False, **kwargs):
    """`subprocess.run(args, ...)`, served by a fork of the server where it can be; captured output
    goes through temporary files. On a timeout the process's whole group is killed."""
    args = [str(a) for a in args]
    if _request(args) is None or kwargs:
        return subprocess.run(
            args, cwd=cwd, env=env, timeout=timeout, capture_output=capture_output, text=text, check=check,
            **kwargs,
        )  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        targets = (out, err) if capture_output else (None, None)
        proc = popen(args, cwd=cwd, env=env, stdout=targets[0], stderr=targets[1])
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise
        captured = []
        for stream in targets:
            if stream is None:
                captured.append(None)
                continue
            stream.seek(0)
            data = stream.read()
            captured.append(data.decode(errors="replace") if text else data)
    result = subprocess.CompletedProcess(args, code, *captured)
    if check:
        result.check_returncode()
    return result


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
