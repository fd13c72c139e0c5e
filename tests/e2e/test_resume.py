"""Autoresume from a local save_folder: SIGKILL + rerun continues bit-identically; safety; recipe changes.

One local scenario, run once for the module (`killed`): a run with its records on is SIGKILLed at
batch 7, the same command resumes it from the checkpoint at 4 and finishes, is started again (trains
nothing), and again with a longer max_duration, all four with a temp folder (TMPDIR) of their own.
The tests assert on what each step left.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from llm.config import load_config
from llm.errors import ConfigError
from tests.support.resume import (
    MAX_BATCHES,
    RECORDS,
    SAVE_EVERY,
    Run,
    assert_continues,
    assert_same_records,
    assert_same_weights,
    interrupt,
    run,
    write_recipe,
)
from tests.support.training import read_metrics


@dataclass
class Killed:
    folder: Path
    first: Run  # SIGKILLed after batch 7
    steps_after_kill: list[int]  # metrics.jsonl's steps then
    second: Run  # the same command: resumes at 4, finishes
    records_after_resume: list[dict]
    manifests_after_resume: list[str]
    again: Run  # the finished run started again
    changed: Run  # and again with optimizer.lr=1e-3
    longer: Run  # and again with training.max_duration=14ba
    tmp_after_kill: list[str]  # what the SIGKILLed run left in TMPDIR
    tmp_at_end: list[str]  # and what was there after the runs that followed it


@pytest.fixture(scope="module")
def killed(tmp_path_factory, shards) -> Killed:
    folder = tmp_path_factory.mktemp("killed")
    recipe = write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    metrics = folder / "runs" / "rs" / "metrics.jsonl"
    tmp = folder / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    first = interrupt(recipe, "first", cwd=folder, at_batch=7, sig=signal.SIGKILL, overrides=RECORDS, env=env)
    tmp_after_kill = sorted(p.name for p in tmp.iterdir())
    steps = [r["step"] for r in read_metrics(metrics)]
    second = run(recipe, "second", cwd=folder, overrides=RECORDS, env=env)
    assert second.returncode == 0, second.output[-4000:]
    records = read_metrics(metrics)
    manifests = sorted(p.name for p in (folder / "ckpt" / "manifests").iterdir())
    again = run(recipe, "again", cwd=folder, overrides=RECORDS, env=env)
    changed = run(recipe, "changed", cwd=folder, overrides=[*RECORDS, "optimizer.lr=1e-3"], env=env)
    longer = run(recipe, "longer", cwd=folder, overrides=[*RECORDS, "training.max_duration=14ba"], env=env)
    tmp_at_end = sorted(p.name for p in tmp.iterdir())
    return Killed(
        folder, first, steps, second, records, manifests, again, changed, longer, tmp_after_kill, tmp_at_end
    )


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_from_the_last_periodic_checkpoint_bit_identically(killed, reference):
    first, second = killed.first, killed.second
    assert first.returncode == -signal.SIGKILL
    assert first.batches()[-1]["batch"] < 2 * SAVE_EVERY
    assert f"[resume] resuming run 'rs' from the checkpoint at batch {SAVE_EVERY}" in second.output
    assert_continues(reference, first, second, SAVE_EVERY)
    assert_same_weights(reference.weights, second.weights)
    # num_to_keep=2 counts checkpoints of both processes, not only the last one's.
    assert killed.manifests_after_resume == [
        f"ba{b:010d}-rank00000.json" for b in (2 * SAVE_EVERY, MAX_BATCHES)
    ]


@pytest.mark.slow
def test_each_run_keeps_its_temp_files_in_a_folder_of_its_own_removed_at_exit_or_by_the_next_start(killed):
    # Issue 39 item 9: streaming's file locks (a pair per process) and torch's temp folders piled up
    # in TMPDIR with every restart. The SIGKILLed run could not remove its folder; the next one did.
    (left,) = killed.tmp_after_kill
    assert left.startswith(f"llm-tmp-{killed.first.pid}-"), killed.tmp_after_kill
    assert killed.tmp_at_end == [], killed.tmp_at_end


@pytest.mark.slow
def test_a_resume_on_the_same_machine_cuts_the_lines_past_the_checkpoint(killed, reference):
    assert killed.steps_after_kill == [3, 6]  # 6 is past the checkpoint at 4
    records = killed.records_after_resume
    assert_same_records(records, read_metrics(reference.record.parent / "runs" / "rs" / "metrics.jsonl"))
    assert len(records) == len({r["step"] for r in records}) == MAX_BATCHES // 3


@pytest.mark.slow
def test_a_finished_run_started_again_trains_nothing_more(killed):
    again = killed.again
    assert again.returncode == 0, again.output[-4000:]
    assert f"run 'rs' already finished: its checkpoint at batch {MAX_BATCHES} reached" in again.output
    assert again.batches() == []


@pytest.mark.slow
def test_a_finished_run_started_with_other_values_names_them_and_how_to_train_anew(killed):
    """`train.py recipes/demo.yaml optimizer.lr=1e-3` after `make demo` said only "already
    finished", the new value silently unused (issue 39)."""
    changed = killed.changed
    assert changed.returncode == 0, changed.output[-4000:]
    (line,) = [x for x in changed.output.splitlines() if "already finished" in x]
    assert "The recipe differs from the one it was trained with (optimizer.lr: 0.01 -> 0.001)" in line
    assert "these values were not used" in line
    assert (
        f"another run_name (e.g. run_name=rs-2) with a checkpoint.save_folder that holds no checkpoint (this run's is {killed.folder / 'ckpt'})"
        in line
    )
    assert "raise training.max_duration" in line
    assert changed.batches() == []
    assert "differs" not in killed.again.output  # the same recipe: the plain line


@pytest.mark.slow
def test_a_longer_max_duration_on_resume_trains_on_and_warns(killed):
    longer = killed.longer
    assert longer.returncode == 0, longer.output[-4000:]
    assert "training.max_duration: '12ba' -> '14ba'" in longer.output
    assert [b["batch"] for b in longer.batches()] == [13, 14]


@dataclass
class Intervals:
    clock: Run  # save_interval=1s, SIGKILLed after batch 7
    clock_point: int  # the checkpoint auto resumed from
    auto: Run  # save_interval=auto resumes, SIGKILLed after batch 10
    auto_point: int
    last: Run  # save_interval=auto again: resumes and finishes


def _resumed_at(run: Run) -> int:
    import re

    found = re.search(r"\[resume\] resuming run 'rs' from the checkpoint at batch (\d+)", run.output)
    assert found, run.output[-3000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def intervals(tmp_path_factory, shards) -> Intervals:
    """Saves by wall-clock time and by `auto` (llm/checkpoint/schedule.py), each killed after its
    saves and resumed: the interval decides only which batch a save falls on."""
    folder = tmp_path_factory.mktemp("intervals")
    recipe = write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    paced = {"LLM_TEST_BATCH_SLEEP": "0.25"}  # steps of ~0.3 s: a 1 s interval saves every few batches
    clock = interrupt(
        recipe, "clock", cwd=folder, at_batch=7, sig=signal.SIGKILL, env=paced,
        overrides=["checkpoint.save_interval=1s"],
    )  # fmt: skip
    # The saver's lines say which batches saved. max_stall 20%: the tiny model's snapshot is a large
    # share of its 0.3 s steps, and auto must save before the kill at 10.
    auto_env = {**paced, "LLM_TEST_LOG_INFO": "llm.checkpoint.saver"}
    by_auto = ["checkpoint.save_interval=auto", "checkpoint.max_stall=0.2"]
    auto = interrupt(
        recipe, "auto", cwd=folder, at_batch=10, sig=signal.SIGKILL, env=auto_env, overrides=by_auto
    )
    last = run(recipe, "last", cwd=folder, overrides=by_auto)
    return Intervals(clock, _resumed_at(auto), auto, _resumed_at(last), last)


@pytest.mark.slow
def test_saves_by_wall_clock_time_and_by_auto_resume_bit_identically(intervals, reference):
    assert intervals.clock.returncode == intervals.auto.returncode == -signal.SIGKILL
    assert 0 < intervals.clock_point <= 7  # the clock saved before the kill
    assert intervals.clock_point < intervals.auto_point <= 10  # and so did auto, after resuming
    cp, ap = intervals.clock_point, intervals.auto_point
    auto = intervals.auto.batches()  # killed after batch 10; resumed from what the clock saved
    assert [b["batch"] for b in auto] == list(range(cp + 1, 11))
    kept = [b for b in intervals.clock.batches() if b["batch"] <= cp] + [b for b in auto if b["batch"] <= ap]
    combined = kept + intervals.last.batches()
    assert [(b["batch"], b["ids"], b["loss"]) for b in combined] == [
        (b["batch"], b["ids"], b["loss"]) for b in reference.batches()
    ]
    assert [(b["ids"], b["loss"]) for b in auto] == [
        (b["ids"], b["loss"]) for b in reference.batches()[cp:10]
    ]
    assert intervals.last.returncode == 0, intervals.last.output[-4000:]
    assert_same_weights(reference.weights, intervals.last.weights)


@pytest.mark.slow
def test_auto_prints_the_interval_it_chose_and_why(intervals):
    lines = [
        x for x in intervals.auto.output.splitlines() if x.startswith("[checkpoint] save_interval auto:")
    ]
    assert lines, intervals.auto.output[-3000:]
    assert "a save stalls training" in lines[0] and "checkpoint.max_stall" in lines[0]


@pytest.mark.slow
def test_auto_after_a_restart_saves_at_the_interval_measured_before_it(intervals):
    # Issue 39 item 8: auto needed 3 steps measured anew before its first save after each restart,
    # estimating from the checkpoint's size; a run preempted soon after each restart lost it all.
    # The run before recorded its figures with its checkpoint (the clock's, at clock_point).
    import re

    cp, output = intervals.clock_point, intervals.auto.output
    first = next(x for x in output.splitlines() if x.startswith("[checkpoint] save_interval auto:"))
    assert f"costs measured before the restart (recorded with the checkpoint at batch {cp})" in first, first
    # Issue 42: what a preemption costs at that interval, the restart this run measured included
    assert re.search(
        r"costs on average [0-9.]+ s of work \(.*\) \+ [0-9.]+ s of restart \(the run's last, measured\)",
        first,
    ), first
    every = int(re.search(r"every (\d+) batch", first).group(1))
    saves = [int(b) for b in re.findall(r"checkpoint at batch (\d+): snapshot", output)]
    assert saves and saves[0] == cp + every, (saves, first)


def _cfg(tmp_path, *overrides):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", tmp_path / "shards", str(tmp_path / "ckpt"), cache=tmp_path / "cache"
    )
    return load_config(recipe, list(overrides))


def test_load_path_outside_save_folder_needs_the_untrusted_flag(tmp_path):
    from llm.checkpoint.resume import check_load_path_allowed

    outside = tmp_path / "elsewhere" / "ep0-ba4-rank0.pt"
    with pytest.raises(ConfigError, match="allow_untrusted_load_path=true"):
        check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={outside}"))
    with pytest.raises(ConfigError, match="outside checkpoint.save_folder"):
        check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={tmp_path}/ckpt/../x.pt"))
    with pytest.raises(ConfigError):
        cfg = _cfg(
            tmp_path, "checkpoint.save_folder=s3://bkt/run", "checkpoint.load_path=s3://bkt/runner/a.pt"
        )
        check_load_path_allowed(cfg)
    check_load_path_allowed(_cfg(tmp_path, f"checkpoint.load_path={tmp_path}/ckpt/ep0-ba4-rank0.pt"))
    check_load_path_allowed(
        _cfg(tmp_path, f"checkpoint.load_path={outside}", "checkpoint.allow_untrusted_load_path=true")
    )


def test_untrusted_load_path_is_refused_by_train_py_with_exit_code_2(tmp_path, shards, capsys):
    import train

    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    assert train.main([str(recipe), f"checkpoint.load_path={tmp_path}/other.pt"]) == 2
    err = capsys.readouterr().err
    assert "allow_untrusted_load_path=true" in err
    assert err.count("\n") == 1, err  # one line, no traceback


def test_each_recipe_change_since_the_checkpoint_is_reported_with_its_effect(tmp_path):
    from llm.checkpoint.resume import warn_recipe_changes

    saved = _cfg(tmp_path).to_dict()
    changed = _cfg(tmp_path, "optimizer.lr=0.5", "training.max_duration=20ba", "seed=3", "run_dir=/x")
    messages = warn_recipe_changes(json.loads(json.dumps(saved)), changed.to_dict())
    assert len(messages) == 3, messages
    by_key = {m.split(": ")[1]: m for m in messages}
    assert "checkpoint" in by_key["optimizer.lr"] and "ignored" in by_key["optimizer.lr"]
    assert "'12ba' -> '20ba'" in by_key["training.max_duration"]
    assert "recipe's new value applies" in by_key["training.max_duration"]
    assert "RNG state in the checkpoint" in by_key["seed"]
    assert warn_recipe_changes(json.loads(json.dumps(saved)), saved) == []
    # Documents kept apart from the resume point on: no part of the model's shape.
    apart = _cfg(tmp_path, "model.attention=document", "model.positions=document").to_dict()
    messages = warn_recipe_changes(json.loads(json.dumps(saved)), apart)
    assert [m.split(": ")[1] for m in messages] == ["model.attention", "model.positions"], messages
    assert all("new value applies from the resume point on" in m for m in messages)


def test_a_key_newer_than_the_checkpoint_is_a_change_only_away_from_its_default(tmp_path):
    """A checkpoint saved before `model.qkv_bias` existed trained without the biases: resuming it
    with the default says nothing; with the biases turned on, it is a change like any other."""
    from llm.checkpoint.resume import warn_recipe_changes

    saved = json.loads(json.dumps(_cfg(tmp_path).to_dict()))
    del saved["model"]["qkv_bias"]
    assert warn_recipe_changes(saved, _cfg(tmp_path).to_dict()) == []
    messages = warn_recipe_changes(saved, _cfg(tmp_path, "model.qkv_bias=true").to_dict())
    assert len(messages) == 1 and "model.qkv_bias: None -> True" in messages[0], messages


def test_setting_or_unsetting_embedding_lr_since_the_checkpoint_is_refused_in_one_line(tmp_path):
    """It adds or removes an optimizer parameter group: the saved optimizer state cannot load."""
    from llm.checkpoint.resume import refuse_optimizer_group_change

    plain = _cfg(tmp_path).to_dict()
    own = _cfg(tmp_path, "optimizer.embedding_lr=0.1").to_dict()
    with pytest.raises(
        ConfigError,
        match=r"embedding_lr is 0.1 but the checkpoint was trained with null.*resume with optimizer.embedding_lr=null",
    ):
        refuse_optimizer_group_change(plain, own)
    with pytest.raises(ConfigError, match=r"resume with optimizer.embedding_lr=0.1, or start a new run"):
        refuse_optimizer_group_change(own, plain)
    refuse_optimizer_group_change(own, _cfg(tmp_path, "optimizer.embedding_lr=0.2").to_dict())  # ignored
    refuse_optimizer_group_change({"optimizer": {"lr": 3e-3}}, plain)  # saved before the key existed
