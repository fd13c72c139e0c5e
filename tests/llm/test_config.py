"""The recipe loader: overrides, interpolation, unknown keys, wrong types, cross-field checks."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import types
import typing
from pathlib import Path

import pytest
import yaml

from llm.config import TrainConfig, load_config, parse_duration, save_resolved, to_yaml
from llm.errors import ConfigError
from tests.support.config import grad_accum, seq_len

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
    assert grad_accum(cfg) == 2
    assert seq_len(cfg) == 32


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


def test_unknown_key_inside_a_list_item_names_its_index(recipe):
    with pytest.raises(ConfigError, match=r"unknown key 'data.eval.0.locl'.*did you mean 'local'"):
        load_config(recipe, ["data.eval.0.locl=/tmp/x"])
    recipe.write_text(recipe.read_text().replace("proportion: 0.3", "proportion: 0.3\n      remot: x"))
    with pytest.raises(ConfigError, match=r"unknown key 'data.train.1.remot'.*did you mean 'remote'"):
        load_config(recipe)


def test_wrong_type_names_key_and_expected_type(recipe):
    with pytest.raises(ConfigError, match=r"model.n_layers must be an integer, got 'many'"):
        load_config(recipe, ["model.n_layers=many"])
    with pytest.raises(ConfigError, match=r"training.global_batch_size must be an integer, got 8.5"):
        load_config(recipe, ["training.global_batch_size=8.5"])
    with pytest.raises(ConfigError, match=r"data.train must be a list"):
        load_config(recipe, ["data.train=oops"])
    with pytest.raises(ConfigError, match=r"optimizer.betas must be a list of 2 values, got \[0.9"):
        load_config(recipe, ["optimizer.betas=[0.9, 0.95, 0.99]"])
    with pytest.raises(ConfigError, match=r"training.compile must be true or false, got 'maybe'"):
        load_config(recipe, ["training.compile=maybe"])
    with pytest.raises(ConfigError, match=r"optimizer.lr must be a number: in \(0, 1\]: .*; got None"):
        load_config(recipe, ["optimizer.lr=null"])
    recipe.write_text(recipe.read_text().replace("proportion: 0.3", "proportion: lots"))
    with pytest.raises(ConfigError, match=r"data.train.1.proportion must be a number, got 'lots'"):
        load_config(recipe)


@pytest.mark.parametrize(
    "text, where",
    [
        ("model:\n  dim: 64\n   n_layers: 2\n", r"line 3, column 12: mapping values are not allowed"),
        ("model:\n\tdim: 64\n", r"line 2, column 1: .*\(a tab: indent YAML with spaces\)"),
        ("seed: 1\nmodel: {}\nseed: 2\n", r"line 3, column 1: found duplicate key seed"),
    ],
)
def test_yaml_syntax_errors_name_file_line_and_column(tmp_path, text, where):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=rf"^recipe {bad}, {where}") as caught:
        load_config(bad)
    assert "\n" not in str(caught.value)


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
    with pytest.raises(ConfigError, match="scheduler.warmup='2ep' is not a duration; .* 100ba, 100tok$"):
        load_config(recipe, ["scheduler.warmup=2ep"])


def test_fsdp_settings_are_checked(recipe):
    with pytest.raises(ConfigError, match=r"fsdp.version=1: only FSDP2 is supported \(FSDP1 was removed"):
        load_config(recipe, ["fsdp.version=1"])
    with pytest.raises(ConfigError, match="fsdp.replicate=0 must be at least 1"):
        load_config(recipe, ["fsdp.replicate=0"])
    with pytest.raises(ConfigError, match="fsdp.mixed_precision='bf16' is not one of DEFAULT, PURE, FULL"):
        load_config(recipe, ["fsdp.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match="unknown key 'fsdp.sharding_strategy'"):
        load_config(recipe, ["fsdp.sharding_strategy=FULL_SHARD"])
    assert load_config(recipe, ["fsdp.replicate=8"]).fsdp.replicate == 8


def test_zero_intervals_are_refused(recipe):
    with pytest.raises(ConfigError, match="checkpoint.save_interval='0ba' is zero; .*save_folder unset"):
        load_config(recipe, ["checkpoint.save_interval=0ba"])
    with pytest.raises(ConfigError, match="training.eval_interval='0ba' is zero; .*data.eval empty"):
        load_config(recipe, ["training.eval_interval=0ba"])
    with pytest.raises(ConfigError, match="callbacks.generate.interval='0tok' is zero"):
        load_config(recipe, ["callbacks.generate.interval=0tok"])
    assert load_config(recipe, ["scheduler.warmup=0ba"]).scheduler.warmup == "0ba"  # no warmup is fine


def test_durations_read_as_composer_reads_them():
    from composer.core import Time

    for text in ["1000ba", " 50000000tok", "2ep", "64sp", "0ba"]:
        amount, unit = parse_duration(text)
        composer_time = Time.from_timestring(text.strip())
        assert (amount, unit) == (composer_time.value, composer_time.unit.value)
    for text in ["20 steps", "ba", "-1ba", "1.5ba", "10BA", "0.5dur", "١٢ba"]:
        with pytest.raises(ConfigError, match="is not a duration"):
            parse_duration(text)


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


def test_a_tokenizer_path_that_is_a_folder_names_the_model_file_inside(recipe, tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "small.model").write_bytes(b"sentencepiece")
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [f"tokenizer.path={folder}"])
    assert str(err.value) == (
        f"tokenizer.path={folder} is a folder with neither tokenizer.json nor tokenizer.model; give the "
        "tokenizer's file (a SentencePiece .model or a Hugging Face tokenizer.json), "
        f"e.g. tokenizer.path={folder / 'small.model'}"
    )


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.json"])
def test_a_tokenizer_folder_is_a_tokenizer_path(recipe, tmp_path, name):
    """An export or a Hugging Face tokenizer's folder: its tokenizer.json or tokenizer.model."""
    (tmp_path / name).write_bytes(b"a tokenizer")
    assert load_config(recipe, [f"tokenizer.path={tmp_path}"]).tokenizer.path == str(tmp_path)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("callbacks.speed_window=0", "callbacks.speed_window=0 must be at least 1"),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1.0 must be 0 (off) or more"),
        ("optimizer.embedding_lr=0", "optimizer.embedding_lr=0.0 must be in (0, 1], or null (optimizer.lr)"),
        ("training.log_interval=0", "training.log_interval=0 must be at least 1"),
        ("training.log_interval=-1", "training.log_interval=-1 must be at least 1"),
        ("training.grad_clip_norm=-1", "training.grad_clip_norm=-1.0 must be 0 (no clipping) or positive"),
        ("training.eval_subset_num_batches=0", "training.eval_subset_num_batches=0 must be positive, or -1"),
        ("checkpoint.save_folder=ftp://x/y", "only local folders and s3://bucket/prefix are supported"),
    ],
)
def test_values_composer_would_crash_on_or_misuse_are_refused_in_one_line_with_exit_2(
    recipe, override, named, capsys
):
    import train

    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(recipe, [override])
    assert train.main([str(recipe), override]) == 2  # before anything trains
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err
    load_config(
        recipe,
        [
            "training.eval_subset_num_batches=-1",
            "training.grad_clip_norm=0",
            "optimizer.weight_decay=0",
            "optimizer.embedding_lr=null",
        ],
    )


# Issue 36 item 7: values that gave a traceback, or trained on NaN losses or a negative rate.
@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("optimizer.eps=-1", "optimizer.eps=-1.0 must be positive"),
        ("optimizer.eps=0", "optimizer.eps=0.0 must be positive"),
        ("optimizer.betas=[1.5, 0.9]", "optimizer.betas.0=1.5 must be in [0, 1)"),
        ("optimizer.betas=[0.9, -0.1]", "optimizer.betas.1=-0.1 must be in [0, 1)"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay=nan must be a finite number: 0 (off) or more"),
        ("optimizer.weight_decay=inf", "optimizer.weight_decay=inf must be a finite number: 0 (off) or more"),
        ("optimizer.lr=inf", "optimizer.lr=inf must be a finite number: in (0, 1]"),
        (
            "optimizer.embedding_lr=inf",
            "optimizer.embedding_lr=inf must be a finite number: in (0, 1], or null",
        ),
        (
            "optimizer.embedding_lr=1e400",
            "optimizer.embedding_lr=inf must be a finite number: in (0, 1], or null",
        ),
        ("scheduler.min_lr=-1", "scheduler.min_lr=-1.0 must be 0 or more, and at most optimizer.lr"),
        ("scheduler.min_lr=nan", "scheduler.min_lr=nan must be a finite number: 0 or more"),
        (
            "training.grad_clip_norm=nan",
            "training.grad_clip_norm=nan must be a finite number: 0 (no clipping)",
        ),
        (
            "checkpoint.upload_wait_s=inf",
            "checkpoint.upload_wait_s=inf must be a finite number: at least 1 second",
        ),
        (
            "checkpoint.upload_wait_s=nan",
            "checkpoint.upload_wait_s=nan must be a finite number: at least 1 second",
        ),
        # Issue 39 items 5 and 7: in range, yet a NaN from step 2 on, or every run ending rc 1
        # ("batch 20 was not stored" although its manifest was written).
        ("optimizer.lr=1e30", "optimizer.lr=1e+30 must be in (0, 1]: AdamW moves every weight by"),
        ("optimizer.embedding_lr=2", "optimizer.embedding_lr=2.0 must be in (0, 1], or null"),
        ("model.z_loss=1e300", "model.z_loss=1e+300 must be 0 (off) up to 1"),
        ("model.max_z_loss=5", "model.max_z_loss=5.0 must be 0 (off) up to 1"),
        ("checkpoint.upload_wait_s=1e-300", "checkpoint.upload_wait_s=1e-300 must be at least 1 second"),
        ("checkpoint.upload_wait_s=1e300", "checkpoint.upload_wait_s=1e+300 must be at least 1 second"),
        ("training.profile.active=1000000000", "training.profile.active=1000000000 must be in [1, 100]"),
        ("training.profile.ranks=[0, -1]", "training.profile.ranks.1=-1 must be a global rank"),
        ("model.rope_theta=inf", "model.rope_theta=inf must be a finite number"),
        ("callbacks.generate.top_p=0", "callbacks.generate.top_p=0.0 must be in (0, 1]"),
        ("data.train.1.proportion=-inf", "data.train.1.proportion=-inf must be a finite number: positive"),
    ],
)
def test_numbers_out_of_range_or_not_finite_are_one_line_before_the_run_folder_exists(
    recipe, tmp_path, override, named, capsys
):
    import train

    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(recipe, [override])
    run_dir = tmp_path / "run"
    assert train.main([str(recipe), override, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err
    assert not run_dir.exists()


def _float_keys(schema: type, prefix: str = "") -> list[str]:
    """Every float setting of the schema as a dotted key (a list of sections: its first item)."""
    keys = []
    for f in dataclasses.fields(schema):
        kind = typing.get_type_hints(schema)[f.name]
        if isinstance(kind, types.UnionType):  # `float | None`
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is list and dataclasses.is_dataclass(typing.get_args(kind)[0]):
            keys += _float_keys(typing.get_args(kind)[0], f"{prefix}{f.name}.0.")
        elif dataclasses.is_dataclass(kind):
            keys += _float_keys(kind, f"{prefix}{f.name}.")
        elif kind is float:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_float_setting_refuses_nan_and_infinities_naming_its_key(recipe):
    keys = _float_keys(TrainConfig)
    assert len(keys) >= 15 and "loggers.mlflow.close_timeout" in keys and "data.eval.0.proportion" in keys
    for key in keys:
        for value in ("nan", "inf", "-inf", "1e400"):
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=(nan|-?inf) must be a finite number"):
                load_config(recipe, [f"{key}={value}"])


def test_a_profiler_window_must_end_within_the_run(recipe):
    on = ["training.profile.enabled=true", "training.profile.wait=1", "training.profile.warmup=1"]
    assert (
        load_config(recipe, [*on, "training.profile.active=18"]).training.profile.active == 18
    )  # 20 batches
    with pytest.raises(
        ConfigError, match=r"window \(wait 1 \+ warmup 1 \+ active 19 = 21 batches\) ends after"
    ):
        load_config(recipe, [*on, "training.profile.active=19"])
    tokens = "training.max_duration=2560tok"  # 10 steps of 8 x 32 tokens
    with pytest.raises(ConfigError, match=r"ends after the run's 10 \(training.max_duration=2560tok\)"):
        load_config(recipe, [*on, "training.profile.active=9", tokens])
