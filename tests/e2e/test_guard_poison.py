"""The guard's rules at their defaults against bad data and a collapsing model, in real `train.py` runs.

A corpus of our own (the suite's People's Daily text packed in 64-token samples,
scenarios/poison.py) with 3 samples of crawl garbage (base64 blobs, byte soup, mojibake) in each of
the batches after POISON[0] up to POISON[1], read in order (`data.shuffle: false`); and in the same
run the learning rate x1e8 for the two batches after COLLAPSE[0] (the driver's
`LLM_TEST_LR_SPIKE`). The rules' thresholds are the defaults; only the warm-up, the window and
`guard.skip` are sized to a run of BATCHES batches (a checkpoint every 4). What is promised
(docs/guard.md):

- the first poisoned batch is a spike by the loss's own noise though under `loss_factor`'s 1.5
  (the old rule alone let the whole window through): rolled back to the save before it, the
  poisoned window skipped, no batch with garbage trained on;
- the oversized update is caught at its own batch by the jump of the weight norm, before a loss
  shows it: rolled back to the save before it and skipped;
- the run ends bit-identical (losses, samples, weights) to a run told `data.skip` of both windows
  from the start;
- with the other rules off, the collapsed model (its losses all ln(vocab), equal to 6 digits) is
  caught by the flat-loss rule and rolled back to the save before the update that broke it, from
  storage (the snapshot in memory is newer: a save of the collapsed state).

Three training processes, one fixture; the rules themselves, pure, are tests/llm/callbacks/test_guard.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from scenarios.poison import PoisonedSplit, write_poisoned_split
from tests.support.resume import Run, assert_same_weights, load_weights, run
from tests.support.training import write_recipe

pytestmark = pytest.mark.slow

BATCHES = 48
POISON = (24, 30)  # batches 25-30 hold 3 samples of garbage each
COLLAPSE = (36, 38)  # the learning rate x1e8 in batches 37 and 38
GUARD = {"enabled": True, "warmup": 12, "window": 12, "skip": POISON[1] - POISON[0] - 1}
ONLY_FLAT = {"weight_factor": 0, "loss_z": 0, "loss_factor": 0}  # the collapse left to the flat-loss rule
ENV = {"LLM_TEST_LR_SPIKE": f"{COLLAPSE[0]}:{COLLAPSE[1]}:1e8", "LLM_TEST_GUARD_SCORES": "1"}


@dataclass
class Poisoned:
    split: PoisonedSplit
    guarded: Run  # the guard at its default rules
    skipped: Run  # data.skip of both windows from the start
    flat: Run  # the same with only the flat-loss rule on (ONLY_FLAT): the poison trained on


def _recipe(folder: Path, train_data, split: PoisonedSplit, **guard) -> Path:
    return write_recipe(
        folder / "recipe.yaml",
        train_data,
        run_dir=folder / "run",
        data={
            "train": [{"remote": str(split.folder)}],
            "shuffle": False,
            "cache_root": str(folder / "cache"),
        },
        training={
            "global_batch_size": 8, "device_microbatch_size": 8, "max_duration": f"{BATCHES}ba",
            "eval_interval": "1000ba", "log_interval": 1, "device": "cpu",
        },
        checkpoint={"save_folder": str(folder / "ckpt"), "save_interval": "4ba", "num_to_keep": 3},
        guard={**GUARD, **guard},
        callbacks={"generate": {"enabled": False}, "loss_plot": False, "memory_monitor": False},
    )  # fmt: skip


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, train_data, chinese_documents) -> Poisoned:
    root = tmp_path_factory.mktemp("guard-poison")
    split = write_poisoned_split(
        root / "shards" / "train", train_data.tokenizer, chinese_documents, seq_len=train_data.seq_len,
        batch_size=8, num_batches=BATCHES, window=POISON, per_batch=3,
    )  # fmt: skip
    runs = {}
    for name, guard, overrides, env in (
        ("guarded", {}, [], ENV),
        (
            "skipped",
            {},
            [f"data.skip=[{list(POISON)},[{COLLAPSE[0]},{COLLAPSE[0] + 1 + GUARD['skip']}]]"],
            ENV,
        ),
        ("flat", ONLY_FLAT, [], {"LLM_TEST_LR_SPIKE": ENV["LLM_TEST_LR_SPIKE"]}),
    ):
        folder = root / name
        folder.mkdir()
        recipe = _recipe(folder, train_data, split, **guard)
        runs[name] = run(recipe, name, cwd=folder, overrides=overrides, env=env)
    return Poisoned(split, **runs)


def _guard_lines(result: Run) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("[guard]")]


def _poisoned_batches(result: Run, split: PoisonedSplit) -> list[int]:
    return [b["batch"] for b in result.batches() if split.garbage & set(b["samples"])]


def test_the_poisoned_window_is_where_the_split_put_it(poisoned):
    # The skip run reads every batch too: the garbage is exactly in batches 25-30, 3 samples each.
    reads = [b for b in poisoned.flat.batches() if b["batch"] <= POISON[1]]
    assert [b["batch"] for b in reads] == list(range(1, POISON[1] + 1))
    assert _poisoned_batches(poisoned.flat, poisoned.split)[:6] == list(range(POISON[0] + 1, POISON[1] + 1))
    assert all(len(poisoned.split.garbage & set(b["samples"])) == 3 for b in reads[POISON[0] :])


def test_crawl_garbage_is_caught_at_its_first_batch_by_the_losss_own_noise(poisoned):
    guarded = poisoned.guarded
    assert guarded.returncode == 0, guarded.output[-3000:]
    first = _guard_lines(guarded)[0]
    a, b = POISON
    assert first.startswith("[guard] loss ") and f" at batch {a + 1} (median " in first
    assert "x the loss's noise above it" in first
    assert first.endswith(
        f"rolled back to batch {a}, skipping batches {a}-{b} (from the snapshot in host memory)"
    )
    # Under loss_factor's 1.5: the ratio rule alone (the guard before) trained on all of it.
    scores = next(r["guard"] for r in guarded.batches() if r["batch"] == a + 1)
    assert 1.1 < scores["loss_ratio"] < 1.5 and scores["loss_z"] > 6
    # The spike's batch was trained on, then undone; nothing of the window after it.
    assert _poisoned_batches(guarded, poisoned.split) == [a + 1]


def test_an_oversized_update_is_caught_at_its_own_batch_by_the_weight_norm(poisoned):
    second = _guard_lines(poisoned.guarded)[1]
    c = COLLAPSE[0]
    assert second.startswith("[guard] weight norm ") and f" at batch {c + 1} (" in second
    end = c + 1 + GUARD["skip"]
    assert second.endswith(
        f"rolled back to batch {c}, skipping batches {c}-{end} (from the snapshot in host memory)"
    )
    assert len(_guard_lines(poisoned.guarded)) == 2


def test_the_run_ends_bit_identical_to_skipping_both_windows_from_the_start(poisoned):
    guarded, skipped = poisoned.guarded, poisoned.skipped
    assert skipped.returncode == 0 and _guard_lines(skipped) == [], skipped.output[-3000:]
    undone = {POISON[0] + 1, COLLAPSE[0] + 1}  # trained, then rolled back
    kept = [(b["batch"], b["ids"], b["loss"]) for b in guarded.batches() if b["batch"] not in undone]
    assert kept == [(b["batch"], b["ids"], b["loss"]) for b in skipped.batches()]
    assert_same_weights(guarded.weights, skipped.weights)
    assert max(v.abs().max().item() for v in load_weights(guarded.weights).values()) < 10


def test_a_model_collapsed_to_uniform_output_is_caught_by_its_flat_loss(poisoned, train_data):
    flat = poisoned.flat
    assert flat.returncode == 0, flat.output[-3000:]
    c, skip = COLLAPSE[0], GUARD["skip"]
    # The update of batch c + 1 broke the model: from batch c + 2 on it scores every batch ln(vocab).
    uniform = math.log(train_data.vocab_size)
    losses = {b["batch"]: b["loss"] for b in flat.batches()}
    assert all(abs(losses[b] - uniform) < 1e-5 for b in range(c + 2, c + 7)), losses
    seen = c + 6  # the fifth equal loss: flat_steps' default
    (line,) = _guard_lines(flat)
    checkpoint = flat.record.parent / "ckpt" / f"ep0-ba{c}-rank0.pt"
    assert line == (
        f"[guard] loss {uniform:.4g} at batch {seen} (the same loss to 6 digits since batch {c + 2}: a "
        f"collapsed model): rolled back to batch {c}, skipping batches {c}-{seen + skip} (from the "
        f"checkpoint {checkpoint})"
    )  # the state after batch c + 1 is the collapsed one; the snapshot in memory (c + 4) is newer
    assert [b for b in losses if b > c] == [*range(c + 1, seen + 1), *range(seen + skip + 1, BATCHES + 1)]
    assert max(losses[b] for b in losses if b > seen) < uniform - 1
    assert max(v.abs().max().item() for v in load_weights(flat.weights).values()) < 10
