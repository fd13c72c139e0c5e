"""The recipe loader: overrides, interpolation, unknown keys, wrong types, cross-field checks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from llm.config import TrainConfig, load_config, save_resolved, to_yaml
from llm.errors import ConfigError

RECIPE = textwrap.dedent(
    """
    run_name: cfg-test
    run_dir: /tmp/runs/${run_name}
    model:
      vocab_size: 512
      dim: 64
      n_layers: 2
      n_heads: 4
      max_seq_len: 32
      tie_embeddings: true
    tokenizer:
      path: tok.model
    data:
      train:
        - remote: s3://bucket/wiki/train
          proportion: 0.7
        - remote: s3://bucket/medical/train
          proportion: 0.3
      eval:
        - remote: s3://bucket/wiki/val
    optimizer:
      lr: 3e-4
    training:
      global_batch_size: 8
      device_microbatch_size: 4
      max_duration: 20ba
    checkpoint:
      save_folder: ${run_dir}/checkpoints
    """
)


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE, encoding="utf-8")
    return path


def test_loads_typed_config_with_interpolation(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.dim == 64 and cfg.model.tie_embeddings is True
    assert cfg.optimizer.lr == pytest.approx(3e-4)  # "3e-4" is a string to YAML 1.1; we accept it
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.checkpoint.save_folder == "/tmp/runs/cfg-test/checkpoints"
    assert [s.proportion for s in cfg.data.train] == [0.7, 0.3]
    assert cfg.grad_accum == 2
    assert cfg.seq_len == 32


def test_dotted_overrides_including_list_items(recipe):
    cfg = load_config(
        recipe,
        ["optimizer.lr=1e-4", "run_name=other", "data.train.1.remote=s3://b/x/train", "model.n_layers=3"],
    )
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.run_dir == "/tmp/runs/other"  # interpolation sees the override
    assert cfg.data.train[1].remote == "s3://b/x/train"
    assert cfg.model.n_layers == 3


def test_unknown_key_names_the_closest_valid_one(recipe):
    with pytest.raises(
        ConfigError, match=r"unknown key 'optimizer.weight_decy'.*did you mean 'weight_decay'"
    ):
        load_config(recipe, ["optimizer.weight_decy=0.0"])
    bad = recipe.read_text().replace("max_duration", "max_duraton")
    recipe.write_text(bad)
    with pytest.raises(ConfigError, match=r"training.max_duraton.*'max_duration'"):
        load_config(recipe)


def test_wrong_type_names_key_and_expected_type(recipe):
    with pytest.raises(ConfigError, match=r"model.n_layers must be an integer, got 'many'"):
        load_config(recipe, ["model.n_layers=many"])
    with pytest.raises(ConfigError, match=r"training.global_batch_size must be an integer, got 8.5"):
        load_config(recipe, ["training.global_batch_size=8.5"])
    with pytest.raises(ConfigError, match=r"data.train must be a list"):
        load_config(recipe, ["data.train=oops"])


def test_batch_sizes_must_divide(recipe):
    with pytest.raises(ConfigError, match="not a multiple of training.device_microbatch_size=3"):
        load_config(recipe, ["training.device_microbatch_size=3"])
    cfg = load_config(recipe)
    assert cfg.check_world_size(2) == 4
    with pytest.raises(ConfigError, match="world size 4"):
        cfg.check_world_size(4)


def test_durations_and_choices_are_checked(recipe):
    with pytest.raises(ConfigError, match="training.max_duration='20 steps' is not a duration"):
        load_config(recipe, ["training.max_duration=20 steps"])
    with pytest.raises(ConfigError, match="training.precision='bf16' is not one of"):
        load_config(recipe, ["training.precision=bf16"])
    with pytest.raises(ConfigError, match="proportion on every stream or on none"):
        load_config(recipe, ["data.train.1.proportion=null"])


def test_model_shape_errors_are_config_errors(recipe):
    with pytest.raises(ConfigError, match="model:"):
        load_config(recipe, ["model.n_heads=5"])


def test_missing_required_section_and_bad_override(recipe, tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(recipe, ["optimizer.lr"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  dim: 64\n")
    with pytest.raises(ConfigError, match="is required"):
        load_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_run_name_defaults_to_env_then_recipe_name(recipe, monkeypatch):
    text = recipe.read_text().replace("run_name: cfg-test\n", "")
    recipe.write_text(text)
    monkeypatch.delenv("RUN_NAME", raising=False)
    monkeypatch.delenv("COMPOSER_RUN_NAME", raising=False)
    assert load_config(recipe).run_name == "recipe"
    monkeypatch.setenv("RUN_NAME", "from-env")
    cfg = load_config(recipe)
    assert cfg.run_name == "from-env" and cfg.run_dir == "/tmp/runs/from-env"
    recipe.write_text(text.replace("run_dir: /tmp/runs/${run_name}\n", ""))
    assert load_config(recipe).run_dir == "runs/from-env"  # the default interpolates as well


def test_resolved_config_is_saved_with_credentials_redacted(recipe, tmp_path):
    cfg = load_config(recipe, ["data.train.0.remote=s3://user:hunter2@bucket/wiki/train"])
    text = to_yaml(cfg)
    assert "hunter2" not in text and "s3://***@bucket/wiki/train" in text
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
    reloaded = yaml.safe_load(path.read_text())
    assert reloaded["model"]["dim"] == 64
    assert reloaded["checkpoint"]["save_folder"] == "/tmp/runs/cfg-test/checkpoints"
