"""Read model weights from wherever a trained model lives, into a `Transformer`.

Understood sources (local paths or `s3://`):
- a Composer checkpoint (`ep0-ba100-rank0.pt`, `latest-rank0.pt`): a pickled dict whose
  `state.model` holds the ComposerModel's state dict (`model.<param>` keys, possibly with
  `_orig_mod.` / `module.` wrapper levels);
- a file written by `llm import` (the same layout, plus the model config under `llm_model_config`);
- a folder written by `llm export` (Hugging Face Llama layout: `config.json`, `model.safetensors`).

Shapes are checked against the model config before anything is copied; a mismatch names the first
tensors that differ, with both shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer

MODEL_CONFIG_KEY = "llm_model_config"  # where `llm import` stores the model shape in its output
ROOT_NAMES = ("tok_embeddings.", "layers.", "norm.", "output.")
WRAPPER_LEVELS = {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


# --- files -----------------------------------------------------------------------------------


def download(uri: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local copy of `s3://bucket/key` (S3_ENDPOINT_URL and AWS_* are honoured)."""
    import boto3
    from botocore.exceptions import ClientError

    bucket, _, key = uri[len("s3://") :].partition("/")
    root = Path(cache_dir or Path(tempfile.gettempdir()) / "llm-downloads")
    local = root / hashlib.sha256(uri.encode()).hexdigest()[:16] / Path(key).name
    local.parent.mkdir(parents=True, exist_ok=True)
    client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)
    try:
        client.download_file(bucket, key, str(local))
    except ClientError as err:
        raise FileNotFoundError(f"cannot download {uri}: {err}") from None
    return local


def local_path(path: str) -> Path:
    """`path` itself if local (FileNotFoundError if absent), else a downloaded copy."""
    if path.startswith("s3://"):
        return download(path)
    local = Path(path)
    if not local.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return local


# --- reading state dicts -------------------------------------------------------------------


@dataclasses.dataclass
class LoadedWeights:
    tensors: dict[str, Tensor]  # our parameter names
    model_config: ModelConfig | None  # the shape, when the source records it


def read_weights(path: str) -> LoadedWeights:
    """Our-named tensors (and the model config if recorded) from a checkpoint file or export folder."""
    local = local_path(path)
    if local.is_dir() and (local / ".metadata").is_file():
        return _weights_from_dict(_read_sharded(local), path)
    if local.is_dir():
        if (local / "config.json").is_file():
            from llm.hf_export import read_hf_folder

            return read_hf_folder(local)
        if (local / "latest.json").is_file():  # a run's save_folder: take its newest checkpoint
            latest = json.loads((local / "latest.json").read_text(encoding="utf-8"))
            return read_weights(str(local / latest["load_path"]))
        raise ConfigError(
            f"{path} is a folder without config.json or latest.json: pass a checkpoint file (e.g. ep0-ba100-rank0.pt), a run's checkpoint folder "
            f"or a folder written by `llm export`"
        )
    return _weights_from_dict(torch.load(local, map_location="cpu", weights_only=False), path)


def _weights_from_dict(obj: Any, path: str) -> LoadedWeights:
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} holds a {type(obj).__name__}, not a checkpoint dict")
    state = obj.get("state", {}).get("model") if isinstance(obj.get("state"), dict) else None
    if state is None:
        raise ConfigError(
            f"{path} is not a Composer checkpoint (no state.model); for baby-llama2-chinese or "
            f"Baichuan weights run `llm import` first"
        )
    return LoadedWeights(strip_prefixes(state), _recorded_config(obj))


def _read_sharded(folder: Path) -> dict[str, Any]:
    """A sharded (FSDP, torch.distributed.checkpoint) save, gathered into one dict in memory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(folder), str(merged))
        return torch.load(merged, map_location="cpu", weights_only=False)


def strip_prefixes(state: dict[str, Any]) -> dict[str, Tensor]:
    """Map `model._orig_mod.layers.0...` style keys to our names; drop non-parameter entries."""
    out = {}
    for key, value in state.items():
        parts = [p for p in key.split(".") if p not in WRAPPER_LEVELS]
        name = ".".join(parts)
        while name and not name.startswith(ROOT_NAMES) and "." in name:
            name = name.split(".", 1)[1]  # the ComposerModel's attribute ("model.") and the like
        if name.startswith(ROOT_NAMES) and isinstance(value, Tensor):
            out[name] = value
    return out


def _recorded_config(obj: dict[str, Any]) -> ModelConfig | None:
    """The model config stored by `llm import` or by the generation callback, if any."""
    recorded = obj.get(MODEL_CONFIG_KEY)
    callbacks = obj.get("state", {}).get("callbacks") or {}
    for cb_state in callbacks.values():
        if recorded is None and isinstance(cb_state, dict):
            recorded = cb_state.get(MODEL_CONFIG_KEY)
    return model_config_from_dict(recorded) if recorded else None


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in data.items() if k in names})


# --- building the model ----------------------------------------------------------------------


def resolve_model_config(weights: LoadedWeights, recipe: str | None, source: str) -> ModelConfig:
    """The model shape: the recipe's if given, else the one the checkpoint records."""
    if recipe:
        from llm.config import load_config

        return load_config(recipe).model
    if weights.model_config is not None:
        return weights.model_config
    raise ConfigError(
        f"{source} does not record the model's shape: pass --recipe with the recipe it was trained with"
    )


def load_model(path: str, recipe: str | None = None, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer with the weights at `path`, in eval mode, shaped by `recipe` or the checkpoint."""
    weights = read_weights(path)
    cfg = resolve_model_config(weights, recipe, path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    load_into(model, weights.tensors, source=path)
    return model.eval()


def load_into(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """Copy `tensors` into `model` after checking names and shapes (ConfigError lists problems)."""
    tensors = dict(tensors)
    if model.cfg.tie_embeddings:
        embed, output = tensors.get("tok_embeddings.weight"), tensors.pop("output.weight", None)
        if output is not None and embed is not None and not torch.equal(output, embed):
            raise ConfigError(
                f"{source} has separate output and embedding weights but the recipe ties them: "
                f"set model.tie_embeddings=false"
            )
    check_shapes(model, tensors, source)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


def check_shapes(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    mismatched = [
        f"{name}: checkpoint {tuple(t.shape)} vs model {expected[name]}"
        for name, t in tensors.items()
        if name in expected and tuple(t.shape) != expected[name]
    ]
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    problems = []
    if mismatched:
        problems.append("shape mismatch in " + "; ".join(mismatched[:3]))
    if missing:
        problems.append("missing " + ", ".join(missing[:3]))
    if unexpected:
        problems.append("unexpected " + ", ".join(unexpected[:3]))
    if problems:
        raise ConfigError(
            f"{source} does not fit the model config ({len(mismatched)} mismatched, {len(missing)} "
            f"missing, {len(unexpected)} unexpected tensors): {' | '.join(problems)}; use the recipe "
            f"the checkpoint was trained with"
        )


# --- writing checkpoints Composer can load -----------------------------------------------------


def save_composer_weights(
    tensors: dict[str, Tensor], cfg: ModelConfig, out: str | os.PathLike, prefix: str = "model."
) -> Path:
    """Write `tensors` (our names) as a Composer checkpoint for `load_weights_only=true`.

    Composer reads `state.model` with the ComposerModel's keys: our `LanguageModel` holds the
    Transformer as `.model`, hence the `model.` prefix. The config is stored alongside so
    `llm generate` needs no recipe.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {prefix + name: t.contiguous() for name, t in tensors.items()}
    if cfg.tie_embeddings:
        state[prefix + "output.weight"] = state[prefix + "tok_embeddings.weight"]
    payload = {"state": {"model": state}, MODEL_CONFIG_KEY: dataclasses.asdict(cfg)}
    torch.save(payload, out)
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
