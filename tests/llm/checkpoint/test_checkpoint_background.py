"""Saves in the background on s3:// (loopback moto server behind the fault proxy): training goes
on while a save's snapshot is written and stored, a crash mid-write or mid-upload leaves the
previous checkpoint as the resume point, a snapshot is not changed by the steps trained while it
waits to be written, a failed upload ends the run at the next save with the one-line storage error,
and the same command then finishes bit-identically.

One scenario, run once for the module (`uploads`), processes of the same command:
a: the background write of the checkpoint at batch 8 is held half written (scenarios/resume_driver.py,
   LLM_TEST_WRITE_HOLD); training goes on to batch 10, where the process is SIGKILLed;
b: resumes at 4; the upload of 8 is held (LLM_TEST_UPLOAD_HOLD) until the save at 12 says it
   waits for it, then the proxy answers every request with 503 and the upload is let go: it
   fails, and the save at 12 ends the run with exit 1;
c: the storage is back; resumes at 4; the write of 8 is held while batches 9 and 10 train, then
   let go; SIGKILLed after batch 11 (8 stored);
e: resumes from that 8 and finishes: the snapshot was the state at 8, whatever trained after it.
d: another folder; the upload of the checkpoint at 4 is held for good, and SIGTERM after batch 6
   finds it pending: the wait is bounded (`checkpoint.upload_wait_s=2`), one line says so.
f: another folder behind a 100 kB/s cap (a save takes ~6 s to store), `preemption.notice_s=3`:
   SIGTERM after batch 6 starts no save that cannot end within the notice.
g: behind the same cap, `preemption.notice_s=4`: SIGTERM while the upload of 4 is in flight; the
   process ends within the notice without it.
a, b, c and e stage their saves in the scenario's own staging folder (`checkpoint.staging_folder`),
where the SIGKILLed a leaves its folder behind.
The tests assert on each step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

import pytest

from llm.checkpoint import restart
from scenarios.proxy import Proxy
from tests.support.resume import (
    MAX_BATCHES,
    SAVE_EVERY,
    Run,
    assert_same_weights,
    finish,
    interrupt,
    release,
    release_upload,
    release_write,
    run,
    start,
    upload_held,
    wait_for_batch,
    wait_for_file,
    wait_for_line,
    write_held,
    write_recipe,
)

pytestmark = [pytest.mark.s3, pytest.mark.slow]

HELD = 2 * SAVE_EVERY  # the checkpoint whose upload is held: 8
FAST_FAILURE = {"LLM_S3_MAX_ATTEMPTS": "2", "LLM_S3_READ_TIMEOUT": "2", "LLM_S3_CONNECT_TIMEOUT": "2"}


@dataclass
class Uploads:
    save: str
    a: Run
    a_reached_while_held: int  # the batch a had recorded while its upload of 8 was still held
    a_manifests: list[str]  # what the bucket held when a was killed
    a_latest: int
    b: Run
    b_waited: bool  # b's save at 12 said it waits for the upload of 8
    c: Run
    c_reached_while_held: int  # the batch c had recorded while the write of 8 was held
    e: Run
    e_manifests: list[str]
    d: Run
    f: Run
    f_keys: list[str]  # what f's folder in the bucket held after it
    g: Run  # seconds: from its SIGTERM to its exit
    a_staging: list[str]  # the staging folder's entries once a was killed, and after b and c
    e_staging: list[str]
    a_pid: int


@pytest.fixture(scope="module")
def uploads(tmp_path_factory, shards, s3_server) -> Uploads:
    root = tmp_path_factory.mktemp("background-uploads")
    bucket = s3_server.create_bucket("background-uploads")
    save = f"s3://{bucket}/runs/rs"
    proxy = Proxy(s3_server.port)
    env = {"S3_ENDPOINT_URL": proxy.endpoint, **FAST_FAILURE}
    recipe = write_recipe(root / "recipe.yaml", shards, save, cache=root / "cache")
    hold = {**env, "LLM_TEST_UPLOAD_HOLD": str(HELD)}
    hold_write = {**env, "LLM_TEST_WRITE_HOLD": str(HELD)}
    staging = root / "staging"
    stage = [f"checkpoint.staging_folder={staging}"]

    def manifests() -> list[str]:
        return [k.rsplit("/", 1)[1] for k in s3_server.keys(bucket, "runs/rs/manifests/")]

    def latest() -> int:
        body = s3_server.client().get_object(Bucket=bucket, Key="runs/rs/latest.json")["Body"].read()
        return json.loads(body)["batch"]

    # a: SIGKILL while the write of 8 is held half done, two batches later.
    proc, record, weights = start(recipe, "a", cwd=root, env=hold_write, pause_at=HELD + 2, overrides=stage)
    wait_for_file(write_held(record, HELD), proc)
    wait_for_batch(record, HELD + 2, proc)
    reached = [b["batch"] for b in Run(0, "", record, weights, 0).batches()][-1]
    a_manifests, a_latest = manifests(), latest()
    os.killpg(proc.pid, signal.SIGKILL)
    a = finish(proc, record, weights, 0.0)
    a_pid, a_staging = proc.pid, sorted(p.name for p in staging.iterdir())

    # b: the held upload of 8 fails once the save at 12 waits for it.
    proc, record, weights = start(recipe, "b", cwd=root, env=hold, overrides=stage)
    wait_for_file(upload_held(record, HELD), proc)
    wait_for_line(proc.tag_log, f"waits for the upload of batch {HELD}", proc)
    proxy.set("error", errors=10_000)
    release_upload(record, HELD)
    b = finish(proc, record, weights, 0.0)
    proxy.set("pass")

    # c: the write of 8 waits while 9 and 10 train; SIGKILL once 8 is stored (after 11).
    proc, record, weights = start(
        recipe, "c", cwd=root, env=hold_write, pause_at=(HELD + 2, HELD + 3), overrides=stage
    )
    wait_for_file(write_held(record, HELD), proc)
    wait_for_batch(record, HELD + 2, proc)
    c_reached = [b["batch"] for b in Run(0, "", record, weights, 0).batches()][-1]
    release_write(record, HELD)
    release(record, HELD + 2)
    wait_for_batch(record, HELD + 3, proc)
    _settled(s3_server, bucket, HELD, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    c = finish(proc, record, weights, 0.0)

    e = run(recipe, "e", cwd=root, env=env, overrides=stage)
    e_manifests = manifests()
    e_staging = sorted(p.name for p in staging.iterdir())

    # d: SIGTERM while an upload hangs; the wait for it is bounded.
    other = write_recipe(root / "d.yaml", shards, f"s3://{bucket}/runs/d", cache=root / "cache-d")
    bounded = {**env, "LLM_TEST_UPLOAD_HOLD": str(SAVE_EVERY)}
    proc, record, weights = start(
        other, "d", cwd=root, env=bounded, pause_at=6, overrides=["checkpoint.upload_wait_s=2"]
    )
    wait_for_file(upload_held(record, SAVE_EVERY), proc)
    wait_for_batch(record, 6, proc)
    proc.send_signal(signal.SIGTERM)
    d = finish(proc, record, weights, 0.0)
    proxy.cut()

    # f: SIGTERM with a notice shorter than a save takes at this run's measured rates.
    capped = Proxy(s3_server.port, rate=100e3)
    noticed = write_recipe(root / "f.yaml", shards, f"s3://{bucket}/runs/f", cache=root / "cache-f")
    notice = ["preemption.notice_s=3", "preemption.margin_s=0.5"]
    f = interrupt(
        noticed, "f", cwd=root, at_batch=6, sig=signal.SIGTERM, env={"S3_ENDPOINT_URL": capped.endpoint},
        overrides=notice,
    )  # fmt: skip
    f_keys = sorted(k.split("runs/f/", 1)[1] for k in s3_server.keys(bucket, "runs/f/"))

    # g: SIGTERM while the upload of 4 is still in flight behind the cap (steps of 0.5 s, no pause)
    # with a 4 s notice: that upload cannot end in time, and the process must not wait for it.
    later = write_recipe(root / "g.yaml", shards, f"s3://{bucket}/runs/g", cache=root / "cache-g")
    proc, record, weights = start(
        later, "g", cwd=root, sleep=0.5, env={"S3_ENDPOINT_URL": capped.endpoint},
        overrides=["preemption.notice_s=4", "preemption.margin_s=1"],
    )  # fmt: skip
    wait_for_batch(record, SAVE_EVERY + 1, proc)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    g = finish(proc, record, weights, 0.0)
    g.seconds = time.monotonic() - sent
    capped.cut()
    return Uploads(
        save, a, reached, a_manifests, a_latest, b, f"waits for the upload of batch {HELD}" in b.output,
        c, c_reached, e, e_manifests, d, f, f_keys, g, a_staging, e_staging, a_pid,
    )  # fmt: skip


def _settled(s3_server, bucket: str, batch: int, proc) -> None:
    """Wait until the checkpoint at `batch` is complete in the bucket (its manifest stored)."""
    import time

    deadline = time.monotonic() + 120
    while f"runs/rs/manifests/ba{batch:010d}-rank00000.json" not in s3_server.keys(
        bucket, "runs/rs/manifests/"
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.tag_log.read_text()[-3000:]
        time.sleep(0.1)


def test_training_goes_on_while_a_checkpoint_is_written_and_uploaded(uploads):
    assert uploads.a_reached_while_held == HELD + 2  # two steps trained with the write of 8 held
    assert uploads.c_reached_while_held == HELD + 2


def test_a_checkpoint_in_flight_is_not_complete_and_latest_stays_on_the_previous_one(uploads):
    assert uploads.a.returncode == -signal.SIGKILL
    assert uploads.a_manifests == [f"ba{SAVE_EVERY:010d}-rank00000.json"]  # no manifest for 8 yet
    assert uploads.a_latest == SAVE_EVERY


def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint_bit_identically(
    uploads, reference
):
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in uploads.b.output
    assert f"resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in uploads.c.output
    ref = reference.batches()
    c = uploads.c.batches()  # resumed at 4, SIGKILLed after 11: the same batches as the reference's
    assert [(b["batch"], b["ids"], b["loss"]) for b in c] == [
        (b["batch"], b["ids"], b["loss"]) for b in ref[SAVE_EVERY : HELD + 3]
    ]


def test_a_snapshot_is_the_state_at_its_save_whatever_trains_while_it_is_written(uploads, reference):
    # The write of 8 waited while 9 and 10 trained; the run resumed from it continues exactly.
    assert f"resuming run 'rs' from the checkpoint at batch {HELD}" in uploads.e.output
    runs = [(uploads.a, SAVE_EVERY), (uploads.c, HELD), (uploads.e, MAX_BATCHES)]  # each up to its save
    combined = [
        (b["batch"], b["ids"], b["loss"]) for run, upto in runs for b in run.batches() if b["batch"] <= upto
    ]
    combined = sorted(set(combined))  # a's and c's batches up to the save each resumed from
    assert combined == [(b["batch"], b["ids"], b["loss"]) for b in reference.batches()]
    assert [b["batch"] for b in uploads.e.batches()][0] == HELD + 1
    assert_same_weights(reference.weights, uploads.e.weights)


def test_the_next_save_waits_for_the_upload_in_flight_and_says_so(uploads):
    assert uploads.b_waited


def test_a_failed_background_upload_ends_the_run_at_the_next_save_with_one_storage_line(uploads):
    b = uploads.b
    assert b.returncode == 1, b.output[-4000:]
    errors = [line for line in b.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, b.output[-4000:]
    assert errors[0].startswith(f"error: could not store checkpoint {uploads.save} (batch {HELD}):")
    assert "rerun the same command" in errors[0]
    assert "Traceback" not in b.output
    assert [row["batch"] for row in b.batches()][-1] == MAX_BATCHES  # it failed at the save at 12


def test_the_same_command_then_finishes_and_only_complete_checkpoints_are_kept(uploads):
    assert uploads.e.returncode == 0, uploads.e.output[-4000:]
    # num_to_keep 2: the run's last two complete checkpoints; nothing of the failed or killed saves
    assert uploads.e_manifests == [f"ba{b:010d}-rank00000.json" for b in (2 * SAVE_EVERY, MAX_BATCHES)]


def test_a_restart_prints_where_its_time_went_phase_by_phase(uploads):
    lines = [x for x in uploads.c.output.splitlines() if x.startswith("[restart]")]
    assert len(lines) == 1, uploads.c.output[-3000:]
    line = lines[0]
    assert line.startswith(f"[restart] resumed at batch {SAVE_EVERY}, first step ")
    parts = restart.parse(line)
    assert list(parts) == [*restart.LABELS, "total"], line
    assert abs(sum(parts[p] for p in restart.LABELS) - parts["total"]) < 0.5, line  # adjacent phases
    # c restarts on the node a and b ran on: the checkpoint at 4, stored by a, is this node's copy
    assert "checkpoint fetch" in line and "(1 file(s), " in line and "this node's copy, verified" in line


def test_sigterm_waits_for_a_pending_upload_at_most_the_bound_names_the_resume_point_and_exits_143(uploads):
    # Issue 36 item 6b: the wait ended in rc 1 and no [preemption] line (after the whole outage
    # budget when the storage hung): a preemption exits 143 and says where the next run starts.
    d = uploads.d
    assert d.returncode == 143, d.output[-4000:]
    lines = [line for line in d.output.splitlines() if line.strip()]
    assert lines[-1].startswith("[preemption] SIGTERM: the checkpoint at batch 6 was not stored within "), (
        lines[-3:]
    )
    assert (
        f"the checkpoint at batch {SAVE_EVERY} before it: its upload did not finish within 2 s" in lines[-1]
    )
    assert "no checkpoint is complete: the next run starts from scratch and redoes batches 1-6" in lines[-1]
    assert not [line for line in lines if line.startswith("error:")]
    assert "Traceback" not in d.output


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(uploads):
    # Issue 36 item 2: `llm-ckpt-rank0-*` of a SIGKILLed run (10.5 GB per rank at 7B) stayed.
    # Beside it, the node's copy of the checkpoint a stored (4) stays for the next start (issue 42).
    kept, left = uploads.a_staging  # sorted
    assert left.startswith(f"llm-ckpt-rank0-{uploads.a_pid}-"), uploads.a_staging
    assert kept.startswith("llm-ckpt-copy-"), uploads.a_staging
    # b removed a's staging folder (and e c's); e finished the run, so its copy went too
    assert uploads.e_staging == [], uploads.e_staging


def test_with_a_notice_too_short_for_a_save_none_is_started_and_the_resume_point_is_named(uploads):
    f = uploads.f
    assert f.returncode == 143, f.output[-4000:]
    last = [line for line in f.output.splitlines() if line.strip()][-1]
    assert last.startswith(
        "[preemption] SIGTERM: no checkpoint saved at batch 6 (no save started: it would take about"
    ), last
    assert "at this run's rates (measured)" in last and "the 3 s notice leaves (preemption.notice_s" in last
    assert f"the next run resumes from the checkpoint at batch {SAVE_EVERY} and redoes batches 5-6" in last
    assert not [k for k in uploads.f_keys if "ba6" in k or "ba0000000006" in k], (
        uploads.f_keys
    )  # no half save
    assert f"manifests/ba{SAVE_EVERY:010d}-rank00000.json" in uploads.f_keys
    assert f.seconds < 3, f"exit took {f.seconds:.1f} s after the signal; the platform kills at 3 s"


def test_with_a_notice_the_process_ends_within_it_even_while_an_older_upload_is_in_flight(uploads):
    # Issue 39 item 3: with notice_s=4, margin_s=1 the line said no save would fit, then the process
    # lived 84-87 s more: its exit waited for the older upload's transfer threads.
    g = uploads.g
    assert g.returncode == 143, g.output[-4000:]
    last = [line for line in g.output.splitlines() if line.strip()][-1]
    assert last.startswith(
        f"[preemption] SIGTERM: the checkpoint at batch {SAVE_EVERY + 1} was not stored"
    ), last
    assert f"(the checkpoint at batch {SAVE_EVERY} before it: its upload did not finish within" in last
    assert "no checkpoint is complete: the next run starts from scratch" in last
    assert g.seconds < 4, f"exit took {g.seconds:.1f} s after the signal; the platform kills at 4 s"
