"""How big a checkpoint is, per writing rank and per node, how long it takes to store, and what a
restart costs (`RestartCost`: the checkpoint and the first shards back from the store, and what is
assumed of a GPU node's start).

No heavy imports (the dry run and `llm inspect` use it without torch or Composer). The staging
check in `llm.checkpoint.plan` and the dry run's checkpoint lines (`llm.memory_plan`) both ask
this module, so the size a run refuses to start without is the size the dry run prints;
`format_bytes` says a size in the unit that shows it (B to TiB), and `parse_bandwidth` refuses a
node rate outside `BANDWIDTH_RANGE`.

A checkpoint holds fp32 weights and AdamW's two fp32 moments: 12 bytes per parameter (Composer's
state besides them is kilobytes). A sharded save (`fsdp.state_dict_type: sharded`) is written by
every rank of one replica group, each its 1/shards part; a monolithic one by rank 0 alone. A
writing rank's snapshot (`checkpoint.snapshot`, llm/checkpoint/saver.py) holds its part in host
memory, so a node needs its writing ranks' parts in host memory too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The least one checkpoint takes: fp32 weights and AdamW's two fp32 moments, 4 bytes each.
CHECKPOINT_BYTES_PER_PARAM = 12
# A node's sustained upload rate to S3 (10 Gbit/s: what one client process gets from a large
# instance without tuning; AWS quotes up to 100 Gbit/s with many parallel streams).
DEFAULT_UPLOAD_BANDWIDTH = "1.25GB/s"
# A node's local NVMe write rate for the save itself (conservative for a RAID-0 of data-center NVMe).
DEFAULT_DISK_BANDWIDTH = "2GB/s"
# The node rates a plan takes, in bytes per second: below 1 MB/s or above 1 TB/s (8 Tbit/s; 8 x
# 400 Gbit/s NICs are 400 GB/s) is a typo or a degenerate number (1e400, a denormal), not a machine.
BANDWIDTH_RANGE = (1e6, 1e12)
# One GPU's device-to-host copy into pinned memory while all of a node's GPUs copy at once: HGX
# H100/H200 nodes put two GPUs behind one PCIe Gen5 x16 link to the host (~50 GB/s), so ~25 GB/s
# each at best; half of that is assumed until `make gpu-check` measures it (its "snapshot" row).
DEFAULT_SNAPSHOT_BANDWIDTH = "12GB/s"
NOTICES_S = (30, 120)  # preemption notices to check a SIGTERM save against (spot: 30 s to 2 min)
STALL_TARGET = 0.01  # the share of training time the saves may take
GPUS_PER_NODE = 8

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?(b|bit|byte)?\s*/\s*s\s*$", re.IGNORECASE)


class BandwidthError(ValueError):
    """A bandwidth that is not a size per second."""


def parse_bandwidth(text: str, what: str = "--upload-bandwidth") -> float:
    """Bytes per second from '1.25GB/s', '500MiB/s', '10Gbit/s' (bits: 'bit' or a lowercase b)."""
    match = _RATE.match(str(text))
    shown = repr(text) if len(str(text)) <= 40 else f"'{str(text)[:16]}...{str(text)[-8:]}'"
    if not match:
        raise BandwidthError(
            f"{what}={shown} is not a size per second; give e.g. 1.25GB/s, 500MiB/s or 10Gbit/s"
        )
    number, prefix, unit = match.groups()
    value = float(number) * _UNITS[(prefix or "").lower()]
    if unit in ("bit", "b") or (unit or "").lower() == "bit":
        value /= 8
    if not BANDWIDTH_RANGE[0] <= value <= BANDWIDTH_RANGE[1]:  # nan and inf too
        raise BandwidthError(
            f"{what}={shown} is {value:.3g} bytes per second; give a node's rate between 1MB/s and "
            "1TB/s, e.g. 1.25GB/s or 10Gbit/s"
        )
    return value


def format_bytes(size: float) -> str:
    """`size` bytes in the largest binary unit that keeps it at 1 or more, to 3 significant digits
    (as `df -h` counts): 512 B, 3.05 MiB, 10.5 GiB. A few MiB never reads as "0.0 GiB"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def checkpoint_bytes(num_params: int) -> int:
    return CHECKPOINT_BYTES_PER_PARAM * num_params


@dataclass(frozen=True)
class CheckpointSize:
    """One checkpoint of `total` bytes over `writers` ranks (1 for a monolithic save)."""

    total: int
    writers: int
    gpus: int
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def per_rank(self) -> int:
        return -(-self.total // self.writers)

    @property
    def per_node(self) -> int:
        """What the busiest node writes and uploads (its writing ranks' parts)."""
        return self.per_rank * min(self.writers, self.gpus_per_node)

    def seconds(self, node_bandwidth: float) -> float:
        return self.per_node / node_bandwidth


def checkpoint_size(num_params: int, gpus: int, *, sharded: bool, shards: int) -> CheckpointSize:
    """`shards`: the ranks each parameter is sharded over (gpus / fsdp.replicate)."""
    writers = max(1, shards) if sharded else 1
    return CheckpointSize(checkpoint_bytes(num_params), writers, gpus, min(gpus, GPUS_PER_NODE))


def stall_free_interval(stall_s: float, upload_s: float, step_s: float, target: float = STALL_TARGET) -> int:
    """The fewest batches between saves for which each save's stall is under `target` of the
    training time and its background part (`upload_s`: the upload, and with snapshots the write
    too) ends before the next save (else that save waits)."""
    by_stall = stall_s / (target * step_s)
    by_upload = upload_s / step_s
    return max(1, int(-(-max(by_stall, by_upload) // 1)))


# --- what a restart costs (a warm spare node: up, its image pulled, nothing of the run on its disk) --
# Assumed, not measured on a GPU node (docs/resume.md, "Restart cost"): here, on 2 CPU cores, a
# restart's process start and imports take 3.5-10 s with the load, its process group nothing.
RESTART_IMPORTS_S = 15.0  # the interpreter, torch with CUDA, Composer, streaming; 8 ranks at once
RESTART_PROCESS_GROUP_S = 10.0  # the launcher's rendezvous and NCCL's communicators
RESTART_WARMUP_S = 10.0  # the first step beyond a plain one: CUDA handles, the allocator, first collectives
DEFAULT_SHARD_BYTES = 64 << 20  # `python -m convert shards --shard-size-mb` default
STREAM_SHUFFLE_BLOCK = 1 << 18  # samples streaming 0.13's py1e shuffle mixes at the least (its default)


def first_batch_shards(samples_per_rank: int, seq_len: int, token_bytes: int, block: int | None) -> int:
    """How many shards one rank reads for its first batch: its samples are spread over the shards
    of a shuffle block (`block` samples; None: streaming's default), at most one shard each."""
    per_shard = max(1, DEFAULT_SHARD_BYTES // (seq_len * token_bytes))
    in_block = -(-(block or STREAM_SHUFFLE_BLOCK) // per_shard)
    return max(1, min(samples_per_rank, in_block))


@dataclass(frozen=True)
class RestartCost:
    """A restart on a warm spare node, from the new process's start to its first step's end beyond
    a plain step's time (module constants for what is assumed); every part is lost time."""

    download_s: float  # the node's part of the checkpoint from the store at the node's rate
    load_s: float  # a rank's part from the node's disk (page cache) into its GPU
    data_s: float  # the first batch's shards of the node's ranks, from the store
    data_bytes: int  # what they weigh, per node
    imports_s: float = RESTART_IMPORTS_S
    process_group_s: float = RESTART_PROCESS_GROUP_S
    warmup_s: float = RESTART_WARMUP_S

    @property
    def total_s(self) -> float:
        return (
            self.imports_s
            + self.process_group_s
            + self.download_s
            + self.load_s
            + self.data_s
            + self.warmup_s
        )
