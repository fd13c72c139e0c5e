"""The merge's de-duplication stages, one partition per job, run in worker processes.

Every task of a multi-machine conversion (convert/run/tasks.py) leaves its de-duplication data as
sorted runs (convert/dedup/runs.py) and one sketch file:

    digest runs  (digest's first 8 bytes, its last 8, row, pid)  every row but the too-short ones
    key runs     (band key, pid)                                 every band of every passing row
    sketches     the passing rows' sketches, in order            (pid - the task's first pid) x bins

Rows are numbered over all tasks in input order (a task's rows start where the previous task's
end), pids likewise over the rows that pass the filters. The stages, in order:

  1. exact (`run_exact`), partition p of P: the entries of every digest run whose first column
     lies in p's range of values; a digest's first occurrence is kept, every later row is a
     duplicate (convert/dedup/pairs.py). Writes the duplicate rows and their pids, sorted.
  2. near (`run_near`), partition q of Q: the entries of every key run in q's range of keys, less
     the duplicate pids; the candidate pairs of the index's rule, their estimates from the two
     sketches (mapped from the sketch files), every pair at or above the threshold, by position
     (a pid less the duplicate pids before it). Writes (document, match, estimate) sorted by
     document, then match; the merge's ordered pass decides by the rule (`NearDecisions`).

A partition's output depends only on its range of values, never on how many partitions there
are, which tasks wrote the runs or how the runs were spilled: the merge (convert/run/merge.py)
picks P and Q so that a partition fits a worker's share of the memory budget, and combines the
outputs in input order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from convert.dedup.options import NearDedupOptions
from convert.dedup.pairs import NONE, RankedBits, candidate_pair_blocks, exact_duplicates, scores
from convert.dedup.runs import FULL, RunFile, RunInfo, write_run
from storage import open_store

# Bytes of memory per entry a partition holds at its peak (entries, their order, sorted copies,
# pairs), measured by `make bench-dedup-scale`; the merge sizes the partitions with them.
EXACT_BYTES_PER_ENTRY = 80  # 58 measured (tracemalloc) on a partition of 250 k digests
NEAR_BYTES_PER_ENTRY = 48  # 33 measured on a partition of 3.2 M band keys
_BLOCK = 1 << 20  # entries worked out at a time past the sort (bounded temporary arrays)
# Entries whose candidate pairs are verified at a time: at most `per_key` (8) pairs each, about
# 50 bytes a pair at the peak (the pairs, their order, sorted copies): under 26 MiB a block.
_PAIR_BLOCK = 1 << 16


@dataclass(frozen=True, kw_only=True)
class RunRef:
    """One sorted run of one task, with the task's first row and first pid."""

    rel: str
    bytes: int
    row_base: int
    pid_base: int


@dataclass(frozen=True, kw_only=True)
class SketchFile:
    """One task's sketch file, as a local path this process can map, and its first pid."""

    path: str
    pid_base: int
    count: int


def partition_range(index: int, count: int) -> tuple[int, int]:
    """Partition `index` of `count`: its range [lo, hi) of 64-bit values."""
    return (index << 64) // count, ((index + 1) << 64) // count


@dataclass(frozen=True, kw_only=True)
class ExactJob:
    out: str  # the output's URL: runs and results are relative to it
    runs: tuple[RunRef, ...]
    index: int
    count: int
    output: str  # this partition's files: <output>.rows.run, <output>.pids.run


@dataclass(frozen=True, kw_only=True)
class ExactResult:
    index: int
    entries: int
    rows: RunInfo
    pids: RunInfo
    cpu_s: float  # the job's CPU seconds (the merge's marker keeps it: `make bench-dedup-scale` reads it)


def load_partition(store, runs: tuple[RunRef, ...], index: int, count: int, kind: str) -> list[np.ndarray]:
    """The entries of partition `index` of `count` from every run, as global ids: (key, pid) for
    band keys, (digest high, low, row, pid) for digests. Filled into arrays sized beforehand from
    the runs' segment tables, one run's slice read at a time: the partition's entries are in
    memory once, not twice."""
    lo, hi = partition_range(index, count)
    files = [RunFile(store, ref.rel, ref.bytes) for ref in runs]
    slices = [(file, *file.segments_of(lo, hi)) for file in files]
    tables = [file.table(first, end) for file, first, end in slices]
    width = 2 if kind == "keys" else 4
    bound = sum(int(offsets[-1] - offsets[0]) for offsets, _ in tables) // (8 * width)
    out = [np.empty(bound, dtype=np.uint64) for _ in range(width)]
    at = 0
    for ref, (file, first, end), table in zip(runs, slices, tables, strict=True):
        columns = file.read_segments(first, end, table)
        keep = (
            (columns[0] >= np.uint64(lo)) & (columns[0] < np.uint64(hi))
            if hi < FULL
            else columns[0] >= np.uint64(lo)
        )
        count_kept = int(keep.sum())
        ids = {"row": np.uint64(ref.row_base), "pid": np.uint64(ref.pid_base)}
        for c, column in enumerate(columns):
            part = column[keep]
            if kind == "keys" and c == 1 or kind == "digests" and c == 3:  # pids: global, NONE stays
                part = np.where(part == NONE, NONE, part + ids["pid"])
            elif kind == "digests" and c == 2:
                part = part + ids["row"]
            out[c][at : at + count_kept] = part
        at += count_kept
        del columns
    return [column[:at] for column in out]


def run_exact(job: ExactJob) -> ExactResult:
    cpu = time.process_time()
    store = open_store(job.out)
    high, low, rows, pids = load_partition(store, job.runs, job.index, job.count, "digests")
    dup_rows, dup_pids = exact_duplicates(high, low, rows, pids)
    return ExactResult(
        index=job.index, entries=len(high),
        rows=write_run(store, f"{job.output}.rows.run", [dup_rows], by_id=True, ordered=True),
        pids=write_run(store, f"{job.output}.pids.run", [dup_pids], by_id=True, ordered=True),
        cpu_s=round(time.process_time() - cpu, 3),
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class NearJob:
    out: str
    runs: tuple[RunRef, ...]
    index: int
    count: int
    output: str  # this partition's file: <output>.run
    options: NearDedupOptions
    duplicates: str  # the saved RankedBits of the duplicate pids (a local file)
    sketches: tuple[SketchFile, ...]
    first_pid: int
    first_position: int


@dataclass(frozen=True, kw_only=True)
class NearResult:
    index: int
    entries: int
    pairs: int  # candidate pairs verified (a pair two keys share may be counted twice)
    near: RunInfo
    cpu_s: float


class Sketches:
    """The sketch of any pid, from the tasks' sketch files (mapped, read where a pair needs them)."""

    def __init__(self, files: tuple[SketchFile, ...], bins: int) -> None:
        self.files, self.bins = files, bins
        self.bases = np.array([f.pid_base for f in files], dtype=np.uint64)
        self.maps: dict[int, np.ndarray] = {}

    def _map(self, task: int) -> np.ndarray:
        if task not in self.maps:
            file = self.files[task]
            self.maps[task] = np.memmap(file.path, dtype=np.uint8, mode="r", shape=(file.count, self.bins))
        return self.maps[task]

    def take(self, pids: np.ndarray) -> np.ndarray:
        out = np.empty((len(pids), self.bins), dtype=np.uint8)
        task = np.searchsorted(self.bases, pids, side="right") - 1
        for t in np.unique(task).tolist():
            where = np.flatnonzero(task == t)
            local = (pids[where] - self.bases[t]).astype(np.int64)
            order = np.argsort(local, kind="stable")  # in file order: pages read once, forward
            out[where[order]] = self._map(t)[local[order]]
        return out


def run_near(job: NearJob) -> NearResult:
    cpu = time.process_time()
    store = open_store(job.out)
    keys, pids = load_partition(store, job.runs, job.index, job.count, "keys")
    duplicates = RankedBits.load(job.duplicates)
    indexed = np.concatenate(
        [~duplicates.contains(pids[lo : lo + _BLOCK]) for lo in range(0, len(pids), _BLOCK)]
    )
    keys, pids = keys[indexed], pids[indexed]
    del indexed
    entries = len(keys)
    # Sorted, each array replacing its unsorted self (at most three arrays of the entries at once).
    order = np.lexsort((pids, keys))
    keys = keys[order]
    pids = pids[order]
    del order
    # Each block's pairs verified and its close ones kept (the pairs' memory bounded by the block
    # however many a key links: up to `per_key` an entry); a pair two keys share, once.
    sketches = Sketches(job.sketches, job.options.bins)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    pairs = 0
    for later, before in candidate_pair_blocks(keys, pids, job.options.per_key, _PAIR_BLOCK):
        estimates = scores(later, before, sketches.take, job.options.bins)
        close = estimates >= job.options.threshold
        found.append((later[close], before[close], estimates[close]))
        pairs += len(later)
    del keys, pids
    documents, matches, estimates = close_pairs(found)
    offset = np.int64(job.first_position - job.first_pid)
    positions = documents.astype(np.int64) + offset - duplicates.below(documents)
    match_positions = matches.astype(np.int64) + offset - duplicates.below(matches)
    columns = [positions.astype(np.uint64), match_positions.astype(np.uint64), estimates.view(np.uint64)]
    near = write_run(store, f"{job.output}.run", columns, by_id=True, ordered=True)
    return NearResult(
        index=job.index,
        entries=entries,
        pairs=pairs,
        near=near,
        cpu_s=round(time.process_time() - cpu, 3),
    )


def close_pairs(found: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """The blocks' close pairs (document, match, estimate) as one list by document, then match,
    each pair once."""
    if not found:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64), np.empty(0)
    documents, matches, estimates = (np.concatenate([part[i] for part in found]) for i in range(3))
    if not len(documents):
        return documents, matches, estimates
    order = np.lexsort((matches, documents))
    documents, matches, estimates = documents[order], matches[order], estimates[order]
    first = np.r_[True, (documents[1:] != documents[:-1]) | (matches[1:] != matches[:-1])]
    return documents[first], matches[first], estimates[first]


def read_all(store, rel: str, size: int) -> list[np.ndarray]:
    """Every entry of an output run (checked)."""
    return RunFile(store, rel, size).values(0, FULL)
