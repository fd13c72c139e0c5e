"""The storage layer: one interface for local folders and S3, and one behaviour under S3 faults.

The fault tests put `scenarios.proxy.Proxy` between the code and the loopback S3 server and drive the real
entry points of the three users of storage (conversion, data reading, checkpointing) through the
same faults: the endpoint down, a burst of 503s, a slow answer, a server that never answers.
Each must retry the same number of times and end in the same kind of one-line error, bounded
in time; nothing may hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage
from convert.errors import ConvertError
from convert.reading.sources import expand_inputs
from llm.checkpoint.resume import newest_usable_checkpoint
from scenarios.proxy import Proxy
from shards.meta import SplitMeta, read_meta
from storage import StorageError, atomic_open, open_store
from tests.support.s3server import free_port

# --- one interface -----------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "root")
    s3_server = request.getfixturevalue("s3_server")
    bucket = s3_server.create_bucket(f"store-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**8}")
    return open_store(f"s3://{bucket}/some/prefix")


def test_both_stores_read_write_list_and_delete_alike(store, tmp_path):
    assert store.read_bytes("a/b.bin") is None and not store.exists("a/b.bin") and store.size("x") is None
    store.write_bytes("a/b.bin", b"12345")
    store.write_json("a/c/meta.json", {"k": "值"})
    src = tmp_path / "up.bin"
    src.write_bytes(b"uploaded")
    store.upload(src, "d/up.bin")
    assert store.read_bytes("a/b.bin") == b"12345" and store.size("a/b.bin") == 5
    assert store.read_range("a/b.bin", 1, 4) == b"234" and store.read_range("a/b.bin", 2, 2) == b""
    assert store.read_range("gone.bin", 0, 3) is None
    assert store.read_json("a/c/meta.json") == {"k": "值"}
    assert store.list() == {"a/b.bin": 5, "a/c/meta.json": store.size("a/c/meta.json"), "d/up.bin": 8}
    assert store.list("a/c") == {"a/c/meta.json": store.size("a/c/meta.json")}
    assert store.list_dirs() == ["a", "d"] and store.list_dirs("a") == ["c"]
    store.download("d/up.bin", tmp_path / "down" / "up.bin")
    assert (tmp_path / "down" / "up.bin").read_bytes() == b"uploaded"
    store.write_bytes("torn.json", b"{not json")
    assert store.read_json("torn.json") is None  # a torn or foreign file reads as absent
    store.delete(["d/up.bin", "never-existed"])
    store.delete_tree("a")
    assert store.list() == {"torn.json": 9}
    with pytest.raises(StorageError) as missing:
        store.download("gone.bin", tmp_path / "gone.bin")
    assert missing.value.missing


def _count_up(root: str, times: int) -> None:
    store = open_store(root)
    done = 0
    while done < times:
        data, version = store.read_versioned("count")
        if store.write_if("count", str(int(data) + 1).encode(), version) is not None:
            done += 1


def test_local_compare_and_swaps_are_exclusive_across_processes_and_leave_no_guard_file(tmp_path):
    """Four processes add 1 through write_if 40 times each: no update lost, and the guard each swap
    locks is gone afterwards (a finished run left a 0-byte .run-lock.json.tmp-guard before)."""
    import multiprocessing

    root = tmp_path / "root"
    store = open_store(root)
    assert store.write_if("count", b"0", None) is not None
    workers = [
        multiprocessing.get_context("fork").Process(target=_count_up, args=(str(root), 40)) for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    assert store.read_bytes("count") == b"160"
    version = store.read_versioned("count")[1]
    assert store.delete_if("count", version)
    assert sorted(p.name for p in root.iterdir()) == []  # no hidden side file either


def test_atomic_open_leaves_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(target, "w") as f:
        f.write("half of the new")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary file left behind


def _write_and_hang(path: str, ready) -> None:
    with atomic_open(path, "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        ready.set()
        time.sleep(120)


def test_temporary_files_of_killed_writers_are_removed_and_a_live_writers_kept(tmp_path):
    """Two writers stopped inside `atomic_open`: one SIGKILLed (its temporary file stays behind),
    one still writing. `remove_stale_temporaries` removes the dead one's file only; the folder's
    real files are untouched."""
    import multiprocessing
    import signal

    store = open_store(tmp_path)
    store.write_bytes("kept.run", b"done")
    context = multiprocessing.get_context("fork")
    writers = []
    for name in ("dead.run", "live.run"):
        ready = context.Event()
        writer = context.Process(target=_write_and_hang, args=(str(tmp_path / name), ready))
        writer.start()
        assert ready.wait(60)
        writers.append(writer)
    dead, live = writers
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(30)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert [n for n in left if n.startswith(".dead.run.tmp-")] and [
            n for n in left if n.startswith(".live.run")
        ]
        removed = store.remove_stale_temporaries()
        assert [os.path.basename(p) for p in removed] == [n for n in left if n.startswith(".dead.run")]
        after = sorted(p.name for p in tmp_path.iterdir())
        assert after == sorted(["kept.run", *(n for n in left if n.startswith(".live.run"))])
        assert store.remove_stale_temporaries("absent") == []
    finally:
        live.kill()
        live.join(30)


def _temp_folder_of_a_process(tmp_path, **env) -> Path:
    """The temp folder a new process takes (`use_own_temp_folder`), as it reports it."""
    code = "import tempfile; from storage.scratch import use_own_temp_folder as u; u(); print(tempfile.gettempdir())"
    environ = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    environ.update(TMPDIR=str(tmp_path), **env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def test_the_ranks_of_one_launch_share_a_temp_folder_and_a_lone_process_has_its_own(tmp_path):
    """mosaicml-streaming keeps the file locks of the shared memory all ranks of a node use in the
    temp folder: with a folder of each rank's own, the ranks locked different files and raced on
    its barrier, which then never opened (CI: multi-rank runs hung in their first epoch)."""
    first, second = (_temp_folder_of_a_process(tmp_path, LOCAL_WORLD_SIZE="2") for _ in range(2))
    assert first == second == tmp_path / f"llm-tmp-{os.getpid()}-ranks"
    lone = [_temp_folder_of_a_process(tmp_path) for _ in range(2)]
    assert lone[0] != lone[1] and all(p.parent == tmp_path for p in lone)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # the lone ones removed theirs


def test_a_second_thread_leaving_waits_for_the_exit_chores_another_is_running():
    """A preempted run's watchdog and its main thread may both end the process; the second to
    call `run_exit_chores` used to return at once and `os._exit` while the first was still in a
    chore (CI: the resource tracker's warning below the run's last line)."""
    import threading

    from storage.scratch import on_exit, run_exit_chores

    started, done = threading.Event(), threading.Event()

    def slow_chore():
        started.set()
        time.sleep(0.5)
        done.set()

    on_exit(slow_chore, fast_only=True)
    first = threading.Thread(target=run_exit_chores)
    first.start()
    assert started.wait(10)
    run_exit_chores()
    assert done.is_set(), "returned while the other thread was still in a chore"
    first.join(10)


def test_atomic_path_moves_a_library_written_file_in_whole_with_a_new_file_s_mode(tmp_path):
    target = tmp_path / "w.bin"
    target.write_text("old")
    with pytest.raises(RuntimeError), storage.atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["w.bin"]
    with storage.atomic_path(target) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors' own temporary file
        os.write(fd, b"new")
        os.close(fd)
    probe = tmp_path / "probe"
    probe.write_text("")
    assert target.read_bytes() == b"new" and target.stat().st_mode == probe.stat().st_mode


def test_an_output_that_cannot_be_a_folder_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        open_store(tmp_path / "file").check_writable()
    with pytest.raises(StorageError, match=r"file is a file, not a folder"):
        open_store(tmp_path / "file" / "out").check_writable()
    open_store(tmp_path / "new" / "out").check_writable()  # a folder still to be made is fine


def test_retry_policy_comes_from_the_environment(monkeypatch):
    assert storage.RetryPolicy.from_env() == storage.RetryPolicy(None, 5.0, 60.0, 300.0, 15.0)
    monkeypatch.setenv("LLM_S3_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("LLM_S3_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("LLM_S3_OUTAGE_S", "42")
    policy = storage.RetryPolicy.from_env()
    assert (policy.max_attempts, policy.connect_timeout, policy.read_timeout) == (7, 5.0, 2.5)
    assert policy.outage_s == 42 and policy.deadline_s == 47
    client = storage.s3_client()
    # botocore makes one attempt; storage.s3.call retries against the outage budget
    assert client.meta.config.retries["total_max_attempts"] == 1 and client.meta.config.read_timeout == 2.5
    monkeypatch.setenv("LLM_S3_MAX_ATTEMPTS", "many")
    with pytest.raises(
        StorageError, match="LLM_S3_MAX_ATTEMPTS='many' is not a positive whole number; give one, or unset it"
    ):
        storage.RetryPolicy.from_env()


# --- the same faults through every user of storage ------------------------------------------------

ATTEMPTS = 3
TIMEOUT = 1.0


@pytest.fixture
def seeded(s3_server, s3_bucket, tmp_path):
    """A bucket holding what each user reads: a corpus file, a split's meta.json, a checkpoint."""
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="corpus/a.jsonl", Body=b'{"text": "x"}\n')
    meta = SplitMeta(
        split="train", seq_len=8, dtype="uint16", vocab_size=10, eos_id=2, bos_id=1, add_bos=False,
        tokenizer_sha256="none", num_samples=0, num_tokens=0, num_documents=0, dropped={}, created_at="",
        command="test",
    )  # fmt: skip
    client.put_object(
        Bucket=s3_bucket, Key="shards/train/meta.json", Body=json.dumps(meta.to_dict()).encode()
    )
    payload = tmp_path / "ckpt.pt"
    payload.write_bytes(b"weights")
    return s3_bucket, payload


def _operations(bucket: str, payload):
    """name -> (a call through that user's real entry point, the error type it raises)."""
    return {
        "conversion input": (lambda: expand_inputs([f"s3://{bucket}/corpus/"]), ConvertError),
        "data meta.json": (lambda: read_meta(f"s3://{bucket}/shards/train"), StorageError),
        "checkpoint upload": (
            lambda: open_store(f"s3://{bucket}/ck").upload(payload, "ba1.pt"),
            StorageError,
        ),
        "checkpoint scan": (lambda: newest_usable_checkpoint(f"s3://{bucket}/ck"), StorageError),
    }


OPERATIONS = ["conversion input", "data meta.json", "checkpoint upload", "checkpoint scan"]


@pytest.fixture
def proxy(s3_server, monkeypatch):
    proxy = Proxy(s3_server.port)
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("LLM_S3_MAX_ATTEMPTS", str(ATTEMPTS))
    monkeypatch.setenv("LLM_S3_CONNECT_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("LLM_S3_READ_TIMEOUT", str(TIMEOUT))
    yield proxy
    proxy.cut()


def _fails(call, error_type) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(error_type) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message, time.monotonic() - start


@pytest.mark.s3
@pytest.mark.parametrize("operation", OPERATIONS)
def test_endpoint_down_fails_with_one_line_naming_it(operation, seeded, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", dead)
    monkeypatch.setenv("LLM_S3_MAX_ATTEMPTS", str(ATTEMPTS))
    call, error_type = _operations(*seeded)[operation]
    message, seconds = _fails(call, error_type)
    assert f"cannot reach endpoint {dead}" in message and "S3_ENDPOINT_URL" in message
    assert f"{ATTEMPTS} attempts" in message
    assert seconds < 60


@pytest.mark.s3
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_burst_of_503s_shorter_than_the_attempts_is_retried_through(operation, seeded, proxy):
    call, _ = _operations(*seeded)[operation]
    proxy.set("error", errors=ATTEMPTS - 1)
    call()  # succeeds on the last attempt
    assert proxy.requests >= ATTEMPTS  # the failed attempts, then the ones that went through


@pytest.mark.s3
@pytest.mark.parametrize("operation", OPERATIONS)
def test_503s_beyond_the_attempts_fail_after_exactly_that_many_tries(operation, seeded, proxy):
    call, error_type = _operations(*seeded)[operation]
    proxy.set("error", errors=100)
    message, _ = _fails(call, error_type)
    assert proxy.requests == ATTEMPTS  # the same policy, whichever module asked
    assert "SlowDown" in message and f"{ATTEMPTS} attempts" in message


@pytest.mark.s3
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_slow_answer_within_the_timeout_succeeds(operation, seeded, proxy):
    call, _ = _operations(*seeded)[operation]
    proxy.set("slow", delay=TIMEOUT / 4)
    call()


@pytest.mark.s3
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_server_that_never_answers_ends_in_an_error_within_the_policy_bound(operation, seeded, proxy):
    call, error_type = _operations(*seeded)[operation]
    proxy.set("hang")
    message, seconds = _fails(call, error_type)
    assert "stopped answering" in message and "LLM_S3_READ_TIMEOUT" in message
    # attempts x read timeout, plus botocore's backoff between attempts (under 1 + 2 s here), plus
    # slack for a loaded machine (15.9 s was seen at load 10 on 2 cores); an attempt that waited
    # botocore's own 60 s read timeout instead of LLM_S3_READ_TIMEOUT would still fail this.
    assert seconds < ATTEMPTS * TIMEOUT + 30
    assert proxy.requests == ATTEMPTS
