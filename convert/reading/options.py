"""How a conversion reads its inputs and cleans their texts: `ReadOptions` (the `shards` and
`tokenizer` commands' input flags). Files are found by convert/reading/sources.py and read by
convert/reading/readers.py; texts are cleaned by convert/filters/cleaning.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from convert.filters.cleaning import Cleaner


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
