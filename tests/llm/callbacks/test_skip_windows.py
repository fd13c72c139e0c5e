"""The batch counter follows the data over a skipped window, across an epoch's end and a resume.

Real in-process runs over the resume harness's shards (96 samples: 24 batches of 4 an epoch): one
without windows, one skipping [20, 27) (the last 4 batches of epoch 1 and the first 3 of epoch 2)
that saves at batch 28, and its resume from there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
from composer.core import Callback

from scenarios.resume import write_recipe


class Batches(Callback):
    """Each trained batch's number and the hash of its samples; the counter at the end."""

    def __init__(self):
        self.seen: dict[int, str] = {}
        self.end = None

    def batch_end(self, state, logger) -> None:
        ids = state.batch["input_ids"].cpu().contiguous().numpy().tobytes()
        self.seen[int(state.timestamp.batch)] = hashlib.sha256(ids).hexdigest()

    def fit_end(self, state, logger) -> None:
        self.end = state.timestamp


@dataclass
class Runs:
    plain: Batches
    skipping: Batches
    resumed: Batches
    folder: object


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards) -> Runs:
    from llm.config import load_config
    from llm.trainer import build_trainer

    folder = tmp_path_factory.mktemp("skip-epochs")
    out = []
    for name, overrides in (
        ("plain", []),
        ("skipping", ["data.skip=[[20,27]]", "training.max_duration=28ba"]),
        ("skipping", ["data.skip=[[20,27]]"]),  # the same folder: resumes at 28
    ):
        (folder / name).mkdir(exist_ok=True)
        recipe = write_recipe(
            folder / name / "r.yaml", shards, str(folder / name / "ck"), cache=folder / "cache"
        )
        base = ["training.max_duration=30ba", "checkpoint.save_interval=28ba", "loggers.metrics_file=true"]
        recorder = Batches()
        trainer = build_trainer(load_config(recipe, [*base, *overrides]), extra_callbacks=[recorder])
        try:
            trainer.fit()
        finally:
            trainer.close()
        out.append(recorder)
    return Runs(*out, folder)


def test_skipped_batches_count_as_steps_and_the_data_of_every_batch_number_is_unchanged(runs):
    plain, skipping = runs.plain.seen, runs.skipping.seen
    assert list(plain) == list(range(1, 31))
    assert list(skipping) == [*range(1, 21), 28]
    assert all(skipping[b] == plain[b] for b in skipping)
    # Over the epoch's end: the counter stands where the data does, in the totals and in epoch 2.
    end = runs.skipping.end
    assert (int(end.epoch), int(end.batch), int(end.batch_in_epoch)) == (1, 28, 4)
    assert (int(end.sample), int(end.sample_in_epoch)) == (28 * 4, 4 * 4)
    assert int(end.token) == 28 * 4 * 32


def test_a_resume_after_the_window_continues_with_the_same_samples(runs):
    assert list(runs.resumed.seen) == [29, 30]
    assert all(runs.resumed.seen[b] == runs.plain.seen[b] for b in (29, 30))
    assert int(runs.resumed.end.batch) == int(runs.plain.end.batch) == 30
    assert int(runs.resumed.end.sample_in_epoch) == int(runs.plain.end.sample_in_epoch) == 6 * 4
