"""The restart's parts, in-process (issue 42): the `[restart]` line (llm/checkpoint/restart.py), the
restart's seconds carried in the manifests for `auto`'s line (llm/checkpoint/schedule.py) and what a
training process's start skips (llm/startup.py).

The line of a real resumed run is asserted in tests/llm/checkpoint/test_checkpoint_background.py
(its parts adjacent, adding up to the total; this node's copy) and tests/e2e/test_resume_s3.py (a
download on an empty machine); `auto`'s line after a restart in tests/e2e/test_resume.py.
"""

from __future__ import annotations

import gc
import time

import pytest

from llm import startup
from llm.checkpoint import restart
from llm.checkpoint.schedule import SaveCosts, SaveSchedule


@pytest.fixture
def clean_marks(monkeypatch):
    """Empty restart marks and counters for the test (they are process-wide), put back after."""
    monkeypatch.setattr(restart, "MARKS", {})
    monkeypatch.setattr(restart, "DOWNLOADED", {"files": 0, "bytes": 0, "seconds": 0.0})
    monkeypatch.setattr(restart, "REUSED", {"files": 0, "bytes": 0})


def test_the_line_has_eight_adjacent_parts_that_add_up_to_the_total_and_reads_back(clean_marks, monkeypatch):
    start = time.time() - 10.0
    monkeypatch.setattr(restart, "process_start_time", lambda: start)
    restart.MARKS["process"] = start
    offsets = (3.0, 3.5, 4.25, 5.0, 6.0, 6.5, 7.0, 9.5)  # each mark's time after the process's start
    names = ("setup", "process_group", "checkpoint", "trainer_init", "before_load", "loaded")
    for name, at in zip((*names, "first_batch", "first_step"), offsets, strict=True):
        restart.MARKS[name] = start + at
    restart.record_download(1, 10_500_000, 0.5)
    line = restart.describe(42)
    assert line.startswith("[restart] resumed at batch 42, first step 9.5 s after the process started: ")
    assert "checkpoint fetch 0.8 s (1 file(s), 10.5 MB downloaded at 21.0 MB/s)" in line, line
    parts = restart.parse(line)
    assert list(parts) == [*restart.LABELS, "total"]
    expected = [3.0, 0.5, 0.75, 0.75, 1.0, 0.5, 0.5, 2.5]
    assert [parts[p] for p in restart.LABELS] == pytest.approx(expected, abs=0.051)
    assert parts["total"] == 9.5 and sum(expected) == 9.5
    assert restart.total_s() == pytest.approx(9.5)

    restart.record_reuse(1, 10_500_000)  # this node's copy: said instead of a download
    assert "checkpoint fetch 0.8 s (1 file(s), 10.5 MB: this node's copy, verified)" in restart.describe(42)


def test_an_older_versions_line_reads_back_with_its_own_labels():
    # What bench.soak_goodput --before reads of code before issue 42
    old = (
        "[restart] resumed at batch 6, first step 19.4 s after the process started: imports 14.0 s, "
        "checkpoint 1.4 s (1 file(s), 61.5 MB downloaded at 64.5 MB/s), data and model 0.6 s, "
        "Trainer and load 1.5 s, loader resume 0.0 s, first step 1.9 s"
    )
    assert restart.parse(f"some output\n{old}\nmore") == {
        "imports": 14.0,
        "checkpoint": 1.4,
        "data and model": 0.6,
        "Trainer and load": 1.5,
        "loader resume": 0.0,
        "first step": 1.9,
        "total": 19.4,
    }
    assert restart.parse("no restart line here") is None


def test_the_restart_is_carried_in_the_manifest_and_auto_says_what_a_preemption_costs():
    costs = SaveCosts(0.2, 3.0, measured=True, step_s=0.5, restart_s=12.3456789)
    record = costs.record_of()
    assert record["restart_s"] == 12.345679
    carried = SaveCosts.from_record(record, batch=40)
    assert carried.restart_s == 12.345679 and carried.carried_from == 40
    # A manifest written before issue 42 (no restart_s) or edited (not a positive number) reads as
    # before, without a restart
    older = {k: v for k, v in record.items() if k != "restart_s"}
    assert SaveCosts.from_record(older, 40).restart_s is None
    assert SaveCosts.from_record({**record, "restart_s": -1}, 40).restart_s is None
    assert SaveCosts.from_record({**record, "restart_s": "nan"}, 40).restart_s is None

    line = SaveSchedule("auto", 0.01, carried).describe(10, 0.5)
    # half of 10 steps of 0.5 s plus the save in flight (3 s), then the restart
    assert "a preemption without notice costs on average 5.5 s of work" in line, line
    assert line.endswith("+ 12.3 s of restart (the run's last, measured)"), line
    # The restart is paid once per preemption whatever the interval: it does not move the interval
    assert carried.interval(0.5, 0.01) == SaveCosts(0.2, 3.0, measured=True).interval(0.5, 0.01)
    fresh = SaveSchedule("auto", 0.01, SaveCosts(0.2, 3.0)).describe(10, 0.5)
    assert fresh.endswith("+ the restart (none measured yet)"), fresh


def test_the_collector_waits_for_the_first_step(monkeypatch):
    if not gc.isenabled():
        pytest.skip("the collector is off in this process")
    monkeypatch.setattr(startup, "_held", False)
    frozen = gc.get_freeze_count()
    try:
        startup.begin()
        assert not gc.isenabled()
        startup.settled()
        assert gc.isenabled() and gc.get_freeze_count() == frozen  # nothing frozen: see llm/startup.py
        startup.settled()  # once only
        assert gc.isenabled()
    finally:
        gc.enable()


def test_a_collector_turned_off_by_someone_else_stays_off(monkeypatch):
    monkeypatch.setattr(startup, "_held", False)
    gc.disable()
    try:
        startup.begin()
        startup.settled()
        assert not gc.isenabled()  # not ours to turn on
    finally:
        gc.enable()


def test_the_cpu_name_comes_from_proc_cpuinfo_without_a_second_interpreter(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU @ 2.0GHz\n\nmodel name\t: other\n"
    )
    assert startup.cpu_model_name(str(info)) == "Test CPU @ 2.0GHz"
    (tmp_path / "none").write_text("processor\t: 0\n")
    assert startup.cpu_model_name(str(tmp_path / "none")) is None
    assert startup.cpu_model_name(str(tmp_path / "absent")) is None

    from composer.utils import collect_env

    # Composer's own lookup (an earlier training run in this process may have answered it quickly)
    monkeypatch.setattr(collect_env, "get_cpu_model", lambda: "py-cpuinfo's answer")
    monkeypatch.setattr(startup, "cpu_model_name", lambda: "Test CPU @ 2.0GHz")
    startup.quick_cpu_model()
    assert collect_env.get_cpu_model() == "Test CPU @ 2.0GHz"
