"""The run lock: one training run at a time writes a checkpoint folder.

Two runs started with the same `checkpoint.save_folder` would both resume from the same
checkpoint, both save, move `latest.json` and prune each other's checkpoints. So rank 0 holds a
lease in the folder, local or S3:

    <save_folder>/run-lock.json
        {"host": "node-3", "pid": 4242, "pid_started": 81234, "run_name": "b7-001",
         "token": "9f...", "acquired_at": 1700000000.0, "heartbeat_at": 1700000090.0,
         "heartbeat_s": 30.0, "beats": 3}

- It is taken with a compare-and-swap write (`Store.write_if`: an S3 conditional PUT, a local
  write under `flock`), so of two runs starting at once exactly one gets it; the other is refused
  with one line naming the holder (`RunLockHeld`, a ConfigError: exit 2).
- A takeover (below) first claims the lease it replaces: it creates a claim file named for that
  lease's version (`.run-lock.json.tmp-takeover-<hash>`) only if absent, so of runs taking one
  stale lease over at once exactly one proceeds. The replacing write itself (S3 `If-Match`) is
  not enough: SeaweedFS 4.48 (and moto) check the condition and write in two steps, and two of
  eight writers racing from one version both succeeded in about one round in five (the create
  `If-None-Match: *` is exclusive on both, and on AWS as documented). A claim left by a run that died
  is removed when its process on this host is gone or it is as old as a stale lease.
- A background thread renews it every `LLM_RUN_LOCK_HEARTBEAT_S` seconds (default 30), again
  compare-and-swap: if another run has taken it over meanwhile, this run stops after the current
  batch (`RunLockHeld`) instead of writing beside it.
- It is released at fit end, on the SIGTERM/SIGINT exit and on errors (`RunLockCallback` in
  `plan.py`, at `fit_end` and `close`, and an `atexit` hook for failures before the Trainer
  exists). This module imports no Composer, so taking a lock costs no Composer import.
- A lease that was not released is taken over, with a message naming it, when its holder ran on
  this host and that process is gone (at once), when its last heartbeat is older than
  `LLM_RUN_LOCK_STALE_BEATS` (default 4) of its holder's heartbeat intervals (a dead host: two
  minutes with the defaults), or when the file is not a lease at all. Staleness compares the
  holder's wall clock with this host's: hosts are assumed to agree to well within that time (NTP).

Why our own: Composer and streaming have no lock on a checkpoint folder, and lock-file packages
(`filelock`) lock local files only, not an S3 prefix.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from llm.errors import ConfigError
from storage import Store
from storage.env_numbers import EnvNumberError, env_number
from storage.local import TMP_MARK

log = logging.getLogger(__name__)

LOCK_FILE = "run-lock.json"
HOST = socket.gethostname()


class RunLockHeld(ConfigError):
    """Another run holds this checkpoint folder's run lock, or took it over from this run."""


@dataclass(frozen=True)
class LockTiming:
    heartbeat_s: float = 30.0  # how often the holder renews its lease
    stale_beats: int = 4  # heartbeats missed before another run may take the lease over

    @classmethod
    def from_env(cls) -> LockTiming:
        try:
            return cls(
                heartbeat_s=env_number("LLM_RUN_LOCK_HEARTBEAT_S", cls.heartbeat_s, float),
                stale_beats=env_number("LLM_RUN_LOCK_STALE_BEATS", cls.stale_beats, int),
            )
        except EnvNumberError as err:
            raise ConfigError(str(err)) from None


class RunLock:
    """The lease on one checkpoint folder; `acquire()` it, `release()` it (never raises)."""

    def __init__(self, store: Store, run_name: str | None, timing: LockTiming | None = None):
        self.store = store
        self.run_name = run_name
        self.timing = timing or LockTiming.from_env()
        self.token = secrets.token_hex(8)
        self.took_over: str | None = None  # why a previous holder's lease was taken, if it was
        self.lost: str | None = None  # set when another run took the lease from this one
        self._acquired_at: float | None = None
        self._version: str | None = None
        self._beats = 0
        self._released = False
        self._writing = threading.Lock()  # one write at a time: heartbeat thread or release
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.store.url(LOCK_FILE)

    def acquire(self) -> RunLock:
        """Take the lease (StorageError if the folder cannot be written, RunLockHeld if in use)."""
        for attempt in range(5):  # another run changed the file between our read and our write: look again
            if self._try_take():
                break
            time.sleep(0.1 * 2**attempt)  # a takeover in flight ends in a few requests
        else:
            raise RunLockHeld(f"the run lock {self.url} keeps changing hands; is another run starting?")
        atexit.register(self.release)
        self._thread = threading.Thread(target=self._renew, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """RunLockHeld if another run has taken the lease over from this one."""
        if self.lost:
            raise RunLockHeld(self.lost)

    def release(self) -> None:
        """Give the lease back, if it is still ours; storage failures are only logged."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        with self._writing:
            if self.lost or self._version is None:
                return
            try:
                if not self.store.delete_if(LOCK_FILE, self._version):
                    current = self.store.read_versioned(LOCK_FILE)
                    if current and _parse(current[0]).get("token") == self.token:
                        self.store.delete_if(LOCK_FILE, current[1])
            except Exception as err:  # at close or at exit: say so, never mask what ended the run
                log.warning(
                    "could not release the run lock %s (%s); the next run takes it over once it is stale",
                    self.url,
                    err,
                )

    def abandon(self) -> None:
        """Stop renewing the lease without a word to the storage (the end of a run that gave its
        storage up): the lease goes stale and the next run takes it over."""
        self._released = True
        self._stop.set()

    # --- taking ----------------------------------------------------------------------------

    def _try_take(self) -> bool:
        now = time.time()
        version = self.store.write_if(LOCK_FILE, self._lease(now), expected=None)
        if version is not None:
            self._version = version
            return True
        current = self.store.read_versioned(LOCK_FILE)
        if current is None:
            return False  # released in between
        data, version = current
        holder = _parse(data)
        if holder.get("token") == self.token:  # our own write, retried after its answer was lost
            self._version = version
            return True
        reason = self._takeover_reason(holder, now)
        if reason is None:
            raise RunLockHeld(self._held_message(holder, now))
        claim = self._claim(version, now)
        if claim is None:
            return False  # another run is taking this lease over
        try:
            new_version = self.store.write_if(LOCK_FILE, self._lease(now), expected=version)
        finally:
            self._drop(claim)
        if new_version is None:
            return False
        self._version = new_version
        self.took_over = reason
        message = f"took over the run lock {self.url} from {_describe(holder)}: {reason}"
        log.warning(message)
        print(f"[run-lock] {message}", file=sys.stderr, flush=True)
        return True

    def _claim(self, version: str, now: float) -> tuple[str, str] | None:
        """The claim on replacing the lease at `version` (its file and version), or None while
        another run holds it. A claim of a run that died (its process on this host gone, or as old
        as a stale lease) is removed and claimed again, once."""
        name = claim_file(version)
        for _ in range(2):
            claimed = self.store.write_if(name, self._lease(now), expected=None)
            if claimed is not None:
                return name, claimed
            current = self.store.read_versioned(name)
            if current is not None:
                if self._takeover_reason(_parse(current[0]), now) is None:
                    return None  # a live run's takeover, in flight
                self.store.delete_if(name, current[1])
        return None

    def _drop(self, claim: tuple[str, str]) -> None:
        try:
            self.store.delete_if(*claim)
        except Exception as err:  # it names a version no lease has any more: only litter
            log.warning(
                "could not remove the run lock's takeover claim %s: %s", self.store.url(claim[0]), err
            )

    def _takeover_reason(self, holder: dict[str, Any], now: float) -> str | None:
        """Why `holder`'s lease may be taken, or None while it is alive."""
        if not holder:
            return "the file is not a lease (torn or foreign)"
        pid, started = holder.get("pid"), holder.get("pid_started")
        if holder.get("host") == HOST and isinstance(pid, int):
            if pid == os.getpid() and started == _process_started(pid):
                return "it was taken by an earlier trainer of this same process"
            if not _alive(pid, started):
                return f"its process {pid} on this host is gone"
        beat, interval = holder.get("heartbeat_at"), holder.get("heartbeat_s")
        if not isinstance(beat, (int, float)) or not isinstance(interval, (int, float)):
            return "the lease records no heartbeat"
        age, limit = now - beat, self.timing.stale_beats * interval
        if age > limit:
            return (
                f"its last heartbeat was {age:.0f} s ago, more than {self.timing.stale_beats} "
                f"heartbeats of {interval:g} s"
            )
        return None

    def _held_message(self, holder: dict[str, Any], now: float) -> str:
        limit = self.timing.stale_beats * float(holder.get("heartbeat_s") or self.timing.heartbeat_s)
        age = now - float(holder.get("heartbeat_at") or now)
        return (
            f"checkpoint.save_folder {self.store.root} is in use by {_describe(holder)}, last heartbeat "
            f"{age:.0f} s ago; two runs must not write one checkpoint folder: wait for that run or stop "
            f"it, or give this one another checkpoint.save_folder (a lease not renewed for {limit:.0f} s "
            f"is taken over; if that run is surely gone, delete {self.url})"
        )

    def _lease(self, now: float) -> bytes:
        self._acquired_at = self._acquired_at or now
        lease = {
            "host": HOST,
            "pid": os.getpid(),
            "pid_started": _process_started(os.getpid()),
            "run_name": self.run_name,
            "token": self.token,
            "acquired_at": self._acquired_at,
            "heartbeat_at": now,
            "heartbeat_s": self.timing.heartbeat_s,
            "beats": self._beats,
        }
        return (json.dumps(lease, indent=1, sort_keys=True) + "\n").encode()

    # --- keeping -----------------------------------------------------------------------------

    def _renew(self) -> None:
        while not self._stop.wait(self.timing.heartbeat_s):
            self._beat()

    def _beat(self) -> None:
        with self._writing:
            if self._stop.is_set() or self.lost:
                return
            self._beats += 1
            try:
                version = self.store.write_if(LOCK_FILE, self._lease(time.time()), expected=self._version)
                if version is None:
                    current = self.store.read_versioned(LOCK_FILE)
                    holder = _parse(current[0]) if current else {}
                    if holder.get("token") != self.token:
                        self._lose(holder)
                        return
                    version = current[1]
                self._version = version
            except Exception as err:  # the next beat tries again; the lease lasts several beats
                if not self._stop.is_set():  # not after release or abandon: the run is ending
                    log.warning("could not renew the run lock %s: %s", self.url, err)

    def _lose(self, holder: dict[str, Any]) -> None:
        self.lost = (
            f"this run lost the run lock {self.url} to {_describe(holder) if holder else 'nobody (it was deleted)'} "
            "after its heartbeats failed; it stops so that two runs never write one checkpoint folder"
        )
        log.error(self.lost)
        self._stop.set()


def claim_file(version: str) -> str:
    """The claim on replacing the lease at `version`: a temporary name (local listings skip it)."""
    return f".{LOCK_FILE}{TMP_MARK}takeover-{hashlib.sha256(version.encode()).hexdigest()[:16]}"


def _parse(data: bytes) -> dict[str, Any]:
    try:
        lease = json.loads(data)
    except ValueError:
        return {}
    return lease if isinstance(lease, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("acquired_at")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    )
    return (
        f"run {holder.get('run_name')!r} (host {holder.get('host')}, pid {holder.get('pid')}, since {when})"
    )


def _process_started(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now_started = _process_started(pid)
    if now_started is None:
        return not os.path.isdir("/proc")  # without /proc, trust kill(0); with it, a zombie is gone
    return started is None or now_started == started
