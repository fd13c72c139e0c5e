"""De-duplication and selection: which documents a conversion keeps, decided in input order.

minhash.py          MinHash signatures over character n-grams (workers): LSH band keys, sketches
near_dedup.py       the band index and the near-duplicate decisions; a sample of removed pairs
index_processes.py  the duplicate state split over index processes (many workers), pipelined
selection.py        `Selection`: exact duplicates, filter drops and near duplicates per batch
options.py          `NearDedupOptions` and the LSH band layout for a threshold (`lsh_parameters`)
runs.py             sorted runs on disk: written as the memory budget requires, read by value range
pairs.py            the decisions of one partition of digests or band keys; `RankedBits`
stages.py           the merge's stages: one partition per worker job (exact, then near)
"""

from convert.dedup.index_processes import IndexProcesses
from convert.dedup.minhash import signatures
from convert.dedup.near_dedup import NearDuplicates, PairSample
from convert.dedup.options import NearDedupOptions, lsh_parameters
from convert.dedup.selection import Selection

__all__ = [
    "IndexProcesses",
    "NearDedupOptions",
    "NearDuplicates",
    "PairSample",
    "Selection",
    "lsh_parameters",
    "signatures",
]
