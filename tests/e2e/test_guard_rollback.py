"""The guard in real `train.py` processes: spikes rolled back and their windows skipped, bit for bit.

What is promised (docs/guard.md), on 16 batches with a checkpoint every 4:
- a run whose batch 7 is non-finite rolls back to the checkpoint at 4 and skips batches 4-9
  (`guard.skip=2`); stopped by SIGTERM right at the rollback (a checkpoint at 7 that holds the
  window), the resumed run keeps the window (it does not train on batches 8 and 9), and a spike on
  its second batch (11, loss x 50) is judged against the medians the checkpoint kept (no new
  warm-up) and rolled back to 7 (skipping 7-13); the run ends bit-identical (losses, sample order,
  weights) to a run told `data.skip: [[4, 13]]` from the start;
- on two ranks under FSDP2 (sharded checkpoints on S3), with the spike on rank 1's loss only, both
  ranks take the same decision and the run ends bit-identical to the two-rank skip-from-start run.

One single-process scenario (`single`: the stopped and resumed run, the skip-from-start run) and
one two-rank scenario (`two_ranks`), each run once for the module. The limit and its exit code,
a finite spike before any resume and a rollback from a monolithic S3 checkpoint are
tests/llm/callbacks/test_guard.py's.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from llm.plots import load_run, run_figure, summary_table
from tests.support import forkserver
from tests.support.resume import (
    RECORDS,
    Run,
    assert_same_weights,
    interrupt,
    load_weights,
    run,
    write_recipe,
)
from tests.support.training import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.s3]

GUARD = ["guard.enabled=true", "guard.window=4", "guard.warmup=3", "guard.skip=2"]
LONGER = ["training.max_duration=16ba"]
FIRST = "[guard] loss nan at batch 7 (median 5.554): rolled back to batch 4, skipping batches 4-9"


@dataclass
class Single:
    folder: Path
    stopped: Run  # spike at 7, SIGTERM at 7: the rollback, then a checkpoint at 7
    resumed: Run  # the same command: resumes at 7 inside the window; spike at 11
    skipped: Run  # data.skip=[[4,13]] from the start


@pytest.fixture(scope="module")
def single(tmp_path_factory, shards) -> Single:
    folder = tmp_path_factory.mktemp("guard")
    spiked = folder / "spiked"
    spiked.mkdir()
    recipe = write_recipe(spiked / "recipe.yaml", shards, str(spiked / "ckpt"), cache=spiked / "cache")
    overrides = [*GUARD, *LONGER, *RECORDS]
    env = {"LLM_TEST_SPIKE_AT": "7:nan,11:50"}
    stopped = interrupt(
        recipe, "stopped", cwd=spiked, at_batch=7, sig=signal.SIGTERM, overrides=overrides, env=env
    )
    resumed = run(recipe, "resumed", cwd=spiked, overrides=overrides, env=env)
    (folder / "skipped").mkdir()
    recipe = write_recipe(
        folder / "skipped" / "recipe.yaml",
        shards,
        str(folder / "skipped" / "ckpt"),
        cache=folder / "skipped" / "cache",
    )
    skipped = run(recipe, "skipped", cwd=folder / "skipped", overrides=[*overrides, "data.skip=[[4,13]]"])
    return Single(spiked, stopped, resumed, skipped)


def test_a_non_finite_step_rolls_back_to_the_last_checkpoint_and_records_its_window(single, reference):
    stopped = single.stopped
    assert stopped.returncode == 143, stopped.output[-3000:]
    assert stopped.output.count("[guard]") == 1 and FIRST in stopped.output
    assert [b["batch"] for b in stopped.batches()] == [1, 2, 3, 4, 5, 6, 7]
    assert [b["ids"] for b in stopped.batches()[:6]] == [b["ids"] for b in reference.batches()[:6]]
    run_dir = single.folder / "runs" / "rs"
    events = [r for r in read_metrics(run_dir / "metrics.jsonl") if "guard/rolled_back_to" in r]
    assert [{k: v for k, v in r.items() if k.startswith("guard/")} for r in events] == [
        {
            "guard/spike_batch": 7,
            "guard/rolled_back_to": 4,
            "guard/skip_from": 4,
            "guard/skip_to": 9,
            "guard/rollbacks": 1,
        },
        {
            "guard/spike_batch": 11,
            "guard/rolled_back_to": 7,
            "guard/skip_from": 7,
            "guard/skip_to": 13,
            "guard/rollbacks": 2,
        },
    ]
    assert [r["step"] for r in events] == [7, 11]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["skip"] == [[4, 13]]


def test_rollbacks_and_skips_end_bit_identical_to_skipping_the_windows_from_the_start(single, reference):
    skipped, resumed = single.skipped, single.resumed
    assert skipped.returncode == 0 and resumed.returncode == 0, resumed.output[-3000:]
    assert "[guard]" not in skipped.output
    assert [b["batch"] for b in skipped.batches()] == [1, 2, 3, 4, 14, 15, 16]
    assert [b["ids"] for b in skipped.batches()[:4]] == [b["ids"] for b in reference.batches()[:4]]
    # The stopped run's batches up to 4, then the resumed run's that no rollback undid.
    rolled = single.stopped.batches()[:4] + [b for b in resumed.batches() if b["batch"] > 13]
    assert [b["batch"] for b in rolled] == [1, 2, 3, 4, 14, 15, 16]
    assert [(b["ids"], b["loss"]) for b in rolled] == [(b["ids"], b["loss"]) for b in skipped.batches()]
    assert_same_weights(skipped.weights, resumed.weights)
    # The batch counter moved over the windows: the same steps, tokens, losses and rates recorded.
    ours = read_metrics(single.folder / "runs" / "rs" / "metrics.jsonl")
    theirs = read_metrics(skipped.record.parent / "runs" / "rs" / "metrics.jsonl")
    assert [(r["step"], r["tokens"], r["loss"], r["lr"]) for r in ours if r["step"] > 13] == [
        (r["step"], r["tokens"], r["loss"], r["lr"]) for r in theirs if r["step"] > 13
    ]


def test_a_resumed_run_keeps_the_window_and_judges_its_first_steps_against_the_kept_medians(single):
    resumed = single.resumed
    assert "[resume] resuming run 'rs' from the checkpoint at batch 7" in resumed.output
    # 8 and 9 are not trained (the window came back with the checkpoint); 11 spikes and is undone.
    assert [b["batch"] for b in resumed.batches()] == [10, 11, 14, 15, 16]
    (checkpoint,) = (single.folder / "ckpt").glob("ep*-ba7-rank0.pt")
    callbacks = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]["callbacks"]
    assert callbacks["SkipWindowsCallback"] == {"windows": [[4, 9]]}
    assert [r["rolled_back_to"] for r in json.loads(callbacks["SpikeGuard"]["rollbacks"])] == [4]
    assert [s["batch"] for s in json.loads(callbacks["SpikeGuard"]["history"])] == [
        1,
        2,
        3,
        4,
    ]  # the medians' steps
    # Batch 11 is the resumed run's second step: judged only because the medians came back.
    (line,) = [line for line in resumed.output.splitlines() if line.startswith("[guard]")]
    assert line.startswith("[guard] loss ") and " at batch 11 (median 5.561)" in line
    assert line.endswith("rolled back to batch 7, skipping batches 7-13")


def test_the_loss_plot_and_llm_plot_mark_the_rollbacks_and_the_skipped_window(single):
    run_dir = single.folder / "runs" / "rs"
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    curves = load_run(str(run_dir))
    assert curves.rollbacks() == [(7, 4), (11, 7)] and curves.skipped() == [(4, 13)]
    ax = run_figure(curves).axes[0]
    labels = [line.get_label() for line in ax.lines] + [patch.get_label() for patch in ax.patches]
    assert labels.count("rollback") == 1 and "skipped batches" in labels  # one legend entry each
    assert sum(1 for line in ax.lines if line.get_linestyle() == ":") == 2
    (band,) = ax.patches
    tokens = 4 * 32  # a batch: 4 samples of 32 tokens
    assert (band.get_x(), band.get_x() + band.get_width()) == (4 * tokens, 13 * tokens)
    header, row = summary_table([curves]).splitlines()
    assert header.split()[-2:] == ["rollbacks", "skipped"] and row.split()[-2:] == ["2", "9"]


# --- two ranks, FSDP2 -----------------------------------------------------------------------------

LAUNCH_2 = [forkserver.COMPOSER, "-n", "2"]
FSDP = [
    "fsdp.enabled=true",
    "fsdp.state_dict_type=sharded",
    "fsdp.activation_checkpointing=none",
    "training.device_microbatch_size=2",
]


@dataclass
class TwoRanks:
    rolled: Run  # the loss of batch 7 x 50 on rank 1 only
    skipped: Run  # data.skip=[[4,9]] from the start


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, shards, s3_server) -> TwoRanks:
    folder = tmp_path_factory.mktemp("guard-fsdp2")
    s3_server.create_bucket("guard-fsdp2")
    out = {}
    for name, save, overrides, env in (
        ("rolled", "s3://guard-fsdp2/ckpt", GUARD, {"LLM_TEST_SPIKE_AT": "7:50", "LLM_TEST_SPIKE_RANK": "1"}),
        ("skipped", str(folder / "skipped" / "ckpt"), [*GUARD, "data.skip=[[4,9]]"], {}),
    ):
        (folder / name).mkdir()
        recipe = write_recipe(folder / name / "recipe.yaml", shards, save, cache=folder / name / "cache")
        out[name] = run(
            recipe, name, cwd=folder / name, overrides=[*overrides, *FSDP], env={"FSDP_VERSION": "2", **env},
            launcher=LAUNCH_2,
        )  # fmt: skip
    return TwoRanks(out["rolled"], out["skipped"])


def _per_rank(result: Run) -> list[list[tuple[int, str]]]:
    records = sorted(result.record.parent.glob(result.record.name + "*"))
    return [[(r["batch"], r["ids"]) for r in map(json.loads, p.read_text().splitlines())] for p in records]


def test_two_fsdp2_ranks_take_the_same_decision_and_end_as_the_skip_from_the_start(two_ranks):
    rolled, skipped = two_ranks.rolled, two_ranks.skipped
    assert rolled.returncode == 0, rolled.output[-4000:]
    assert skipped.returncode == 0, skipped.output[-4000:]
    lines = [line for line in rolled.output.splitlines() if "[guard]" in line]
    assert len(lines) == 1 and lines[0].endswith("rolled back to batch 4, skipping batches 4-9")
    ranks = _per_rank(rolled)
    assert len(ranks) == 2
    assert [[b for b, _ in rank] for rank in ranks] == [[1, 2, 3, 4, 5, 6, 7, 10, 11, 12]] * 2
    # Each rank's samples after the window, and the weights, equal the skip-from-the-start run's.
    after = [[x for x in rank if x[0] > 7] for rank in ranks]
    assert after == [[x for x in rank if x[0] > 4] for rank in _per_rank(skipped)]
    assert [b["loss"] for b in rolled.batches()[7:]] == [b["loss"] for b in skipped.batches()[4:]]
    wa, wb = load_weights(rolled.weights), load_weights(skipped.weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
