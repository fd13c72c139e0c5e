"""What a shard conversion is asked to do: `ShardOptions`, checked once and then passed, as it is,
to the main process's steps and to every worker process."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from convert.errors import ConvertError
from convert.tokenizer import TokenizerInfo


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

    @property
    def main_helps(self) -> bool:
        if self.main_works is not None:
            return self.main_works
        return self.workers < available_cpus()

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
        return replace(self, dtype=tokenizer.token_dtype(self.dtype))


def available_cpus() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
