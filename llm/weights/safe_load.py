"""The one reader of weight files: nothing in a file the user did not trust runs code.

Pickles (Composer checkpoints, `.pth`, `.bin`) are read with `torch.load(weights_only=True)` plus
`SAFE_GLOBALS`, the few harmless types a Composer 0.32.1 checkpoint needs besides tensors (numpy
arrays and dtypes of the RNG states, `timedelta`, `TorchVersion`). A pickle that needs anything
else is refused with the names it asks for. Safetensors files hold no code and need nothing.

A sharded checkpoint folder (torch.distributed.checkpoint, `.metadata`) is gathered into one dict
in memory. torch unpickles its `.metadata` and every non-tensor item in full, and offers no public
way to read such a folder into memory without that: untrusted, the folder goes through torch's
loader with a restricted `.metadata` unpickler and a planner that reads each item with
`load_pickle` (this module is the only one that uses torch's private loader and planner for it).
Trusted (`trust=True`, the commands' `--trust`), torch's public
`format_utils.dcp_to_torch_save` writes the gathered dict to a temporary file that is then
loaded in full.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from llm.errors import ConfigError

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


def read_tensor_file(path: Path, trust: bool = False) -> dict[str, Tensor]:
    """The tensors of one `.safetensors` file, or of a pickled state dict (`load_pickle`)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return load_pickle(path, str(path), trust=trust)


def read_sharded(folder: Path, trust: bool = False) -> dict[str, Any]:
    """A sharded (FSDP, torch.distributed.checkpoint) save, gathered into one dict in memory."""
    if trust:
        # ~1 s to import: only here
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="llm-dcp-") as tmp:
            gathered = Path(tmp) / "gathered.pt"
            dcp_to_torch_save(folder, gathered)
            return torch.load(gathered, map_location="cpu", weights_only=False)
    return _read_sharded_restricted(folder)


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


def _read_sharded_restricted(folder: Path) -> dict[str, Any]:
    """`read_sharded` without trust: `.metadata` and every non-tensor item through the restricted
    loaders here (tensors torch already reads with weights_only=True)."""
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
    try:
        _load_state_dict(state, storage_reader=Reader(source), planner=Planner(), no_dist=True)
    except (Exception, CheckpointException):  # CheckpointException is a BaseException
        if refused:
            raise refused[0] from None
        raise
    return state
