"""`training.profile`: one torch profiler window through Composer's profiler, and a CUDA memory snapshot.

Composer's `Profiler` drives `torch.profiler` on a cyclic schedule and writes a Chrome/Perfetto
JSON trace per profiled rank (`<run_dir>/profile/rank{rank}.{batch}.pt.trace.json`); with a remote
`checkpoint.save_folder` it also uploads it to `<save_folder>/profile/` through its own uploader.
Composer's system profiler (psutil threads) and its JSON trace handler are left off: the torch
trace is what a reader opens (chrome://tracing or https://ui.perfetto.dev).

On GPUs Composer's `MemorySnapshot` callback also records the CUDA caching allocator over the same
batches and writes `rank{rank}.{batch}.memory_snapshot.pickle` beside the trace (open it at
https://pytorch.org/memory_viz). Ranks outside `training.profile.ranks` get no profiler.
"""

from __future__ import annotations

from pathlib import Path

from llm.config import TrainConfig

PROFILE_FOLDER = "profile"


def profiler_for(cfg: TrainConfig, rank: int):
    """Composer's Profiler for this rank, or None (profiling off, or a rank not asked for)."""
    p = cfg.training.profile
    if not p.enabled or rank not in p.ranks:
        return None
    from composer.profiler import Profiler, cyclic_schedule

    folder = str(Path(cfg.run_dir) / PROFILE_FOLDER)
    remote = _remote_folder(cfg)
    return Profiler(
        schedule=cyclic_schedule(skip_first=0, wait=p.wait, warmup=p.warmup, active=p.active, repeat=1),
        trace_handlers=[],
        sys_prof_cpu=False,
        sys_prof_memory=False,
        sys_prof_disk=False,
        sys_prof_net=False,
        torch_prof_folder=folder,
        torch_prof_filename="rank{rank}.{batch}.pt.trace.json",
        torch_prof_remote_file_name=f"{remote}/rank{{rank}}.{{batch}}.pt.trace.json" if remote else None,
        torch_prof_memory_filename=None,
        torch_prof_memory_remote_file_name=None,
        torch_prof_overwrite=True,
        torch_prof_record_shapes=True,
        torch_prof_profile_memory=True,
        torch_prof_with_stack=False,
        torch_prof_with_flops=True,
    )


def memory_snapshot_callbacks(cfg: TrainConfig, device: str, rank: int) -> list:
    """Composer's MemorySnapshot over the profiled window (GPUs only: it records CUDA's allocator)."""
    p = cfg.training.profile
    if not p.enabled or rank not in p.ranks or device != "gpu":
        return []
    from composer.callbacks import MemorySnapshot

    remote = _remote_folder(cfg)
    return [
        MemorySnapshot(
            skip_batches=1 + p.wait,
            interval=f"{p.warmup + p.active}ba",
            folder=str(Path(cfg.run_dir) / PROFILE_FOLDER),
            filename="rank{rank}.{batch}.memory_snapshot",
            remote_file_name=remote,
            overwrite=True,
        )
    ]


def _remote_folder(cfg: TrainConfig) -> str | None:
    folder = cfg.checkpoint.save_folder
    if folder and "://" in folder:
        return f"{folder.rstrip('/')}/{PROFILE_FOLDER}"
    return None
