"""The near-duplicate settings: `NearDedupOptions` (signatures in convert/dedup/minhash.py,
decisions in convert/dedup/near_dedup.py and convert/dedup/index_processes.py) and the LSH band
layout chosen for a threshold (`lsh_parameters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from convert.errors import ConvertError

NEAR_RULES = ("any", "kept")


@dataclass(frozen=True)
class NearDedupOptions:
    """MinHash-LSH near-duplicate removal (convert/dedup/minhash.py, convert/dedup/near_dedup.py).

    A document goes when its estimated Jaccard similarity with an earlier document, over the
    sets of their character n-grams (`ngram` characters, no word splitting), is at least
    `threshold`. Signatures have `bins` one-permutation-hashing bins; `bands` x `rows` of them
    form the LSH bands that find the candidates (0: chosen for the threshold, `lsh_parameters`).

    `rule`: "any" (a document goes when it is near any earlier document, removed or not: a chain
    A ~ B ~ C keeps only A) or "kept" (when it is near an earlier document that was kept: A and
    C stay when they are not near each other); convert/dedup/pairs.py `NearDecisions`.
    """

    threshold: float = 0.8
    ngram: int = 5
    bins: int = 256
    bands: int = 0
    rows: int = 0
    per_key: int = 8  # documents kept per band key (the first ones): bounds boilerplate clusters
    rule: str = "any"  # or "kept" (`NEAR_RULES`)

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
        if self.rule not in NEAR_RULES:
            raise ConvertError(f"--near-rule {self.rule!r} must be one of {', '.join(NEAR_RULES)}")
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
