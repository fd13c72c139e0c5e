"""What a shard conversion is asked to do: `ShardOptions`, checked once and then passed, as it is,
to the main process's steps and to every worker process. It holds the quality filters
(`QualityFilters`, beside the filters in convert/filters/quality.py) and the near-duplicate
settings (`NearDedupOptions`, beside the de-duplication in convert/dedup/options.py); how the
inputs are read is `ReadOptions` (convert/reading/options.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from convert.dedup.options import NearDedupOptions
from convert.errors import ConvertError
from convert.filters.quality import QualityFilters
from shards.tokenizer import TokenizerInfo

WORKERS_PER_INDEX = 8  # workers one exact-duplicate index process is given (`make bench-convert`)
# With near-duplicate removal: 8 index processes kept up with 36-67 workers, 16 with about 70
# (bench-convert's ordered-selection line), so one per 4 workers: 16 for 64.
NEAR_WORKERS_PER_INDEX = 4
NEAR_IN_MAIN = 4  # workers the main process keeps up with when it decides near duplicates itself


@dataclass(frozen=True)
class ShardOptions:
    seq_len: int = 512
    val_fraction: float = 0.01
    workers: int = 1
    add_bos: bool = False
    min_tokens: int = 20
    dtype: str = "auto"  # "auto" until `resolve` picks uint16 or uint32 for the tokenizer
    shard_size_mb: float = 64.0
    overwrite: bool = False
    chunk_chars: int = 1_000_000  # ~3 MB of Chinese UTF-8 per chunk
    progress: bool = True
    # The main process cleans the texts and writes the parts itself (the workers only tokenize)
    # when it has a core to spare; None: when there are more CPUs than workers.
    main_works: bool | None = None
    filters: QualityFilters = field(default_factory=QualityFilters)
    near_dedup: NearDedupOptions | None = None  # None: exact duplicates only
    # Processes that hold the near-duplicate band index, split by key value (the same decisions
    # for any number); 0: `auto_index_processes` (1: the main process holds it).
    index_processes: int = 0
    # Bytes every structure that grows with the corpus stays under (convert/budget.py); 0: a share
    # of this machine's memory. Decides nothing about the output.
    memory_budget: int = 0

    @property
    def main_helps(self) -> bool:
        if self.main_works is not None:
            return self.main_works
        return self.workers < available_cpus()

    def auto_index_processes(self) -> int:
        """One index process per WORKERS_PER_INDEX workers; with near-duplicate removal one per
        NEAR_WORKERS_PER_INDEX, and at least two from NEAR_IN_MAIN + 1 workers: the main process
        deciding near duplicates itself keeps up with about that many (`make bench-convert`)."""
        if self.near_dedup is None:
            return math.ceil(self.workers / WORKERS_PER_INDEX)
        if self.workers <= NEAR_IN_MAIN:
            return 1
        return max(2, math.ceil(self.workers / NEAR_WORKERS_PER_INDEX))

    @property
    def processes(self) -> int:
        """The processes a conversion runs: this one, the workers and the index processes."""
        index = self.index_processes or self.auto_index_processes()
        return 1 + self.workers + (index if index > 1 else 0)

    @property
    def size_limit(self) -> int:
        return int(self.shard_size_mb * (1 << 20))

    def resolve(self, tokenizer: TokenizerInfo) -> ShardOptions:
        """These options checked, and made concrete for `tokenizer` (the token dtype)."""
        if self.seq_len < 2:
            raise ConvertError(f"--seq-len {self.seq_len} must be at least 2")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConvertError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if self.workers < 1:
            raise ConvertError(f"--workers {self.workers} must be at least 1")
        if self.min_tokens < 0:
            raise ConvertError(f"--min-tokens {self.min_tokens} must be 0 or more")
        if not 0 < self.shard_size_mb < 4096:
            raise ConvertError(f"--shard-size-mb {self.shard_size_mb} must be in (0, 4096)")
        if self.chunk_chars < 1:
            raise ConvertError(f"chunk size {self.chunk_chars} must be at least 1 character")
        if self.add_bos and tokenizer.bos_id < 0:
            raise ConvertError(f"--bos: tokenizer {tokenizer.path} has no BOS piece; drop --bos")
        if self.index_processes < 0:
            raise ConvertError(f"--index-processes {self.index_processes} must be 0 (auto) or more")
        partitions = self.index_processes or self.auto_index_processes()
        return replace(
            self,
            dtype=tokenizer.token_dtype(self.dtype),
            index_processes=partitions,
            **self.resolve_selection(),
        )

    def resolve_selection(self) -> dict:
        """The filters and near-duplicate settings, checked and made concrete."""
        self.filters.check()
        near = self.near_dedup
        min_chars = self.filters.min_chars
        if min_chars is None:
            min_chars = near.ngram if near is not None and near.ngram >= 1 else 1
        near = near.resolve(min_chars) if near is not None else None
        return {"filters": replace(self.filters, min_chars=min_chars), "near_dedup": near}


def available_cpus() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
