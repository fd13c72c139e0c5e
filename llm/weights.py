"""Model weights in and out: the one module that reads them, names them and loads them.

Sources `read_weights` understands (local paths or `s3://`):
- a Composer checkpoint file (`ep0-ba100-rank0.pt`): a pickled dict whose `state.model` holds the
  ComposerModel's state dict, keys behind wrapper levels (`model.`, `_orig_mod.`, FSDP's ...);
- a run's checkpoint folder: its newest checkpoint whose manifest verifies, picked exactly as
  resume picks it (`llm.checkpoint.newest_usable_checkpoint`), so a corrupt newest save gives way
  to the previous good one; `latest.json` alone is not trusted;
- a sharded checkpoint folder (torch.distributed.checkpoint, `.metadata`), gathered in memory;
- a file written by `save_composer_weights` (`llm import`): the same layout plus the model config;
- a Hugging Face Llama folder (`config.json` + safetensors or `.bin`, possibly sharded), such as
  `llm export` writes.

Names: ours are llama2.c's (baby-llama2-chinese uses them too). `HF_TOP` / `HF_LAYER` map them to
Hugging Face Llama's, for export and for every import; Baichuan-7B differs from Llama only in
fusing q, k and v into one `W_pack` matrix. `HF_CONFIG` maps our `ModelConfig` fields to
`config.json` keys the same way. (transformers ships no importable map for these layouts: its
Llama conversion is a repository script, absent from the installed package.)

Shapes are checked against the model config before anything is copied; a mismatch names the
first tensors that differ, with both shapes.

Reading never runs code from a file the user did not trust (`trust=True`, the commands' `--trust`):
pickles (Composer checkpoints, `.pth`, `.bin`) are read with `torch.load(weights_only=True)` plus
`SAFE_GLOBALS`, the few harmless types a Composer 0.32.1 checkpoint needs besides tensors (numpy
arrays and dtypes of the RNG states, `timedelta`, `TorchVersion`); a sharded checkpoint's
`.metadata` goes through an unpickler that admits only torch.distributed.checkpoint's own
metadata types. A pickle that needs anything else is refused with the names it asks for.
A checkpoint file inside a run's folder must be one its manifests record, and is checked against
them (size, and SHA-256 up to `LLM_CKPT_VERIFY_MAX_BYTES`) as resume checks it; `--trust` loads a
file as it is. Safetensors files hold no code and need nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib
import inspect
import io
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from llm.checkpoint import manifest
from llm.checkpoint.resume import newest_usable_checkpoint, verify_limit
from llm.config import load_config
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from shards.chat_template import CHAT_TEMPLATE_KEY, TEMPLATE_FILE
from storage import download_url, is_remote, open_store

MODEL_CONFIG_KEY = "llm_model_config"  # where `llm import` and the generation callback store the shape
ROOT_NAMES = ("tok_embeddings.", "layers.", "norm.", "output.")
WRAPPER_LEVELS = {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}

# ours -> Hugging Face Llama, per layer and at the top level
HF_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FUSED_QKV = "self_attn.W_pack.weight"  # Baichuan-7B: [q; k; v] stacked along the rows
FROM_HF_LAYER = {hf: ours for ours, hf in HF_LAYER.items()}
FROM_HF_TOP = {hf: ours for ours, hf in HF_TOP.items()}

# ModelConfig field -> config.json key (Llama's; Baichuan-7B's uses the same keys)
HF_CONFIG = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
# what transformers' LlamaConfig assumes for an absent key
HF_DEFAULTS = {"max_seq_len": 2048, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False}


_NUMPY_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core to np._core
# Beyond tensors and plain containers, what a Composer 0.32.1 checkpoint pickles (its RNG states and
# timestamp; found with torch.serialization.get_unsafe_globals_in_checkpoint). None of these runs
# code of the file's choosing: they rebuild arrays, dtypes, durations and a version string.
SAFE_GLOBALS = [
    np.ndarray,
    np.dtype,
    *(c for _, c in inspect.getmembers(np.dtypes, inspect.isclass) if issubclass(c, np.dtype)),
    _NUMPY_CORE.multiarray._reconstruct,
    _NUMPY_CORE.multiarray.scalar,
    datetime.timedelta,
    torch.torch_version.TorchVersion,
]
TRUST_HINT = "pass --trust to load it anyway (only for a file you trust: unpickling it can run code)"


# --- names -----------------------------------------------------------------------------------


def strip_wrappers(state: dict[str, Any]) -> dict[str, Tensor]:
    """Our parameter names from `model._orig_mod.layers.0...`-style keys; non-tensors dropped.

    Wrapper levels (torch.compile, DDP, FSDP, activation checkpointing) are removed wherever they
    sit; then leading attribute names (the ComposerModel's `model.`) up to one of ours.
    """
    out = {}
    for key, value in state.items():
        name = ".".join(p for p in key.split(".") if p not in WRAPPER_LEVELS)
        while name and not name.startswith(ROOT_NAMES) and "." in name:
            name = name.split(".", 1)[1]
        if name.startswith(ROOT_NAMES) and isinstance(value, Tensor):
            out[name] = value
    return out


def to_hf(tensors: dict[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """Our tensors under Hugging Face Llama names, on the CPU (no lm_head when `tied`)."""
    out = {}
    for name, tensor in tensors.items():
        if name in HF_TOP:
            hf = HF_TOP[name]
        else:
            _, index, rest = name.split(".", 2)
            hf = f"model.layers.{index}.{HF_LAYER[rest]}"
        out[hf] = tensor.detach().to("cpu").contiguous()
    if tied:
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return out


def from_hf(tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Our tensors from Hugging Face Llama or Baichuan-7B names (W_pack split into q, k, v)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        if name in FROM_HF_TOP:
            out[FROM_HF_TOP[name]] = tensor
            continue
        parts = name.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"]:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
        prefix, rest = f"layers.{parts[2]}.", parts[3]
        if rest == FUSED_QKV:
            for ours, part in zip(("wq", "wk", "wv"), tensor.chunk(3, dim=0), strict=True):
                out[f"{prefix}attention.{ours}.weight"] = part
        elif rest in FROM_HF_LAYER:
            out[prefix + FROM_HF_LAYER[rest]] = tensor
        else:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
    return out


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """`config.json` for `transformers.LlamaForCausalLM`."""
    values = dataclasses.asdict(cfg) | {"n_kv_heads": cfg.kv_heads, "hidden_dim": cfg.ffn_hidden_dim}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{key: values[field] for field, key in HF_CONFIG.items()},
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(data: dict[str, Any]) -> ModelConfig:
    """Our model config from a Llama `config.json` (absent optional keys: transformers' defaults)."""
    values = {field: data[key] for field, key in HF_CONFIG.items() if data.get(key) is not None}
    values = HF_DEFAULTS | values
    values.setdefault("n_kv_heads", values["n_heads"])
    return ModelConfig(**values)


# --- files -----------------------------------------------------------------------------------


def load_pickle(path: str | os.PathLike | io.BytesIO, source: str, *, trust: bool = False) -> Any:
    """`torch.load` of a pickle that can run no code (ConfigError naming what else it needs);
    with `trust`, a full unpickling. A file torch cannot read at all is a ConfigError too."""
    try:
        if trust:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        wanted = [] if trust else _unsafe_globals(path)
        if wanted:
            raise ConfigError(
                f"{source} holds pickled objects other than weights ({', '.join(wanted[:4])}), which "
                f"can run code when loaded; {TRUST_HINT}"
            ) from None
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"{source} is not a readable torch checkpoint ({reason})") from None


def _unsafe_globals(path: str | os.PathLike | io.BytesIO) -> list[str]:
    """The names a pickle asks for beyond the allowed ones (read from its opcodes, nothing run)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        if isinstance(path, io.BytesIO):
            path.seek(0)
        names = get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: say nothing more than that it could not be read
        return []
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return [n for n in names if n not in allowed]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's `.metadata` (torch.distributed.checkpoint reads it with a
    plain `pickle.load`), admitting only its own metadata types and a few harmless ones."""

    MODULE = "torch.distributed.checkpoint.metadata"
    NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in self.NAMES:
                return super().find_class(module, name)
            if module == self.MODULE:
                found = getattr(importlib.import_module(module), name, None)
                if inspect.isclass(found) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def local_copy(path: str) -> Path:
    """`path` itself if local (FileNotFoundError if absent), else a fresh download of the object."""
    if not is_remote(path):
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return local
    folder = Path(tempfile.gettempdir()) / "llm-downloads" / hashlib.sha256(path.encode()).hexdigest()[:16]
    return download_url(path, folder / path.rstrip("/").rsplit("/", 1)[-1])


def read_hf_tensors(src: Path, trust: bool = False) -> dict[str, Tensor]:
    """All tensors of a HF checkpoint: one file, or a folder (single file or shards + index json)."""
    if src.is_file():
        return _read_tensor_file(src, trust)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = src / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in _read_tensor_file(src / shard, trust).items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return _read_tensor_file(src / single, trust)
    raise FileNotFoundError(
        f"{src} holds no model.safetensors, pytorch_model.bin or their sharded index json"
    )


def _read_tensor_file(path: Path, trust: bool = False) -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return load_pickle(path, str(path), trust=trust)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- reading ---------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadedWeights:
    tensors: dict[str, Tensor]  # our parameter names
    model_config: ModelConfig | None  # the shape, when the source records it
    chat_template: dict | None = None  # an SFT run's chat template, when recorded (shards.chat_template)


def read_weights(path: str, *, trust: bool = False) -> LoadedWeights:
    """Our-named tensors (and the model config if recorded) from any source in the module docstring.

    Without `trust` nothing in the source can run code, and a checkpoint inside a run folder must
    match its manifest (see the module docstring).
    """
    verified = _is_run_folder(path)
    if verified:
        path = _newest_verified_checkpoint(path)
    local = local_copy(path)
    if not verified and not trust:
        _check_against_run_folder(path, local)
    if local.is_dir() and (local / ".metadata").is_file():
        return _from_composer_dict(_read_sharded(local, trust), path)
    if local.is_dir() and (local / "config.json").is_file():
        data = json.loads((local / "config.json").read_text(encoding="utf-8"))
        template_file = local / TEMPLATE_FILE
        template = json.loads(template_file.read_text(encoding="utf-8")) if template_file.is_file() else None
        return LoadedWeights(
            from_hf(read_hf_tensors(local, trust), str(local)), config_from_hf(data), template
        )
    if local.is_dir():
        raise ConfigError(
            f"{path} is a folder with neither checkpoint manifests nor config.json: pass a checkpoint "
            f"file (e.g. ep0-ba100-rank0.pt), a run's checkpoint folder or a folder written by `llm export`"
        )
    return _from_composer_dict(load_pickle(local, path, trust=trust), path)


def _check_against_run_folder(path: str, local: Path) -> None:
    """ConfigError unless `path`, if it lies in a run's checkpoint folder, is a checkpoint its
    manifests record, complete and matching their sizes and SHA-256 (as resume checks it);
    `local` is its local copy (itself, for a local path)."""
    if is_remote(path):
        parent, _, name = path.rstrip("/").rpartition("/")
    else:
        parent, name = str(Path(path).parent), Path(path).name
    if not _is_run_folder(parent):
        return
    ckpts, listing = manifest.scan(open_store(parent))
    ckpt = next((c for c in ckpts if c.load_path == name), None)
    if ckpt is None:
        raise ConfigError(
            f"{path} is not a checkpoint that the manifests of its run folder record (an interrupted "
            f"save, or a file put there by hand): pass the folder {parent} for its newest verified "
            f"checkpoint, or {TRUST_HINT}"
        )
    problem = manifest.size_problem(ckpt, listing)
    if problem is None and sum(f["size"] for f in ckpt.files.values()) <= verify_limit():
        problem = manifest.hash_problem(ckpt.files, local.parent)  # the files lie beside `local`
    if problem:
        raise ConfigError(
            f"{path} does not match its manifest in {parent}: {problem}; pass the folder {parent} to "
            f"use its newest checkpoint that verifies"
        )


def _is_run_folder(path: str) -> bool:
    if is_remote(path):
        return bool(open_store(path).list(manifest.MANIFEST_DIR))
    folder = Path(path)
    return folder.is_dir() and (
        (folder / manifest.MANIFEST_DIR).is_dir() or (folder / manifest.LATEST).is_file()
    )


def _newest_verified_checkpoint(folder: str) -> str:
    """The checkpoint resume would pick in a run's folder (StorageError if every one is corrupt)."""
    point = newest_usable_checkpoint(folder)
    if point is None:
        raise ConfigError(
            f"{folder} holds no complete checkpoint (no complete manifests; latest.json alone is not "
            f"trusted): pass a checkpoint file instead"
        )
    if is_remote(point.load_path):  # a sharded checkpoint: resume reads its shards in place
        raise ConfigError(
            f"the newest checkpoint in {folder} is sharded ({point.load_path}): download that folder "
            f"and pass the local copy"
        )
    return point.load_path


def _from_composer_dict(obj: Any, path: str) -> LoadedWeights:
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} holds a {type(obj).__name__}, not a checkpoint dict")
    state = obj.get("state", {}).get("model") if isinstance(obj.get("state"), dict) else None
    if state is None:
        raise ConfigError(
            f"{path} is not a Composer checkpoint (no state.model); for baby-llama2-chinese or "
            f"Baichuan weights run `llm import` first"
        )
    return LoadedWeights(strip_wrappers(state), _recorded_config(obj), _recorded(obj, CHAT_TEMPLATE_KEY))


def _read_sharded(folder: Path, trust: bool = False) -> dict[str, Any]:
    """A sharded (FSDP, torch.distributed.checkpoint) save, gathered into one dict in memory.

    torch.distributed.checkpoint unpickles `.metadata` and every non-tensor item in full; without
    `trust` both go through the restricted loaders here instead (tensors it already reads with
    weights_only=True).
    """
    # ~1 s to import: only here
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    source = str(folder)
    refused: list[ConfigError] = []  # torch.distributed.checkpoint wraps what these raise: kept here

    class Reader(FileSystemReader):
        def read_metadata(self):
            with open(folder / ".metadata", "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream).load()
                except pickle.UnpicklingError as err:
                    refused.append(
                        ConfigError(
                            f"{source}/.metadata asks for {err}, not a checkpoint metadata type; {TRUST_HINT}"
                        )
                    )
                    raise refused[-1] from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # Read without running code, then hand the planner our own re-pickling of the result.
            try:
                obj = load_pickle(value, f"{source} ({read_item.dest_index.fqn})")
            except ConfigError as err:
                refused.append(err)
                raise
            safe = io.BytesIO()
            torch.save(obj, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    state: dict[str, Any] = {}
    reader = FileSystemReader(str(folder)) if trust else Reader(str(folder))
    planner = _EmptyStateDictLoadPlanner() if trust else Planner()
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException):  # CheckpointException is a BaseException
        if refused:
            raise refused[0] from None
        raise
    return state


def _recorded(obj: dict[str, Any], key: str) -> Any:
    """What the checkpoint stores under `key`, at its top level or in a callback's state."""
    recorded = obj.get(key)
    callbacks = obj.get("state", {}).get("callbacks") or {}
    for cb_state in callbacks.values():
        if recorded is None and isinstance(cb_state, dict):
            recorded = cb_state.get(key)
    return recorded


def _recorded_config(obj: dict[str, Any]) -> ModelConfig | None:
    """The model config stored by `llm import` or by the generation callback, if any."""
    recorded = _recorded(obj, MODEL_CONFIG_KEY)
    if not recorded:
        return None
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in recorded.items() if k in names})


# --- loading into a model --------------------------------------------------------------------


def load_model(
    path: str, recipe: str | None = None, device: str | torch.device = "cpu", *, trust: bool = False
) -> Transformer:
    """A Transformer with the weights at `path`, in eval mode, shaped by `recipe` or the checkpoint
    (`trust`: see `read_weights`)."""
    return model_from_weights(read_weights(path, trust=trust), path, recipe, device)


def model_from_weights(
    weights: LoadedWeights, path: str, recipe: str | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """`load_model` for weights already read (`read_weights`) from `path`."""
    if recipe:
        cfg = load_config(recipe).model
    elif weights.model_config is not None:
        cfg = weights.model_config
    else:
        raise ConfigError(
            f"{path} does not record the model's shape: pass --recipe with the recipe it was trained with"
        )
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    load_into(model, weights.tensors, source=path)
    return model.eval()


def load_into(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """Copy `tensors` into `model` after checking tying, names and shapes (ConfigError if wrong)."""
    tensors = drop_tied_output(tensors, model.cfg, source)
    check_shapes(model, tensors, source)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


def drop_tied_output(
    tensors: dict[str, Tensor], cfg: ModelConfig, source: str, output_name: str = "output.weight"
) -> dict[str, Tensor]:
    """`tensors` fit for `cfg`: with tied embeddings, `output.weight` is dropped once seen equal to
    the embedding; a different one is a trained output layer the tie would throw away (ConfigError).
    `output_name` is what the source calls that matrix, for the message.
    """
    if not cfg.tie_embeddings or "output.weight" not in tensors:
        return tensors
    tensors = dict(tensors)
    output, embed = tensors.pop("output.weight"), tensors.get("tok_embeddings.weight")
    if embed is not None and not torch.equal(output, embed):
        raise ConfigError(
            f"{source} has its own output matrix ({output_name}), different from its embedding, but "
            f"the recipe ties the two: set model.tie_embeddings: false in the recipe to keep it"
        )
    return tensors


def check_shapes(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """ConfigError naming the first mismatched, missing and unexpected tensors, if any."""
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


# --- writing ---------------------------------------------------------------------------------


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
