"""What a shard conversion is asked to do: `ShardOptions`, checked once and then passed, as it is,
to the main process's steps and to every worker process. It holds the quality filters
(`QualityFilters`, applied in convert/filters/quality.py) and the near-duplicate settings
(`NearDedupOptions`: signatures in convert/dedup/minhash.py, decisions in convert/dedup/near_dedup.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from shards.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class ReadOptions:
    """How input files are read and their texts cleaned (the main process's side)."""

    fmt: str = "auto"
    text_field: str | None = None
    preset: str | None = None
    strict: bool = False
    normalization: str = "NFKC"
    dedup: bool = True  # exact duplicates (the same cleaned text) go

    def cleaner(self) -> Cleaner:
        """The main process's cleaner: it also de-duplicates (unless `dedup` is off)."""
        return Cleaner(normalization=self.normalization, dedup=self.dedup)

    def worker_cleaner(self) -> Cleaner:
        """The workers' cleaner: the same cleaning, no de-duplication (the main process does it)."""
        return Cleaner(normalization=self.normalization, dedup=False)


@dataclass(frozen=True)
class QualityFilters:
    """Per-document quality filters (convert/filters/quality.py); each is off at its default here.

    `--filters` turns every one on at `QualityFilters.recommended()`, values suited to Chinese
    web and encyclopedia text (measured in the README's conversion section).
    """

    min_chars: int | None = None  # None: 1, or the shingle size when near-duplicates are removed
    min_cjk_share: float = 0.0  # share of CJK ideographs among non-space characters
    max_symbol_share: float = 1.0  # share of digits and symbols among non-space characters
    max_dup_lines: float = 1.0  # share of characters in lines that repeat an earlier line
    max_dup_paragraphs: float = 1.0  # the same for paragraphs (text between blank lines)
    max_run_chars: int = 0  # longest stretch without punctuation or whitespace; 0: off

    @classmethod
    def recommended(cls) -> QualityFilters:
        return cls(
            min_chars=50, min_cjk_share=0.3, max_symbol_share=0.3, max_dup_lines=0.2, max_dup_paragraphs=0.2,
            max_run_chars=100,
        )  # fmt: skip

    @property
    def active(self) -> bool:
        return (self.min_chars or 0) > 1 or self.needs_classes or self.checks_repetition

    @property
    def needs_classes(self) -> bool:
        return self.min_cjk_share > 0 or self.max_symbol_share < 1 or self.max_run_chars > 0

    @property
    def checks_repetition(self) -> bool:
        return self.max_dup_lines < 1 or self.max_dup_paragraphs < 1

    def check(self) -> None:
        if self.min_chars is not None and self.min_chars < 0:
            raise ConvertError(f"--min-chars {self.min_chars} must be 0 or more")
        for flag, value in (
            ("--min-cjk-share", self.min_cjk_share),
            ("--max-symbol-share", self.max_symbol_share),
            ("--max-dup-lines", self.max_dup_lines),
            ("--max-dup-paragraphs", self.max_dup_paragraphs),
        ):
            if not 0.0 <= value <= 1.0:
                raise ConvertError(f"{flag} {value} must be a share in [0, 1]")
        if self.max_run_chars < 0:
            raise ConvertError(f"--max-run-chars {self.max_run_chars} must be 0 (off) or more")


@dataclass(frozen=True)
class NearDedupOptions:
    """MinHash-LSH near-duplicate removal (convert/dedup/minhash.py, convert/dedup/near_dedup.py).

    A document goes when its estimated Jaccard similarity with an earlier document, over the
    sets of their character n-grams (`ngram` characters, no word splitting), is at least
    `threshold`. Signatures have `bins` one-permutation-hashing bins; `bands` x `rows` of them
    form the LSH bands that find the candidates (0: chosen for the threshold, `lsh_parameters`).
    """

    threshold: float = 0.8
    ngram: int = 5
    bins: int = 256
    bands: int = 0
    rows: int = 0
    per_key: int = 8  # documents kept per band key (the first ones): bounds boilerplate clusters

    def resolve(self, min_chars: int) -> NearDedupOptions:
        if not 0.0 < self.threshold <= 1.0:
            raise ConvertError(f"--near-dedup threshold {self.threshold} must be in (0, 1]")
        if self.ngram < 1:
            raise ConvertError(f"--shingle {self.ngram} must be at least 1 character")
        if self.ngram > min_chars:
            raise ConvertError(
                f"--shingle {self.ngram} is longer than the shortest document kept (--min-chars {min_chars}): "
                f"such a document has no {self.ngram}-character shingle; raise --min-chars to {self.ngram} "
                "or lower --shingle"
            )
        if self.bins not in {1 << k for k in range(4, 13)}:
            raise ConvertError(f"--minhash-bins {self.bins} must be a power of two from 16 to 4096")
        if (self.bands > 0) != (self.rows > 0):
            raise ConvertError("--lsh-bands and --lsh-rows go together: give both or neither")
        bands, rows = (self.bands, self.rows) if self.bands else lsh_parameters(self.threshold, self.bins)
        if bands * rows > self.bins:
            raise ConvertError(
                f"--lsh-bands {bands} x --lsh-rows {rows} = {bands * rows} is more than --minhash-bins {self.bins}"
            )
        if self.per_key < 1:
            raise ConvertError(f"per_key {self.per_key} must be at least 1")
        return replace(self, bands=bands, rows=rows)


def lsh_parameters(threshold: float, bins: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows) for LSH over `bins` MinHash values: a pair at exactly `threshold` becomes a
    candidate with probability >= `recall` (1 - (1 - t^rows)^bands), with as many rows per band
    as fit (the steepest curve: fewest candidates below the threshold to verify)."""
    best = (min(bins, 64), 1)
    for rows in range(1, bins + 1):
        hit = threshold**rows
        bands = 1 if hit >= 1.0 else math.ceil(math.log(1.0 - recall) / math.log1p(-hit))
        if bands * rows > bins:
            break
        best = (bands, rows)
    return best


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
