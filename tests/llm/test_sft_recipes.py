"""The SFT recipes: baby-llama2-chinese's SFT settings at the shapes of the pretraining recipes."""

from __future__ import annotations

import pytest
import torch

from llm.config import load_config
from llm.model import Transformer
from scenarios.sft_demo import majority, score
from tests.support import paths

RECIPES = paths.RECIPES


def _params(cfg) -> int:
    with torch.device("meta"):
        return Transformer(cfg.model).num_params()


@pytest.mark.parametrize(
    "name, pretrained, params", [("tiny-sft", "tiny", 58_479_616), ("7b-sft", "7b", 7_000_559_616)]
)
def test_sft_recipes_take_baby_llama2s_sft_settings_at_the_pretrained_shape(name, pretrained, params):
    cfg = load_config(RECIPES / f"{name}.yaml")
    assert cfg.model == load_config(RECIPES / f"{pretrained}.yaml").model and _params(cfg) == params
    assert cfg.data.kind == "sft"
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (2e-5, 1e-4)
    assert (cfg.scheduler.warmup, cfg.scheduler.min_lr) == ("1000ba", 1e-6)
    assert (cfg.training.max_duration, cfg.training.global_batch_size) == ("2ep", 32)
    assert cfg.checkpoint.load_path and cfg.checkpoint.load_weights_only
    assert cfg.run_dir == f"runs/{cfg.run_name}"


def test_the_demo_sft_recipe_fine_tunes_the_demo_model():
    cfg, demo = load_config(RECIPES / "demo-sft.yaml"), load_config(RECIPES / "demo.yaml")
    assert cfg.model == demo.model and cfg.tokenizer == demo.tokenizer  # its weights load
    assert cfg.data.kind == "sft" and cfg.data.train[0].remote == "data/demo/sft/shards/train"
    assert cfg.checkpoint.load_path == demo.checkpoint.save_folder and cfg.checkpoint.load_weights_only
    assert cfg.checkpoint.save_folder != demo.checkpoint.save_folder


def test_the_demo_scores_exact_labels_against_the_majority():
    labels = ["正面", "负面", "负面", "负面"]
    assert score(["正面", " 负面 ", "正面负面", "好"], labels) == {
        "accuracy": 0.5,
        "label_share": 0.5,
        "n": 4,
    }
    assert majority(labels) == ("负面", 0.75)


def test_the_demo_sft_accuracy_is_printed_by_review_length():
    from convert.demo.sft import prompt_for
    from scenarios.sft_demo import by_length, review_length

    prompts = [prompt_for("好" * n) for n in (10, 60, 150, 150, 300)]
    assert [review_length(p) for p in prompts] == [10, 60, 150, 150, 300]
    rows = by_length(
        prompts, ["正面", "负面", "负面", "正面", "正面"], ["正面", "负面", "正面", "正面", "负面"]
    )
    assert list(rows) == ["1-50", "51-100", "101-200", "201-400"]
    assert (rows["101-200"]["accuracy"], rows["101-200"]["n"], rows["101-200"]["positive_share"]) == (
        0.5,
        2,
        1.0,
    )
    assert rows["201-400"]["accuracy"] == 0.0


def test_the_demo_sft_fine_tunes_on_reviews_of_every_length_that_fits():
    """Issue 24: tuned only on reviews of up to 100 characters, the model answered 38% of the longer ones."""
    from convert.demo.sft import labelled_pairs

    lengths = [len(review) for review, _ in labelled_pairs()]
    assert sum(101 <= n <= 200 for n in lengths) > 300 and sum(n > 200 for n in lengths) > 50
    makefile = (RECIPES.parent / "Makefile").read_text()
    lines = makefile.splitlines()
    at = next(i for i, line in enumerate(lines) if "-m convert sft" in line)
    command = lines[at] + lines[at + 1]
    assert "--drop-truncated" in command, "reviews that do not fit are dropped, not cut"
    # convert sft's default --max-prompt-chars (256) would drop every review over ~240 characters
    # before the tokens are counted: the demo lifts it and lets --drop-truncated decide.
    assert "--max-prompt-chars 0" in command
