"""The run lock: one training run per checkpoint folder, on a local folder and on S3.

The lease is exercised directly (both stores, real processes for the race and for a dead holder),
then two real `train.py` processes are pointed at the same `save_folder`.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm.checkpoint.lock import (
    HOST,
    LOCK_FILE,
    LockTiming,
    RunLock,
    RunLockHeld,
    _process_started,
    claim_file,
)
from storage import StorageError, open_store
from storage.store import LocalStore, guard_file
from tests.support.resume import REPO, kill_group, run, start, wait_for_batch, write_recipe

FAST = LockTiming(heartbeat_s=0.2, stale_beats=3)
# For a newcomer that must find the holder alive: a holder starved of CPU on a loaded machine can
# miss FAST's 0.6 s, and the newcomer would then rightly take the lease over instead of refusing.
PATIENT = LockTiming(heartbeat_s=0.2, stale_beats=300)


@pytest.mark.parametrize("raw", ["soon", "0", "-2"])
def test_a_bad_number_in_any_environment_variable_is_the_same_one_line(monkeypatch, raw):
    """The lock's, the checkpoint check's and storage's variables share one parser: the same line
    for the same mistake, each raised as its layer's error (ConfigError exits 2, StorageError 1)."""
    from llm.checkpoint.resume import verify_limit
    from llm.errors import ConfigError
    from storage import RetryPolicy

    for name, read, error, default in (
        ("LLM_RUN_LOCK_HEARTBEAT_S", LockTiming.from_env, ConfigError, "30"),
        ("LLM_S3_OUTAGE_S", RetryPolicy.from_env, StorageError, "300"),
    ):
        monkeypatch.setenv(name, raw)
        with pytest.raises(error) as refused:
            read()
        assert (
            str(refused.value)
            == f"{name}={raw!r} is not a positive number; give one, or unset it (default {default})"
        )
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLM_CKPT_VERIFY_MAX_BYTES", raw)
    if raw == "0":  # 0 is allowed here: verify no checkpoint's hashes
        assert verify_limit() == 0
    else:
        with pytest.raises(
            ConfigError, match=f"^LLM_CKPT_VERIFY_MAX_BYTES={raw!r} is not a whole number of 0 or more"
        ):
            verify_limit()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "ckpt")
    s3_server = request.getfixturevalue("s3_server")
    bucket = s3_server.create_bucket(f"lock-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**8}")
    return open_store(f"s3://{bucket}/runs/a")


def lease(store) -> dict:
    return json.loads(store.read_bytes(LOCK_FILE))


# Another run, as far as the lock can tell: a process that takes the lock, says so, and releases
# it when its stdin closes (or dies without releasing it when killed).
HOLDER = """
import sys
from llm.checkpoint.lock import LockTiming, RunLock
from storage import open_store
lock = RunLock(open_store(sys.argv[1]), "run-a", LockTiming(heartbeat_s=0.2)).acquire()
print("held", flush=True)
sys.stdin.read()
print(lock.lost or "kept the lock", flush=True)
lock.release()
"""


def hold(store) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store.root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def freeze(holder: subprocess.Popen, store) -> None:
    """SIGSTOP the holder between heartbeats. Inside one (milliseconds) it holds a local folder's
    compare-and-swap guard, and everyone else would wait for it (GUARD_WAIT_S, then an error)."""
    for _ in range(200):
        os.kill(holder.pid, signal.SIGSTOP)
        if not isinstance(store, LocalStore):
            return  # S3: conditional writes, nothing held between requests
        with open(guard_file(store.path(LOCK_FILE)), "a") as side:
            try:
                fcntl.flock(side, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(side, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                pass
        os.kill(holder.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the holder was inside its guard at every try")


def test_a_frozen_writer_inside_the_guard_is_an_error_not_a_hang(tmp_path, monkeypatch):
    import storage.store

    monkeypatch.setattr(storage.store, "GUARD_WAIT_S", 1.0)
    store = open_store(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    with open(guard_file(store.path(LOCK_FILE)), "a") as side:
        fcntl.flock(side, fcntl.LOCK_EX)  # another process's swap that never ends
        with pytest.raises(StorageError, match=r"locked by another process for over 1 s"):
            RunLock(store, "run-b", FAST).acquire()


def test_a_second_holder_is_refused_naming_the_first_and_release_frees_the_folder(store):
    holder = hold(store)
    with pytest.raises(RunLockHeld) as refused:
        RunLock(store, "run-b", PATIENT).acquire()
    message = str(refused.value)
    assert "\n" not in message and store.root in message and "delete" in message
    assert f"is in use by run 'run-a' (host {HOST}, pid {holder.pid}, since " in message

    holder.stdin.close()  # the first run ends and releases the lock
    assert holder.wait(timeout=60) == 0
    assert store.read_bytes(LOCK_FILE) is None
    lock = RunLock(store, "run-b", FAST).acquire()
    assert lock.took_over is None and lease(store)["run_name"] == "run-b"
    lock.release()
    if isinstance(store, LocalStore):  # the compare-and-swap guard is gone with its swap
        assert sorted(p.name for p in Path(store.root).iterdir()) == []


def test_a_lease_whose_holder_died_on_this_host_is_taken_over_at_once(store, capsys):
    holder = hold(store)
    holder.kill()  # SIGKILL: no release
    holder.wait()
    assert lease(store)["pid"] == holder.pid
    lock = RunLock(store, "run-b", FAST).acquire()
    assert lock.took_over == f"its process {holder.pid} on this host is gone"
    assert "[run-lock] took over the run lock" in capsys.readouterr().err
    lock.release()


def test_a_lease_not_renewed_goes_stale_is_taken_over_and_its_old_holder_stops(store):
    holder = hold(store)
    deadline = time.monotonic() + 30
    while lease(store)["beats"] < 2 and time.monotonic() < deadline:  # heartbeats renew it
        time.sleep(0.05)
    assert lease(store)["beats"] >= 2
    freeze(holder, store)  # a frozen or cut-off host: alive, but no more heartbeats
    try:
        with pytest.raises(RunLockHeld):
            RunLock(store, "run-b", PATIENT).acquire()  # a stopped holder is not taken over at once
        time.sleep(FAST.stale_beats * 0.2 + 0.5)
        newcomer = RunLock(store, "run-b", FAST).acquire()
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert (
        "its last heartbeat was" in newcomer.took_over
        and "more than 3 heartbeats of 0.2 s" in newcomer.took_over
    )
    time.sleep(1.0)  # the old holder's next heartbeat finds the lease taken
    out, _ = holder.communicate("", timeout=60)
    assert "this run lost the run lock" in out and "run 'run-b'" in out
    assert lease(store)["token"] == newcomer.token  # and it left the new lease alone
    newcomer.release()


def test_a_torn_lease_file_is_taken_over(store):
    store.write_bytes(LOCK_FILE, b'{"host": "x", "pi')
    lock = RunLock(store, "run-b", FAST).acquire()
    assert "not a lease" in lock.took_over
    lock.release()


def _race(root: str, ready, go, results, done) -> None:
    store = open_store(root)
    ready.wait()
    go.wait()
    try:
        RunLock(store, f"racer-{os.getpid()}", LockTiming(heartbeat_s=60)).acquire()
        results.put("won")
        # Hold it until every racer has looked: a fixed second was too short under load (a racer
        # whose first request came later found the lock released and won too).
        done.wait(timeout=120)
    except RunLockHeld:
        results.put("refused")


def test_of_processes_starting_at_once_exactly_one_takes_the_lock(store):
    ctx = multiprocessing.get_context("spawn")  # fresh S3 clients, as separate runs would have
    ready, go, done, results = ctx.Barrier(5), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(store.root, ready, go, results, done)) for _ in range(4)]
    for proc in procs:
        proc.start()
    ready.wait()
    go.set()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    done.set()
    for proc in procs:
        proc.join(timeout=30)
    assert outcomes == ["refused", "refused", "refused", "won"]


def test_a_takeover_in_flight_makes_a_second_taker_back_off_and_a_dead_takers_claim_is_removed(store):
    """Of two runs taking one stale lease over, the one that finds the other's claim on its version
    does not write (SeaweedFS would let both replacing writes through); a claim whose run died is
    no obstacle."""
    dead = {"host": "node-gone", "pid": 1, "run_name": "old", "token": "0" * 16, "acquired_at": 1.0}
    dead |= {"heartbeat_at": time.time() - 3600, "heartbeat_s": 30.0}
    store.write_bytes(LOCK_FILE, json.dumps(dead).encode())
    stale_version = store.read_versioned(LOCK_FILE)[1]
    live = os.getppid()  # a process that outlives this test, as a run in the middle of its takeover
    claim = {"host": HOST, "pid": live, "pid_started": _process_started(live), "run_name": "other"}
    store.write_bytes(
        claim_file(stale_version),
        json.dumps(claim | {"heartbeat_at": time.time(), "heartbeat_s": 30.0}).encode(),
    )
    with pytest.raises(RunLockHeld, match="keeps changing hands"):
        RunLock(store, "run-b", FAST).acquire()
    assert lease(store)["run_name"] == "old", "the lease under another's claim was not written"

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    claim["pid"], claim["pid_started"] = int(gone.stdout), None
    store.write_bytes(
        claim_file(stale_version),
        json.dumps(claim | {"heartbeat_at": time.time(), "heartbeat_s": 30.0}).encode(),
    )
    lock = RunLock(store, "run-b", FAST).acquire()
    assert "its last heartbeat was" in lock.took_over and lease(store)["run_name"] == "run-b"
    assert store.read_bytes(claim_file(stale_version)) is None, (
        "the dead run's claim is gone with the takeover"
    )
    lock.release()


class _ReadThenWait:
    """A store whose first read of the lease waits for every racer's: the worst timing, each has
    read the stale lease and none has written. (A wrapper: the local store's own writes read
    the file inside their `flock`, and must not wait there.)"""

    def __init__(self, store, barrier):
        self._store, self._barrier, self._waited = store, barrier, False

    def __getattr__(self, name):
        return getattr(self._store, name)

    def read_versioned(self, rel):
        found = self._store.read_versioned(rel)
        if rel == LOCK_FILE and not self._waited:
            self._waited = True
            self._barrier.wait()
        return found


def _take_over(root: str, rounds: int, barrier, results) -> None:
    for r in range(rounds):
        store = _ReadThenWait(open_store(f"{root}/{r}"), barrier)
        barrier.wait()
        try:
            RunLock(store, f"racer-{os.getpid()}", LockTiming(heartbeat_s=60)).acquire().abandon()
            results.put((r, "won"))  # abandoned: the lease stays, fresh, for the others to find
        except RunLockHeld:
            results.put((r, "refused"))
        barrier.wait()  # every racer has looked before a winner moves on (or exits: its lease dies)


def test_of_runs_taking_one_stale_lease_over_at_once_exactly_one_holds_it(store):
    """The takeover replaces the stale lease at its version. SeaweedFS (and moto) let two racing
    `If-Match` writes from one version both succeed, so each racer claims the version first."""
    rounds, racers = 4, 6
    dead = {"host": "node-gone", "pid": 1, "run_name": "old", "token": "0" * 16, "acquired_at": 1.0}
    dead |= {"heartbeat_at": time.time() - 3600, "heartbeat_s": 30.0, "beats": 9}
    for r in range(rounds):
        open_store(f"{store.root}/{r}").write_bytes(LOCK_FILE, json.dumps(dead).encode())
    ctx = multiprocessing.get_context("fork")  # each racer makes its own S3 client (per pid)
    barrier, results = ctx.Barrier(racers), ctx.Queue()
    procs = [
        ctx.Process(target=_take_over, args=(store.root, rounds, barrier, results)) for _ in range(racers)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, list[str]] = {}
    for _ in range(rounds * racers):
        r, outcome = results.get(timeout=120)
        outcomes.setdefault(r, []).append(outcome)
    for proc in procs:
        proc.join(timeout=60)
    doubles = {r: o for r, o in outcomes.items() if sorted(o) != ["refused"] * (racers - 1) + ["won"]}
    assert not doubles, f"rounds without exactly one holder: {doubles}"
    assert not [key for key in _all_keys(store) if "takeover" in key], "the claims are removed"


def _all_keys(store) -> list[str]:
    if isinstance(store, LocalStore):
        return [p.name for p in Path(store.root).rglob("*")]
    return list(store.list())


@pytest.mark.slow
@pytest.mark.s3
def test_a_second_run_on_the_same_s3_save_folder_is_refused_in_one_line_naming_the_first(
    tmp_path, shards, s3_bucket
):
    """Two real runs on one checkpoint folder in the real store (SeaweedFS): the second is refused."""
    save_folder = f"s3://{s3_bucket}/ckpt"
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, save_folder, cache=tmp_path / "cache")
    proc, record, _ = start(recipe, "first", cwd=tmp_path, pause_at=1)  # holds after batch 1 till SIGTERM
    try:
        wait_for_batch(record, 1, proc)
        second = run(recipe, "second", cwd=tmp_path, overrides=["data.cache_root=" + str(tmp_path / "c2")])
        assert proc.poll() is None, "the first run ended before the second was refused"
        assert second.returncode == 2, second.output[-3000:]
        error = [line for line in second.output.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "Traceback" not in second.output
        assert f"is in use by run 'rs' (host {HOST}, pid {proc.pid}" in error[0]
        assert not second.batches()  # it trained nothing
        os.killpg(proc.pid, signal.SIGTERM)  # the first stops, saves, and gives the lock back
        proc.wait(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, proc.tag_log.read_text()[-3000:]
    assert open_store(save_folder).read_bytes(LOCK_FILE) is None  # given back


def _write_many(root: str, text: str) -> None:
    store = open_store(root)
    for _ in range(200):
        store.write_text("manifests/ba0000000004-rank00000.json", text)


def test_two_processes_writing_one_manifest_never_collide_on_a_temporary_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    texts = ["a" * 50_000, "b" * 50_000]
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), text)) for text in texts]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert (tmp_path / "manifests" / "ba0000000004-rank00000.json").read_text() in texts
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == ["ba0000000004-rank00000.json"]
