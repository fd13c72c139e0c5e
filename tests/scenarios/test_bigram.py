"""The demo's bigram baseline: Witten-Bell smoothed counts of the train shards, scored on val."""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from scenarios.bigram import bigram_loss
from tests.support import forkserver
from tests.support.training import REPO


def test_the_bigram_loss_is_the_witten_bell_formula():
    vocab = 4
    train = [np.array([0, 1, 0, 1, 2]), np.array([1, 0])]
    val = [np.array([0, 1, 3])]
    # train pairs: 0->1 (x2), 1->0 (x2), 1->2; unigram counts 0:3, 1:3, 2:1, 3:0 (7 tokens)
    p_uni = [(c + 1) / (7 + vocab) for c in (3, 3, 1, 0)]
    p01 = (2 + 1 * p_uni[1]) / (2 + 1)  # c(0)=2, one distinct follower
    p13 = (0 + 2 * p_uni[3]) / (3 + 2)  # c(1)=3, two distinct followers
    found = bigram_loss(train, val, vocab)
    assert math.isclose(found.loss, -(math.log(p01) + math.log(p13)) / 2, rel_tol=1e-12)
    assert (found.train_pairs, found.val_pairs) == (5, 2)


def test_make_demo_ends_with_the_baseline_beside_the_models_eval_loss(train_data, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"step": 10, "eval_loss": 9.0}) + "\n" + json.dumps({"step": 20, "eval_loss": 4.5}) + "\n"
    )
    done = forkserver.run(
        [sys.executable, "-m", "scenarios.bigram", "--shards", str(train_data.train.parent), "--metrics", str(metrics)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("bigram baseline (Witten-Bell") and "the model: 4.5000" in line
    baseline = float(line.split("eval loss ")[1].split()[0])
    assert 1.0 < baseline < math.log(train_data.vocab_size)  # better than uniform over the vocabulary
    assert (
        "scenarios.bigram --shards $(DEMO)/shards --metrics runs/demo/metrics.jsonl --recipe recipes/demo.yaml"
        in (REPO / "Makefile").read_text()
    )


def test_with_a_recipe_the_baseline_scores_the_samples_its_eval_covers():
    from scenarios.bigram import eval_samples

    assert eval_samples(str(REPO / "recipes" / "demo.yaml")) == 4 * 8  # eval_subset_num_batches x batch


def test_a_micro_batch_from_the_plan_counts_as_the_trainer_resolves_it(tmp_path):
    """`device_microbatch_size: 0`: the samples the eval covers use the plan's micro-batch on one
    CPU, as the trainer does, not 0."""
    from llm.config import load_config
    from llm.trainer import resolve_microbatch
    from scenarios.bigram import eval_samples

    text = (REPO / "recipes" / "demo.yaml").read_text()
    assert "device_microbatch_size: 8" in text
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(text.replace("device_microbatch_size: 8", "device_microbatch_size: 0"))
    chosen = resolve_microbatch(load_config(recipe), "cpu", 1, announce=False).training.device_microbatch_size
    assert chosen > 0
    assert eval_samples(str(recipe)) == 4 * chosen
