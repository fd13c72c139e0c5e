"""Float8 training (`training.float8`): torchao's float8 linear layers in the decoder blocks.

Only the blocks' linear layers (attention q/k/v/o and the SwiGLU's three) compute in float8; the
embedding, the output projection and the norms stay in the compute dtype. torchao (extra
`float8`, pinned to the release that pairs with torch 2.7) swaps each such `nn.Linear` for its
`Float8Linear` with dynamic tensor-wise scaling: parameter names and fp32 master weights are
unchanged, so checkpoints, resume and HF export see ordinary weights. Under FSDP2 the block
weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`) unless
`training.float8.all_gather=false`.

Float8 tensor cores need compute capability 8.9 (H100/H200, L4, RTX 40xx). Elsewhere
`training.float8.emulate=true` runs the same casts with higher-precision matmuls (tests, CPUs).
"""

from __future__ import annotations

import torch
from torch import nn

from llm.errors import ConfigError

FLOAT8_CAPABILITY = (8, 9)


def float8_hardware(device: str) -> bool:
    return (
        device == "gpu"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= FLOAT8_CAPABILITY
    )


def check_float8(emulate: bool, device: str) -> None:
    """ConfigError unless float8 can run here: the extra installed, and float8 hardware or emulation."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("training.float8.enabled=true needs torchao: pip install -e '.[float8]'") from None
    if not emulate and not float8_hardware(device):
        where = torch.cuda.get_device_name() if device == "gpu" and torch.cuda.is_available() else device
        raise ConfigError(
            f"training.float8 needs float8 tensor cores (compute capability 8.9+, e.g. H100) and this "
            f"machine has {where}; set training.float8.enabled=false, or training.float8.emulate=true to test"
        )


def _block_linear(module: nn.Module, fqn: str) -> bool:
    # Only linear layers inside the decoder blocks; torchao also needs dims divisible by 16.
    return fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, cfg, fsdp: bool, device: str) -> int:
    """Swap the blocks' linear layers of `model` (a Transformer) for float8 ones; returns how many."""
    check_float8(cfg.emulate, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(emulate=cfg.emulate, enable_fsdp_float8_all_gather=fsdp and cfg.all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=_block_linear)
    return sum(isinstance(m, Float8Linear) for m in model.modules())
