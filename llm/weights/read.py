"""`read_weights(path)`: our-named tensors from any source, reading nothing that can run code.

Sources (local paths or `s3://`):
- a Composer checkpoint file (`ep0-ba100-rank0.pt`; `llm.weights.composer_layout`);
- a run's checkpoint folder: its newest checkpoint whose manifest verifies, picked exactly as
  resume picks it (`llm.weights.run_folder`);
- a sharded checkpoint folder (torch.distributed.checkpoint, `.metadata`), gathered in memory;
- a file written by `llm import` (`save_composer_weights`): the same layout plus the model config;
- a Hugging Face Llama folder (`config.json` + safetensors or `.bin`, possibly sharded), such as
  `llm export` writes (`llm.weights.hf`).

Without `trust` (the commands' `--trust`) every file goes through `llm.weights.safe_load`, and a
checkpoint file inside a run's folder must match its manifests; `--trust` loads a file as it is.
`load_model(path)` reads and then builds the model (`llm.weights.build`).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import torch

from llm.errors import ConfigError
from llm.model import Transformer
from llm.weights.build import LoadedWeights, model_from_weights
from llm.weights.composer_layout import weights_from_checkpoint
from llm.weights.hf import read_hf_folder
from llm.weights.run_folder import check_against_run_folder, is_run_folder, newest_verified_checkpoint
from llm.weights.safe_load import load_pickle, read_sharded
from storage import download_url, is_remote


def read_weights(path: str, *, trust: bool = False) -> LoadedWeights:
    """Our-named tensors (and the model config if recorded) from any source in the module docstring.

    Without `trust` nothing in the source can run code, and a checkpoint inside a run folder must
    match its manifest (see the module docstring).
    """
    verified = is_run_folder(path)
    if verified:
        path = newest_verified_checkpoint(path)
    local = local_copy(path)
    if not verified and not trust:
        check_against_run_folder(path, local)
    if local.is_dir() and (local / ".metadata").is_file():
        return weights_from_checkpoint(read_sharded(local, trust), path)
    if local.is_dir() and (local / "config.json").is_file():
        return read_hf_folder(local, trust)
    if local.is_dir():
        raise ConfigError(
            f"{path} is a folder with neither checkpoint manifests nor config.json: pass a checkpoint "
            f"file (e.g. ep0-ba100-rank0.pt), a run's checkpoint folder or a folder written by `llm export`"
        )
    return weights_from_checkpoint(load_pickle(local, path, trust=trust), path)


def load_model(
    path: str, recipe: str | None = None, device: str | torch.device = "cpu", *, trust: bool = False
) -> Transformer:
    """A Transformer with the weights at `path`, in eval mode, shaped by `recipe` or the checkpoint
    (`trust`: see `read_weights`)."""
    return model_from_weights(read_weights(path, trust=trust), path, recipe, device)


def local_copy(path: str) -> Path:
    """`path` itself if local (FileNotFoundError if absent), else a fresh download of the object."""
    if not is_remote(path):
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return local
    folder = Path(tempfile.gettempdir()) / "llm-downloads" / hashlib.sha256(path.encode()).hexdigest()[:16]
    return download_url(path, folder / path.rstrip("/").rsplit("/", 1)[-1])
