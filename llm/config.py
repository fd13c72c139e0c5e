"""The typed training config: YAML recipe + dotted overrides -> validated dataclasses.

A recipe is plain YAML read with OmegaConf, so `${...}` interpolation works
(`run_dir: runs/${run_name}`). Overrides are `key=value` strings with dotted keys
(`optimizer.lr=1e-4`, `data.train.0.remote=s3://bkt/wiki/train`). Everything is validated once,
here: an unknown key names the closest valid one, a wrong type names the expected type, and the
rest of the code receives a `TrainConfig`, never a raw dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm.errors import ConfigError
from llm.model import ModelConfig

DEFAULT_PROMPTS = ["床前明月光", "请你讲一个童话故事：", "感冒的症状是"]
_TIME_RE = re.compile(r"^\d+(ba|tok|ep|sp)$")


@dataclass
class StreamConfig:
    remote: str  # a split folder (holds index.json + meta.json): local path or s3://bucket/prefix
    local: str | None = None  # cache folder; None -> <data.cache_root>/<run_name>/<train|eval>/<i>-<hash>
    proportion: float | None = None  # mixing weight; all streams set it or none does


@dataclass
class DataConfig:
    train: list[StreamConfig]
    eval: list[StreamConfig] = field(default_factory=list)  # empty -> no evaluation
    cache_root: str = "/tmp/llm-stream-cache"
    shuffle: bool = True
    shuffle_seed: int = 9176
    num_workers: int = 0
    check_tokenizer_hash: bool = True  # refuse shards made with a different tokenizer file


@dataclass
class TokenizerConfig:
    path: str  # SentencePiece .model


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # 2-D weights only (matrices, embeddings); norms are not decayed


@dataclass
class SchedulerConfig:
    warmup: str = "1000ba"  # linear warmup, then cosine from optimizer.lr to min_lr at max_duration
    min_lr: float = 1e-5


@dataclass
class TrainingConfig:
    global_batch_size: int = 32  # samples per optimizer step, all ranks together
    device_microbatch_size: int = 32  # samples per forward/backward on one device
    max_duration: str = "1000ba"  # batches ("2000ba") or tokens ("50000000tok")
    grad_clip_norm: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # auto | fp32 | amp_bf16 | amp_fp16 (auto: amp_bf16 on GPU, fp32 on CPU)
    device: str = "auto"  # auto | cpu | gpu
    eval_interval: str = "500ba"
    eval_subset_num_batches: int = -1  # -1: the whole validation split
    compile: bool = False  # torch.compile the model
    log_interval: int = 10  # batches between console lines


@dataclass
class FSDPConfig:
    enabled: bool = False
    version: int = 1  # 1: Composer's default (GPU only); 2: FSDP2 (also runs on CPU over gloo)
    sharding_strategy: str = "FULL_SHARD"
    mixed_precision: str = "DEFAULT"
    activation_checkpointing: bool = True
    state_dict_type: str = "sharded"  # full | sharded
    sync_module_states: bool = False
    init_on_meta: bool = True  # build on the meta device; FSDP materialises each rank's shard


@dataclass
class CheckpointConfig:
    save_folder: str | None = None  # local folder or s3://...; None disables saving
    save_interval: str = "500ba"
    num_to_keep: int = 3  # -1 keeps every checkpoint
    autoresume: bool = True  # effective whenever run_name and save_folder are set
    load_path: str | None = None  # a checkpoint to start from
    load_weights_only: bool = False
    allow_untrusted_load_path: bool = False  # checkpoints are pickles: see README "Checkpoint safety"


@dataclass
class GenerateCallbackConfig:
    enabled: bool = True
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    interval: str = "500ba"
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 1234


@dataclass
class CallbacksConfig:
    generate: GenerateCallbackConfig = field(default_factory=GenerateCallbackConfig)
    speed_window: int = 10
    memory_monitor: bool = True  # GPU only
    loss_plot: bool = True  # <run_dir>/loss.png at the end of training


@dataclass
class LoggersConfig:
    progress_bar: bool = True
    metrics_file: bool = True  # <run_dir>/metrics.jsonl
    tensorboard: bool = False  # <run_dir>/tensorboard


@dataclass
class TrainConfig:
    model: ModelConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    run_name: str | None = None  # None: env RUN_NAME / COMPOSER_RUN_NAME, else the recipe's file name
    seed: int = 17
    run_dir: str = "runs/${run_name}"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    loggers: LoggersConfig = field(default_factory=LoggersConfig)

    @property
    def seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one rank at world size 1."""
        return self.training.global_batch_size // self.training.device_microbatch_size

    def check_world_size(self, world_size: int) -> int:
        """Per-rank batch size for `world_size` ranks; ConfigError if the batch does not divide."""
        t = self.training
        if t.global_batch_size % (world_size * t.device_microbatch_size):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by world size "
                f"{world_size} x training.device_microbatch_size={t.device_microbatch_size}; "
                f"choose a global batch that is a multiple of {world_size * t.device_microbatch_size}"
            )
        return t.global_batch_size // world_size

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return _redact(data) if redact else data


# --- loading ----------------------------------------------------------------------------------


def load_config(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read a YAML recipe, apply `key=value` overrides, resolve `${...}`, validate, return it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; pass a YAML file such as recipes/demo.yaml")
    try:
        raw = OmegaConf.load(path)
        if not isinstance(raw, typing.Mapping) and not OmegaConf.is_dict(raw):
            raise ConfigError(f"recipe {path} must be a YAML mapping of sections, got {type(raw).__name__}")
        for item in overrides:
            _apply_override(raw, item)
        if OmegaConf.select(raw, "run_name") is None:
            raw.run_name = os.environ.get("RUN_NAME") or os.environ.get("COMPOSER_RUN_NAME") or path.stem
        if OmegaConf.select(raw, "run_dir") is None:  # the dataclass default must interpolate too
            raw.run_dir = _field_default(TrainConfig, "run_dir")
        resolved = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"recipe {path}: {str(err).splitlines()[0]}") from None
    cfg = _build(TrainConfig, resolved, "")
    validate(cfg)
    return cfg


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _apply_override(raw, item: str) -> None:
    from omegaconf import OmegaConf

    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value, e.g. optimizer.lr=1e-4")
    key, value = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    OmegaConf.update(raw, key, _parse_value(value), merge=True, force_add=True)


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML (numbers, bools, null, lists); fall back to the string."""
    import yaml

    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _build(cls: type, data: Any, where: str) -> Any:
    """Turn a nested dict into dataclass `cls`, checking keys and types; `where` is the key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the recipe'} must be a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(_join(where, key), key, list(fields)))
    kwargs = {}
    for name, f in fields.items():
        key = _join(where, name)
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key} is required but missing from the recipe")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {_show(value)}")
        return [_coerce(args[0], v, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} numbers, got {_show(value)}")
        return tuple(_coerce(a, v, f"{key}.{i}") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    return _scalar(tp, value, key)


def _scalar(tp: type, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    elif tp is Any:
        return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {_show(value)}")


def _type_name(tp: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _unknown_key_message(path: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key '{path}': {hint}valid keys here: {', '.join(valid)}"


# --- cross-field validation -----------------------------------------------------------------


def validate(cfg: TrainConfig) -> None:
    """Checks that involve more than one field; raises ConfigError."""
    try:
        cfg.model.validate()
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    t = cfg.training
    for name in ("global_batch_size", "device_microbatch_size"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"training.{name} must be positive, got {getattr(t, name)}")
    if t.global_batch_size % t.device_microbatch_size:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"training.device_microbatch_size={t.device_microbatch_size}; gradient accumulation "
            "needs a whole number of micro-batches"
        )
    _check_time("training.max_duration", t.max_duration, ("ba", "tok", "ep"))
    _check_time("training.eval_interval", t.eval_interval, ("ba", "tok", "ep"))
    _check_time("scheduler.warmup", cfg.scheduler.warmup, ("ba", "tok"))
    _check_time("checkpoint.save_interval", cfg.checkpoint.save_interval, ("ba", "tok", "ep"))
    _check_time("callbacks.generate.interval", cfg.callbacks.generate.interval, ("ba", "tok", "ep"))
    _check_choice("training.precision", t.precision, ("auto", "fp32", "amp_bf16", "amp_fp16"))
    _check_choice("training.device", t.device, ("auto", "cpu", "gpu"))
    _check_choice("fsdp.version", cfg.fsdp.version, (1, 2))
    _check_choice("fsdp.state_dict_type", cfg.fsdp.state_dict_type, ("full", "sharded"))
    if not cfg.data.train:
        raise ConfigError("data.train needs at least one stream (remote: <folder or s3:// of a split>)")
    for section in ("train", "eval"):
        streams = getattr(cfg.data, section)
        given = [s.proportion is not None for s in streams]
        if any(given) and not all(given):
            raise ConfigError(f"data.{section}: set proportion on every stream or on none")
        for i, s in enumerate(streams):
            if s.proportion is not None and s.proportion <= 0:
                raise ConfigError(f"data.{section}.{i}.proportion must be positive, got {s.proportion}")
    if not 0 < cfg.optimizer.lr:
        raise ConfigError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if cfg.scheduler.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"scheduler.min_lr={cfg.scheduler.min_lr} is above optimizer.lr={cfg.optimizer.lr}")


def _check_time(key: str, value: str, units: tuple[str, ...]) -> None:
    match = _TIME_RE.match(value.strip())
    if not match or match.group(1) not in units:
        examples = ", ".join(f"100{u}" for u in units)
        raise ConfigError(f"{key}={value!r} is not a duration; use an integer with a unit: {examples}")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")


# --- saving -----------------------------------------------------------------------------------

_SECRET_KEY = re.compile(r"(secret|password|passwd|credential|api_key|access_key|session_token)", re.I)
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+:[^/@\s]+@")


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        if key and _SECRET_KEY.search(key):
            return "***"
        return _URL_CREDENTIALS.sub("***@", value)
    return value


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, credentials redacted."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(redact=True), sort_keys=False, allow_unicode=True)


def save_resolved(cfg: TrainConfig, path: str | os.PathLike) -> Path:
    """Write the resolved, redacted config (atomically) so a run records what it ran."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    tmp.replace(path)
    return path
