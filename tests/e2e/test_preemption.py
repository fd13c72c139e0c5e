"""Save on SIGTERM/SIGINT: stop after the current batch on every rank, store a checkpoint, exit 143/130."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.resume import (
    CHUNKED,
    DOCUMENTS,
    MAX_BATCHES,
    assert_continues,
    assert_same_weights,
    interrupt,
    kill_group,
    run,
    start,
    wait_for_batch,
    write_recipe,
)

pytestmark = pytest.mark.slow  # every test here starts training processes


@pytest.mark.parametrize("variant", ["causal", "documents", "chunked"])
def test_sigterm_saves_the_interrupted_batch_and_the_same_command_continues_bit_identically(
    tmp_path, shards, request, variant
):
    """Also with documents kept apart (`DOCUMENTS`: positions restarting, the guard on), and with the
    loss head over several chunks (`CHUNKED`, the guard on)."""
    overrides = {"documents": DOCUMENTS, "chunked": CHUNKED}.get(variant, [])
    reference = request.getfixturevalue("reference" if variant == "causal" else f"reference_{variant}")
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=5, sig=signal.SIGTERM, overrides=overrides)

    assert first.returncode == 143, first.output[-4000:]
    assert "[resume] starting run 'rs' from scratch" in first.output
    stop = first.batches()[-1]["batch"]
    assert 5 <= stop < MAX_BATCHES
    assert f"[preemption] SIGTERM: checkpoint at batch {stop} stored" in first.output
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["batch"] == stop
    assert first.seconds < 30, f"exit took {first.seconds:.1f} s after SIGTERM; launchers kill at 30 s"

    second = run(recipe, "second", cwd=tmp_path, overrides=overrides)
    assert second.returncode == 0, second.output[-4000:]
    assert f"[resume] resuming run 'rs' from the checkpoint at batch {stop}" in second.output
    assert_continues(reference, first, second, stop)
    assert_same_weights(reference.weights, second.weights)
    if variant == "documents":  # the documents did change what was trained: not the causal run
        causal = request.getfixturevalue("reference")
        assert [b["ids"] for b in reference.batches()] == [b["ids"] for b in causal.batches()]
        assert [b["loss"] for b in reference.batches()] != [b["loss"] for b in causal.batches()]


@pytest.fixture
def real_interpreter(monkeypatch):
    """The run in a new interpreter, not a fork of the suite's fork server, whose children leave
    through os._exit: the interpreter's own shutdown (seconds with torch and Composer loaded) is
    part of what is measured."""
    import subprocess

    import scenarios.resume

    monkeypatch.setattr(scenarios.resume, "SPAWN", subprocess.Popen)


def test_sigint_stops_with_exit_code_130_after_saving_within_the_notice(tmp_path, shards, real_interpreter):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    notice = ["preemption.notice_s=3", "preemption.margin_s=1"]
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=2, sig=signal.SIGINT, overrides=notice)

    assert first.returncode == 130, first.output[-4000:]
    stop = first.batches()[-1]["batch"]
    assert f"[preemption] SIGINT: checkpoint at batch {stop} stored" in first.output
    manifest = tmp_path / "ckpt" / "manifests" / f"ba{stop:010d}-rank00000.json"
    assert json.loads(manifest.read_text())["batch"] == stop
    # Issue 39 item 3: the checkpoint was stored within a second, but the process took 4-10 s more
    # to end (the interpreter's shutdown) and was killed at the end of the notice.
    assert first.seconds < 3, f"exit took {first.seconds:.1f} s after the signal; the platform kills at 3 s"


def test_a_second_sigterm_during_the_save_exits_143_without_a_traceback_or_a_partial_file(
    tmp_path, shards, real_interpreter
):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    # Each checkpoint file stalls for 2 s after its first bytes: the second signal lands mid-save,
    # and the save would be complete 2 s later if the process let it.
    proc, record, _ = start(recipe, "first", cwd=tmp_path, pause_at=2, env={"LLM_TEST_SAVE_STALL": "2"})
    try:
        wait_for_batch(record, 2, proc)  # before the first periodic save (batch 4)
        os.killpg(proc.pid, signal.SIGTERM)
        stalling = Path(f"{record}.stalling")
        deadline = time.monotonic() + 60
        while not stalling.exists():  # inside torch.save (a signal before it could stall the clean-up)
            assert time.monotonic() < deadline and proc.poll() is None, proc.tag_log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=180)
        seconds = time.monotonic() - sent
    finally:
        kill_group(proc)
    # Issue 39 item 4: the line said "stopped at once ... without storing a checkpoint", then the
    # process lived 45 s more and the checkpoint was stored anyway. At once, and as the line says.
    assert seconds < 2, f"exit took {seconds:.1f} s after the second SIGTERM"
    time.sleep(3)  # past the stall: a save the process let go on would be complete by now
    output = proc.tag_log.read_text()
    assert proc.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "unexpected pos" not in output, output[-3000:]
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert last.startswith("[preemption] second SIGTERM: stopped at once at batch 2 without storing"), last
    assert "(the save at batch 2 was cut short: it is not complete)" in last
    assert "no checkpoint is complete: the next run starts from scratch and redoes batches 1-2" in last
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert not [name for name in leftovers if name.startswith("ep")], leftovers  # the partial .pt is gone
    assert not list((tmp_path / "ckpt").glob("manifests/*")), "a manifest was written after the line"
