"""Run records beside the checkpoints: a run interrupted any number of times, each time on an empty
machine, ends with the metrics.jsonl of an uninterrupted run; `llm plot` reads runs from S3 too."""

# ruff: noqa: F811  (pytest injects the imported fixtures by argument name)

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from resume_support import MAX_BATCHES, SAVE_EVERY, interrupt, run, shards, write_recipe  # noqa: F401
from train_fixtures import read_metrics

from llm.run_dir import cut_after

# metrics.jsonl every 3 steps: a stop at batch 4 or 5 falls between two lines, and the checkpoint
# at 8 between the lines at 6 and 9.
RECORDS = ["loggers.metrics_file=true", "training.log_interval=3", "callbacks.loss_plot=true"]
SAME = ("step", "tokens", "loss", "lr")  # what an interrupted run must reproduce (tokens/s is timing)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shards) -> list[dict]:
    folder = tmp_path_factory.mktemp("records-reference")
    recipe = write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    result = run(recipe, "reference", cwd=folder, overrides=RECORDS)
    assert result.returncode == 0, result.output[-4000:]
    return read_metrics(folder / "runs" / "rs" / "metrics.jsonl")


def _same_records(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [3, 6, 9, 12]
    for a, b in zip(got, want, strict=True):
        for key in SAME:
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a, b)


@pytest.mark.s3
def test_records_survive_two_interruptions_on_empty_machines(
    tmp_path, shards, uninterrupted, s3_server, s3_bucket
):
    save = f"s3://{s3_bucket}/runs/rs"

    def machine(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        write_recipe(folder / "recipe.yaml", shards, save, cache=folder / "cache")
        return folder

    a = machine("a")
    first = interrupt(a / "recipe.yaml", "first", cwd=a, at_batch=4, sig=signal.SIGTERM, overrides=RECORDS)
    assert first.returncode == 143, first.output[-4000:]
    stop = first.batches()[-1]["batch"]
    assert stop in (4, 5)
    stored = s3_server.keys(s3_bucket, "runs/rs/records/")
    assert {f"runs/rs/records/{n}" for n in ("metrics.jsonl", "config.yaml", "loss.png")} <= set(stored)
    shutil.rmtree(a)

    b = machine("b")  # resumes at the SIGTERM's checkpoint, then is killed without a checkpoint
    second = interrupt(b / "recipe.yaml", "second", cwd=b, at_batch=10, sig=signal.SIGKILL, overrides=RECORDS)
    assert second.returncode == -signal.SIGKILL
    assert f"from the checkpoint at batch {stop}" in second.output
    assert [r["step"] for r in read_metrics(b / "runs" / "rs" / "metrics.jsonl")] == [3, 6, 9]
    shutil.rmtree(b)

    c = machine("c")  # resumes at batch 8: the bucket's records hold steps 3 and 6, step 9 comes again
    third = run(c / "recipe.yaml", "third", cwd=c, overrides=RECORDS)
    assert third.returncode == 0, third.output[-4000:]
    assert f"from the checkpoint at batch {2 * SAVE_EVERY}" in third.output
    _same_records(read_metrics(c / "runs" / "rs" / "metrics.jsonl"), uninterrupted)
    bucket_copy = s3_server.client().get_object(Bucket=s3_bucket, Key="runs/rs/records/metrics.jsonl")
    (tmp_path / "stored.jsonl").write_bytes(bucket_copy["Body"].read())
    _same_records(read_metrics(tmp_path / "stored.jsonl"), uninterrupted)

    # The comparison reads the run straight from the bucket, beside the reference run on disk.
    from llm.commands import main

    out = tmp_path / "compare.png"
    assert main(["plot", save, str(tmp_path / "stored.jsonl"), "--out", str(out)]) == 2  # a file, not a run
    assert main(["plot", save, "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_resume_on_the_same_machine_cuts_the_lines_past_the_checkpoint(tmp_path, shards, uninterrupted):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    killed = interrupt(recipe, "first", cwd=tmp_path, at_batch=7, sig=signal.SIGKILL, overrides=RECORDS)
    assert killed.returncode == -signal.SIGKILL
    metrics = tmp_path / "runs" / "rs" / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(metrics)] == [3, 6]  # 6 is past the checkpoint at 4

    resumed = run(recipe, "second", cwd=tmp_path, overrides=RECORDS)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"from the checkpoint at batch {SAVE_EVERY}" in resumed.output
    _same_records(read_metrics(metrics), uninterrupted)
    assert len(read_metrics(metrics)) == len({r["step"] for r in read_metrics(metrics)}) == MAX_BATCHES // 3


def test_cut_after_keeps_lines_up_to_the_step_and_drops_torn_ones(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 2, "text": "a"}\n{"step": 4, "text": "b"}\n{"step": 6, "te')
    assert cut_after(path, 4) == 2
    assert path.read_text() == '{"step": 2, "text": "a"}\n{"step": 4, "text": "b"}\n'
    assert cut_after(tmp_path / "absent.jsonl", 4) == 0 and not (tmp_path / "absent.jsonl").exists()
