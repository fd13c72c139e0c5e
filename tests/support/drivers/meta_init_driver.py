"""Run under `composer -n 2`: shard a meta-built model with FSDP2, record weights and host memory.

    FSDP_VERSION=2 composer -n 2 tests/support/drivers/meta_init_driver.py OUT.json

Rank 0 writes OUT.json: whether the gathered full state dict equals an ordinary single-process
`Transformer(cfg, seed)`, and every rank's peak resident-memory growth while it built its shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from torch import nn  # noqa: E402

from llm.meta_init import build_meta_model, materialize_, shard_fsdp2  # noqa: E402
from llm.model import ModelConfig, Transformer  # noqa: E402

SEED = 1234
# ~51 M parameters (205 MB in fp32) in 16 blocks: big enough that a full copy per rank would
# stand out against the Python + torch baseline, small enough for two CPU ranks in seconds.
CFG = ModelConfig(vocab_size=1024, dim=512, n_layers=16, n_heads=8, max_seq_len=64, tie_embeddings=True)
# The warm-up model is checked too: 97 vocabulary rows over 2 ranks make uneven shards, and it
# has grouped-query attention (one key/value head for two query heads).
WARMUP_CFG = ModelConfig(
    vocab_size=97, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8, tie_embeddings=True
)


def build_sharded_model(
    cfg: ModelConfig, seed: int, device: torch.device | str, mesh=None, mp_policy=None
) -> Transformer:
    """Meta build -> FSDP2 shards per block -> each rank materialises and initialises its shard.

    The result's full state dict equals `Transformer(cfg, seed).state_dict()`.
    """
    model = build_meta_model(cfg, seed)
    shard_fsdp2(model, mesh=mesh, mp_policy=mp_policy)
    materialize_(model, device)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU, on rank 0 (empty on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def mismatched(gathered: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in reference if k not in gathered or not torch.equal(gathered[k], reference[k]))


def fix_mmap_threshold() -> None:
    """glibc's mmap threshold held at 128 KiB (what MALLOC_MMAP_THRESHOLD_=131072 does at start).

    glibc otherwise raises the threshold as large blocks are freed, and whether a freed full
    parameter then stays in a heap arena (counted as resident) depends on timing: under load that
    added ~55 MiB to one rank's peak in 5 of 7 runs; fixed, 101 MiB every time. Set here rather
    than in the environment so that it also holds for a rank forked by the suite's fork server.
    """
    import ctypes

    m_mmap_threshold = -3
    if ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def main(out: str) -> None:
    fix_mmap_threshold()
    dist.init_process_group("gloo")  # ranks and addresses from the composer launcher's environment
    torch.set_num_threads(1)
    # Warm up on a tiny model first: imports and FSDP's first-use set-up cost a constant ~100 MB
    # of resident memory that has nothing to do with the model's size.
    warmup = full_state_dict(build_sharded_model(WARMUP_CFG, SEED, device="cpu"))
    before = resident_bytes("VmRSS")
    reset_peak()
    model = build_sharded_model(CFG, SEED, device="cpu")
    growth = resident_bytes("VmHWM") - before
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    growths = [None] * dist.get_world_size()
    dist.all_gather_object(growths, {"peak_growth": growth, "shard_bytes": shard_bytes})
    gathered = full_state_dict(model)
    if dist.get_rank() == 0:
        reference = Transformer(CFG, seed=SEED).state_dict()
        warmup_reference = Transformer(WARMUP_CFG, seed=SEED).state_dict()
        report = {
            "world_size": dist.get_world_size(),
            "keys_equal": sorted(gathered) == sorted(reference),
            "mismatched": mismatched(gathered, reference),
            "warmup_keys_equal": sorted(warmup) == sorted(warmup_reference),
            "warmup_mismatched": mismatched(warmup, warmup_reference),
            "num_params": sum(t.numel() for t in reference.values()),
            "ranks": growths,
        }
        Path(out).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
