"""Checkpoints and run records on s3:// (loopback moto server): a run interrupted twice, each time
resumed on an empty machine, ends as the uninterrupted run; stale local copies never win; `llm plot`
reads runs from S3 too.

One scenario, run once for the module (`three_machines`), with the run's records on:
machine a is stopped by SIGTERM after batch 5; machine b, with nothing on disk but the recipe and
the data, resumes at 5 and is SIGKILLed after batch 10 (past the checkpoint at 8, without a
checkpoint of its own); machine c, which holds a stale local copy of an older checkpoint where
Composer's autoresume would leave one, resumes at 8 and finishes. The tests assert on each step.
"""

from __future__ import annotations

import json
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.resume import (
    RECORDS,
    SAVE_EVERY,
    Run,
    assert_same_records,
    assert_same_weights,
    interrupt,
    run,
    write_recipe,
)
from tests.support.training import read_metrics

pytestmark = [pytest.mark.s3, pytest.mark.slow]

STOP = 5  # machine a's SIGTERM: a checkpoint of its own, between the periodic ones at 4 and 8


@dataclass
class ThreeMachines:
    save: str
    bucket: str
    root: Path
    a: Run
    keys_after_a: list[str]
    latest_after_a: dict
    b: Run
    steps_on_b: list[int]  # b's metrics.jsonl before it was killed
    c: Run
    stale: Path  # the stale local copy planted on machine c
    c_scratch_left: list[str]  # checkpoint copies left in c's temp folder
    records_on_c: list[dict] = field(default_factory=list)
    b_copies: list[str] = field(default_factory=list)  # b's node copy once it was killed


def _machine(root: Path, name: str, shards: Path, save: str) -> Path:
    folder = root / name
    (folder / "tmp").mkdir(parents=True)  # its temp folder: what a node keeps (its checkpoint copy)
    write_recipe(folder / "recipe.yaml", shards, save, cache=folder / "cache")
    return folder


@pytest.fixture(scope="module")
def three_machines(tmp_path_factory, shards, s3_server) -> ThreeMachines:
    root = tmp_path_factory.mktemp("three-machines")
    bucket = s3_server.create_bucket("three-machines")
    save = f"s3://{bucket}/runs/rs"
    client = s3_server.client()

    a = _machine(root, "a", shards, save)
    first = interrupt(
        a / "recipe.yaml", "a", cwd=a, at_batch=STOP, sig=signal.SIGTERM, overrides=RECORDS,
        env={"TMPDIR": str(a / "tmp")},
    )  # fmt: skip
    keys = s3_server.keys(bucket, "runs/rs/")
    latest = json.loads(client.get_object(Bucket=bucket, Key="runs/rs/latest.json")["Body"].read())
    first.record = Path(shutil.copy(first.record, root / "a.jsonl"))  # kept apart from the machine
    shutil.rmtree(a)  # the run's own files are gone with the machine

    b = _machine(root, "b", shards, save)
    second = interrupt(
        b / "recipe.yaml", "b", cwd=b, at_batch=10, sig=signal.SIGKILL, overrides=RECORDS,
        env={"TMPDIR": str(b / "tmp")},
    )  # fmt: skip
    b_copies = sorted(p.name for p in (b / "tmp").glob("llm-ckpt-copy-*/*"))
    steps_on_b = [r["step"] for r in read_metrics(b / "runs" / "rs" / "metrics.jsonl")]

    c = _machine(root, "c", shards, save)
    # What Composer's autoresume leaves behind: ./s3:/<bucket>/<prefix>/latest-rank0.pt, an older save.
    stale = c / f"s3:/{bucket}/runs/rs"
    stale.mkdir(parents=True)
    client.download_file(bucket, f"runs/rs/ep0-ba{STOP}-rank0.pt", str(stale / "latest-rank0.pt"))
    scratch = c / "tmp"  # the run's temp folder: the verified download, the save staging
    third = run(c / "recipe.yaml", "c", cwd=c, overrides=RECORDS, env={"TMPDIR": str(scratch)})
    left = [p.name for p in scratch.iterdir() if p.name.startswith(("llm-resume-", "llm-ckpt-"))]
    records = read_metrics(c / "runs" / "rs" / "metrics.jsonl")
    return ThreeMachines(
        save, bucket, root, first, keys, latest, second, steps_on_b, third, stale, left, records, b_copies
    )


def test_sigterm_on_s3_stores_the_interrupted_batch_in_the_bucket(three_machines):
    m = three_machines
    assert m.a.returncode == 143, m.a.output[-4000:]
    assert m.a.batches()[-1]["batch"] == STOP
    assert f"runs/rs/manifests/ba{STOP:010d}-rank00000.json" in m.keys_after_a
    assert m.latest_after_a["batch"] == STOP
    assert {f"runs/rs/records/{n}" for n in ("metrics.jsonl", "config.yaml", "loss.png")} <= set(
        m.keys_after_a
    )


def test_an_empty_machine_with_only_the_bucket_resumes_at_the_sigterms_checkpoint(three_machines, reference):
    m = three_machines
    assert m.b.returncode == -signal.SIGKILL
    assert f"resuming run 'rs' from the checkpoint at batch {STOP}" in m.b.output
    (line,) = [x for x in m.b.output.splitlines() if x.startswith("[restart]")]
    assert "checkpoint fetch" in line and "(1 file(s), " in line and "MB downloaded at" in line  # from S3
    # What b stored last (the checkpoint at 8) stays on its disk for a restart there; c has none.
    assert m.b_copies == [f"ep0-ba{2 * SAVE_EVERY}-rank0.pt"], m.b_copies
    resumed, ref = m.b.batches(), reference.batches()
    assert [b["batch"] for b in resumed] == list(range(STOP + 1, 11))
    assert [b["ids"] for b in resumed] == [b["ids"] for b in ref[STOP:10]]
    assert [b["loss"] for b in resumed] == [b["loss"] for b in ref[STOP:10]]


def test_a_stale_local_s3_copy_never_wins_over_the_newer_remote_checkpoint(three_machines, reference):
    m = three_machines
    assert m.c.returncode == 0, m.c.output[-4000:]
    assert "removing the stale local checkpoint copy" in m.c.output
    assert not m.stale.exists()
    assert f"resuming run 'rs' from the checkpoint at batch {2 * SAVE_EVERY}" in m.c.output
    # a's batches to 5, b's from 6 to 8 and c's from 9 on are the uninterrupted run's, batch by batch.
    done = m.a.batches() + [b for b in m.b.batches() if b["batch"] <= 2 * SAVE_EVERY]
    combined, ref = done + m.c.batches(), reference.batches()
    assert [b["batch"] for b in combined] == [b["batch"] for b in ref]
    assert [b["ids"] for b in combined] == [b["ids"] for b in ref], "sample order differs"
    assert [b["loss"] for b in m.c.batches()] == [b["loss"] for b in ref[2 * SAVE_EVERY :]], "losses differ"
    assert_same_weights(reference.weights, m.c.weights)


def test_a_resumed_run_leaves_no_checkpoint_copy_in_its_temp_folder(three_machines):
    assert three_machines.c.returncode == 0, three_machines.c.output[-4000:]
    assert not three_machines.c_scratch_left, f"checkpoint copies left: {three_machines.c_scratch_left}"


def test_records_survive_two_interruptions_on_empty_machines(three_machines, reference, s3_server, tmp_path):
    m = three_machines
    uninterrupted = read_metrics(reference.record.parent / "runs" / "rs" / "metrics.jsonl")
    # b resumed at 5 from the bucket's records (step 3), then logged 6 and 9 before it was killed.
    assert m.steps_on_b == [3, 6, 9]
    # c resumed at 8: the bucket's records held steps 3 and 6, step 9 came again.
    assert_same_records(m.records_on_c, uninterrupted)
    stored = s3_server.client().get_object(Bucket=m.bucket, Key="runs/rs/records/metrics.jsonl")
    (tmp_path / "stored.jsonl").write_bytes(stored["Body"].read())
    assert_same_records(read_metrics(tmp_path / "stored.jsonl"), uninterrupted)

    # The comparison reads the run straight from the bucket, beside the reference run on disk.
    from llm.commands import main

    out = tmp_path / "compare.png"
    assert main(["plot", m.save, str(tmp_path / "stored.jsonl"), "--out", str(out)]) == 2  # a file, not a run
    assert main(["plot", m.save, "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
