"""The merge of multi-machine tasks (convert/run/merge.py): its de-duplication stages by partition
and its ordered pass give the golden record's bytes for any partitions, workers, spilled runs and
ids past 2**32; a killed merge re-run ends as a fresh one; damaged task files and tasks re-run with
other options are named in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from convert.errors import ConvertError
from convert.run import merge as merge_module
from convert.run.jobs import TaskSpec, convert_corpus, merge_tasks
from tests.support.conversion import REPO_ROOT, local_samples
from tests.support.golden import RECORD, digests, options, write_corpus

pytestmark = pytest.mark.slow  # worker processes

TASKS = 3  # the golden corpus has two files: one task gets none


@pytest.fixture(scope="module")
def golden_tasks(tmp_path_factory, chinese_documents, small_tokenizer) -> dict:
    """The golden corpus converted as 3 tasks, once per case, and as 3 tasks that spill their runs
    every few hundred bytes (and keep at most 30 digests for their exact de-duplication)."""
    record = json.loads(RECORD.read_text())
    root = tmp_path_factory.mktemp("merge")
    inputs = write_corpus(root, chinese_documents)
    made = {"record": record, "inputs": inputs}
    for label, near, budget in (("plain", False, 0), ("near_filters", True, 0), ("spilled", True, 12_000)):
        out = root / label
        opts = dataclasses.replace(options(near, 1, False), memory_budget=budget)
        made[label] = [
            convert_corpus(
                inputs, tokenizer=small_tokenizer, out=str(out), options=opts, task=TaskSpec(TASKS, i)
            )
            for i in range(TASKS)
        ]
        made[f"{label}_tasks"] = out / "tasks"
    return made


def copy_tasks(golden_tasks: dict, label: str, out: Path) -> Path:
    shutil.copytree(golden_tasks[f"{label}_tasks"], out / "tasks")
    return out


def merged(golden_tasks: dict, label: str, out: Path, **kwargs):
    copy_tasks(golden_tasks, label, out)
    return merge_tasks(str(out), progress=False, **kwargs)


@pytest.mark.parametrize(("label", "near"), [("plain", False), ("near_filters", True)])
def test_any_partitions_and_workers_merge_to_the_record(golden_tasks, tmp_path, label, near):
    record = golden_tasks["record"]["cases"][label]
    runs = {}
    for partitions, workers in (((1, 1), 1), ((3, 7), 2), ((16, 2), 1)):
        out = tmp_path / f"{partitions[0]}-{partitions[1]}-{workers}"
        runs[out.name] = merged(golden_tasks, label, out, partitions=partitions, workers=workers)
        assert digests(out) == record, out.name
        plan = json.loads((out / "merge" / "plan.json").read_text())
        assert (plan["exact_partitions"], plan["near_partitions"]) == (
            partitions[0],
            partitions[1] if near else 0,
        )
    summaries = list(runs.values())
    assert all(
        s.dropped == summaries[0].dropped and s.dropped_tokens == summaries[0].dropped_tokens
        for s in summaries
    )
    assert summaries[0].dropped["duplicate"] == 26  # as one machine (test_convert_golden.py)
    if near:
        reports = {(tmp_path / name / "near_duplicates.json").read_bytes() for name in runs}
        assert len(reports) == 1 and summaries[0].near_dedup.pairs_in_report > 0


def test_tasks_that_spill_many_runs_merge_to_the_record(golden_tasks, tmp_path):
    """A tiny budget in the tasks: many sorted runs per task, an exact-duplicate set that stops
    growing (later copies left to the merge): the same bytes, counts and pair report."""
    spilled, whole = golden_tasks["spilled"], golden_tasks["near_filters"]
    assert all(len(m.key_runs) > 10 and len(m.digest_runs) > 3 for m in spilled if m.rows)
    assert sum(m.dropped.get("duplicate", 0) for m in spilled) < sum(
        m.dropped.get("duplicate", 0) for m in whole
    )
    a = merged(golden_tasks, "spilled", tmp_path / "spilled", partitions=(2, 3))
    b = merged(golden_tasks, "near_filters", tmp_path / "whole", partitions=(2, 3))
    assert digests(tmp_path / "spilled") == golden_tasks["record"]["cases"]["near_filters"]
    assert a.dropped == b.dropped and a.dropped_tokens == b.dropped_tokens
    report = (tmp_path / "spilled" / "near_duplicates.json").read_bytes()
    assert report == (tmp_path / "whole" / "near_duplicates.json").read_bytes()


def test_rows_pids_and_positions_past_2_to_the_32(golden_tasks, tmp_path, monkeypatch):
    """Every id starts just below 2**32 and crosses it: the same bytes; the pair report's
    positions are the same plus the start."""
    base = (1 << 32) - 100
    monkeypatch.setattr(merge_module, "ID_BASE", base)
    merged(golden_tasks, "near_filters", tmp_path / "high", partitions=(2, 3), workers=2)
    monkeypatch.setattr(merge_module, "ID_BASE", 0)
    merged(golden_tasks, "near_filters", tmp_path / "low", partitions=(2, 3))
    assert digests(tmp_path / "high") == golden_tasks["record"]["cases"]["near_filters"]
    high, low = (json.loads((tmp_path / n / "near_duplicates.json").read_text()) for n in ("high", "low"))
    positions = [(p["kept"]["position"], p["removed"]["position"]) for p in low["pairs"]]
    assert [(p["kept"]["position"], p["removed"]["position"]) for p in high["pairs"]] == [
        (k + base, r + base) for k, r in positions
    ]
    assert max(r for _, r in positions) + base >= 1 << 32  # the removed documents cross the boundary


def test_the_budget_sets_the_partitions():
    """One partition in every worker at once fits what the ordered pass leaves of the budget."""
    from convert.dedup.stages import EXACT_BYTES_PER_ENTRY, NEAR_BYTES_PER_ENTRY

    tasks = merge_module.Tasks.of([_counted(rows=10_000_000, passing=9_000_000, bands=26)])
    budget = 256 << 20
    plan = merge_module.plan_stages(tasks, budget, 2, True, None)
    share = int((budget - merge_module.main_bytes(tasks, budget, 2)) * merge_module.HEADROOM) // 2
    assert (
        plan.near_partitions * share
        >= 9_000_000 * 26 * NEAR_BYTES_PER_ENTRY
        > (plan.near_partitions - 1) * share
    )
    assert (
        plan.exact_partitions * share
        >= 10_000_000 * EXACT_BYTES_PER_ENTRY
        > (plan.exact_partitions - 1) * share
    )
    assert merge_module.plan_stages(tasks, 8 << 30, 4, True, None).near_partitions < plan.near_partitions
    with pytest.raises(ConvertError, match=r"--memory-budget 4.0 MiB leaves less than 16.0 KiB per worker"):
        merge_module.plan_stages(tasks, 4 << 20, 2, True, None)  # the bitmaps alone: 4.6 MiB
    with pytest.raises(
        ConvertError, match=r"--memory-budget 7.6 MiB would need [\d,]+ partitions \(at most 65,536\)"
    ):
        merge_module.plan_stages(tasks, int(7.6 * (1 << 20)), 2, True, None)


def _counted(rows: int, passing: int, bands: int):
    from convert.dedup.runs import RunInfo

    @dataclasses.dataclass
    class Counted:
        rows: int
        passing: int
        digest_runs: list
        key_runs: list

        def to_json(self) -> dict:
            return {"rows": self.rows}

    return Counted(rows, passing, [RunInfo(name="d", entries=rows, bytes=0)],
                   [RunInfo(name="k", entries=passing * bands, bytes=0)])  # fmt: skip


# --- kill and re-run -------------------------------------------------------------------------------


def test_a_merge_resumes_from_any_stage_and_takes_nothing_half_written(golden_tasks, tmp_path):
    """What a merge killed at each point leaves: stage jobs done, one job's files written but not
    its marker, one marked but truncated, parts written, no index, temporary files of its killed
    writers. The re-run ends with the record and removes those temporary files."""
    out = tmp_path / "out"
    merged(golden_tasks, "near_filters", out, partitions=(3, 4))
    stage = out / "merge"
    (stage / "exact-00001.json").unlink()  # killed after the job's files, before its marker
    run = stage / "near-00002.run"
    run.write_bytes(run.read_bytes()[:-10])  # a torn file under a marker (a foreign writer, a disk fault)
    (stage / "near-00003.json").unlink()
    (stage / "near-00003.run").unlink()
    for split in ("train", "val"):
        (out / split / "index.json").unlink()
    (out / "summary.json").unlink()
    shutil.rmtree(out / "train" / "part-00002")
    # what writers killed mid-write leave (a stage job's output, the summary, an index), and a
    # live process's temporary file (another merge of this output): only the dead ones' go
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(gone.stdout)
    stale = [stage / f".exact-00001.pids.run.tmp-{dead}-0a1b2c3d", stage / f".near-00003.run.tmp-{dead}-00ff00ff",
             out / f".summary.json.tmp-{dead}-12345678", out / "train" / f".index.json.tmp-{dead}-9abcdef0"]  # fmt: skip
    for path in stale:
        path.write_bytes(b"\0" * 4096)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = stage / f".near-00002.run.tmp-{alive.pid}-0badf00d"
        live.write_bytes(b"\0" * 4096)
        resumed = merge_tasks(str(out), progress=False, partitions=(3, 4))
    finally:
        alive.kill()
        alive.wait()
    assert digests(out) == golden_tasks["record"]["cases"]["near_filters"]
    assert resumed.reused_parts > 0
    assert not any(path.exists() for path in stale) and live.exists()


def test_a_killed_merge_run_again_ends_as_a_fresh_one(tmp_path, chinese_documents, small_tokenizer):
    from tests.support.corpus import edited_copy, write_jsonl

    docs = list(chinese_documents)
    for n, i in enumerate(range(0, len(docs) // 2, 7)):
        docs.insert(len(docs) - n, edited_copy(docs[i], 0.01, n))
    half = len(docs) // 2
    write_jsonl(tmp_path / "in" / "a.jsonl", docs[:half])
    write_jsonl(tmp_path / "in" / "b.jsonl", docs[half:])
    out = tmp_path / "out"
    common = ["--tokenizer", small_tokenizer, "--seq-len", "64", "--workers", "1", "--chunk-chars", "20000",
              "--no-progress", "--near-dedup", "--filters"]  # fmt: skip
    for index in range(2):
        task = subprocess.run(
            [sys.executable, "-m", "convert", "shards", str(tmp_path / "in"), "--out", str(out), *common,
             "--num-tasks", "2", "--task-index", str(index)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert task.returncode == 0, task.stderr
    fresh = tmp_path / "fresh"
    shutil.copytree(out / "tasks", fresh / "tasks")
    merge = [
        sys.executable,
        "-m",
        "convert",
        "merge",
        "--workers",
        "2",
        "--no-progress",
        "--partitions",
        "24,24",
    ]
    for wait_for in (
        "merge/exact-00003.json",
        "train/part-00004/part.json",
    ):  # in the stages, then in the parts
        proc = subprocess.Popen([*merge, "--out", str(out)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 120
        while not (out / wait_for).exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert (out / wait_for).exists(), proc.stderr.read()
        assert not (out / "train" / "index.json").exists()
    resumed = subprocess.run(
        [*merge, "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "reused from the interrupted run" in resumed.stdout
    done = subprocess.run(
        [*merge, "--out", str(fresh)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert digests(out) == digests(fresh)
    for split in ("train", "val"):
        assert np.array_equal(local_samples(str(out), split), local_samples(str(fresh), split))
    assert (out / "near_duplicates.json").read_bytes() == (fresh / "near_duplicates.json").read_bytes()


# --- damaged files, tasks that differ -------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(
    ("name", "damage"),
    [("piece-00000.rows", _truncate), ("piece-00000.rows", _flip), ("piece-00000.tokens", _truncate),
     ("piece-00000.tokens", _flip), ("keys-00000.run", _flip), ("digests-00000.run", _truncate),
     ("sketches.u8", _flip), ("sample.json", _truncate), ("sample.json", _empty), ("sample.json", _flip)],
)  # fmt: skip
def test_a_damaged_task_file_is_one_line_naming_the_task_and_the_fix(golden_tasks, tmp_path, name, damage):
    out = copy_tasks(golden_tasks, "near_filters", tmp_path / "out")
    damaged = out / "tasks" / "task-00002" / name  # (task 1 has no input file)
    damage(damaged)
    with pytest.raises(ConvertError) as error:
        merge_tasks(str(out), progress=False)
    message = str(error.value)
    assert "\n" not in message and message.startswith("task 2's file ") and str(damaged) in message
    assert "run task 2 again" in message and "then merge" in message
    assert not (out / "train" / "index.json").exists()


def test_a_task_re_run_with_other_options_is_the_one_named(golden_tasks, tmp_path, small_tokenizer):
    """Task 0 re-run with another --seq-len: the merge names task 0, not the untouched tasks."""
    out = copy_tasks(golden_tasks, "plain", tmp_path / "out")
    opts = dataclasses.replace(options(False, 1, False), seq_len=128)
    convert_corpus(
        golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(out), options=opts, task=TaskSpec(TASKS, 0)
    )
    with pytest.raises(ConvertError, match=r"^task 0 differs from task 1 in seq_len \(128 vs 64\)"):
        merge_tasks(str(out), progress=False)


@pytest.mark.parametrize(("label", "near"), [("plain", False), ("near_filters", True)])
def test_one_machine_over_its_budget_converts_in_two_passes_to_the_record(
    golden_tasks, tmp_path, small_tokenizer, capsys, label, near
):
    """A one-machine conversion whose de-duplication state would pass --memory-budget runs as one
    task and a merge here: the record's bytes, the pair report of the in-memory run, nothing left
    of the task and the merge's files."""
    out = tmp_path / "out"
    opts = dataclasses.replace(options(near, 2, False), memory_budget=70_000)
    summary = convert_corpus(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(out), options=opts)
    printed = capsys.readouterr().out
    assert "more than the budget, so it runs in two passes" in printed and "merge: " in printed
    assert digests(out) == golden_tasks["record"]["cases"][label]
    assert not (out / "tasks").exists() and not (out / "merge").exists()
    in_memory = convert_corpus(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(tmp_path / "memory"),
                               options=options(near, 2, False))  # fmt: skip
    assert "in memory" in capsys.readouterr().out
    assert summary.dropped == in_memory.dropped and summary.splits == in_memory.splits
    if near:
        report = (out / "near_duplicates.json").read_bytes()
        assert report == (tmp_path / "memory" / "near_duplicates.json").read_bytes()


def test_two_passes_killed_after_the_task_reuse_it(golden_tasks, tmp_path, small_tokenizer, capsys):
    """What a two-pass conversion killed during its merge leaves: the finished task (and no index).
    The same command reuses the task, and a task with other settings is redone."""
    from convert.reading.options import ReadOptions
    from convert.run.tasks import run_task

    out = tmp_path / "out"
    opts = dataclasses.replace(options(True, 1, False), memory_budget=60_000)
    run_task(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(out), options=opts, read=ReadOptions(),
             task=TaskSpec(1, 0))  # fmt: skip
    capsys.readouterr()
    convert_corpus(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(out), options=opts)
    assert "task 0 of 1: finished by an earlier run, reused" in capsys.readouterr().out
    assert digests(out) == golden_tasks["record"]["cases"]["near_filters"]
    other = tmp_path / "other"
    run_task(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(other),
             options=dataclasses.replace(opts, seq_len=128), read=ReadOptions(), task=TaskSpec(1, 0))  # fmt: skip
    convert_corpus(golden_tasks["inputs"], tokenizer=small_tokenizer, out=str(other), options=opts)
    assert "finished by an earlier run" not in capsys.readouterr().out
    assert digests(other) == golden_tasks["record"]["cases"]["near_filters"]
