"""The duplicate state split over index processes (convert/dedup/index_processes.py): the same
decisions as one index in the main process, batches pipelined, whatever their size."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from convert.dedup.near_dedup import PairSample
from convert.dedup.options import NearDedupOptions
from convert.dedup.selection import Selection
from convert.filters.cleaning import Cleaner
from convert.filters.quality import REASON_CODES, QualityFilters
from convert.records import TokenizedBatch, ToSelect
from convert.run.options import ShardOptions

pytestmark = pytest.mark.slow  # index processes

NEAR = NearDedupOptions(threshold=0.5, bins=16, bands=4, rows=2, per_key=3).resolve(10)
SHORT = REASON_CODES["too_short_chars"]


class Documents:
    """Documents drawn from a small pool, so that many repeat (exact duplicates: the same digest,
    keys and sketch) and many share band keys and sketch values (near duplicates and not)."""

    def __init__(self, pool: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.digests = rng.bytes(16 * pool)
        self.keys = rng.integers(0, 60, size=(pool, NEAR.bands)).astype(np.uint64) * np.uint64(
            0x9E3779B97F4A7C15
        )
        self.sketches = rng.integers(0, 3, size=(pool, NEAR.bins)).astype(np.uint8)
        self.reasons = np.where(rng.random(pool) < 0.1, SHORT, np.where(rng.random(pool) < 0.1, 2, 0)).astype(
            np.int8
        )
        self.lengths = rng.integers(2, 30, size=pool)

    def batch(self, ids: np.ndarray) -> TokenizedBatch:
        passing = self.reasons[ids] == 0
        digests = b"".join(self.digests[16 * i : 16 * i + 16] for i in ids.tolist())
        tokens = np.zeros(int(self.lengths[ids][passing].sum()), dtype=np.uint32)
        return TokenizedBatch(
            digests=digests, chars=self.lengths[ids] * 3, lengths=self.lengths[ids], tokens=tokens, drops={},
            reasons=self.reasons[ids], keys=self.keys[ids][passing], sketches=self.sketches[ids][passing],
        )  # fmt: skip


def decide(batches: list[TokenizedBatch], processes: int):
    options = ShardOptions(filters=QualityFilters(min_chars=10), near_dedup=NEAR, index_processes=processes)
    cleaner = Cleaner()
    selection = Selection(options, cleaner, sample=PairSample(keys=12, per_key=2))
    items = [
        ToSelect(batch=batch, text=lambda row, n=n: f"batch {n} row {row}", deduped=False, payload=n)
        for n, batch in enumerate(batches)
    ]
    try:
        decided = [
            (s.payload, s.indexed.tolist(), s.match.tolist(), s.filtered.tolist(), s.first_position)
            for s in selection.select_all(items)
        ]
    finally:
        selection.close()
    sample = selection.sample
    return (
        decided,
        cleaner.drops.as_dict(),
        selection.dropped_tokens,
        sample.members,
        sample.removed,
        selection.index_bytes,
    )


def test_index_processes_decide_as_the_main_process_does():
    """Batches of 0 to 300 rows, more of them than the pipeline holds, with exact duplicates,
    too-short and filtered rows, near and not-near pairs: every decision, count and sample member
    the same for one index here and for three index processes."""
    documents = Documents(pool=2000)
    rng = np.random.default_rng(1)
    batches = [documents.batch(rng.integers(0, 2000, size=n)) for n in rng.integers(0, 300, size=70).tolist()]
    here, split = decide(batches, 1), decide(batches, 3)
    assert [d[0] for d in split[0]] == list(range(len(batches)))  # in input order
    assert here == split
    decided, drops, *_ = here
    assert drops["duplicate"] > 100 and drops["near_duplicate"] > 100 and drops["too_short_chars"] > 100
    assert sum(len(d[1]) for d in decided) > 1000


def test_batches_larger_than_the_pipes_do_not_stall():
    """Each answer (every document near an earlier one) and each message is megabytes, many of
    them in flight: the index processes read while they decide, so neither side waits on a full
    pipe for ever."""
    documents = Documents(pool=50)
    rng = np.random.default_rng(2)
    batches = [documents.batch(rng.integers(0, 50, size=20_000)) for _ in range(24)]
    for batch in batches:  # no exact duplicates
        batch.digests = rng.bytes(len(batch.digests))

    def stalled(*_):
        raise TimeoutError("the index processes stalled")

    previous = signal.signal(signal.SIGALRM, stalled)
    signal.alarm(90)
    try:
        here, split = decide(batches, 1), decide(batches, 2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert here == split
    assert sum(sum(m >= 0 for m in d[2]) for d in split[0]) > 300_000


def test_a_dead_index_process_stops_the_run_with_a_clear_error():
    documents = Documents(pool=500)
    options = ShardOptions(filters=QualityFilters(min_chars=10), near_dedup=NEAR, index_processes=2)
    selection = Selection(options, Cleaner())
    selection.processes.processes[1].kill()
    selection.processes.processes[1].join()
    items = [
        ToSelect(batch=documents.batch(np.arange(n, n + 100)), text=lambda row: None, deduped=False)
        for n in range(0, 400, 100)
    ]
    with pytest.raises(RuntimeError, match="index process died"):
        list(selection.select_all(items))
    selection.close()


@pytest.mark.parametrize(
    ("workers", "near", "processes"),
    [
        (1, False, 1),
        (8, False, 1),
        (9, False, 2),
        (64, False, 8),
        (4, True, 1),
        (5, True, 2),
        (9, True, 3),
        (64, True, 16),
    ],
)
def test_index_processes_grow_with_the_workers_faster_with_near_dedup(workers, near, processes):
    """bench-convert: 8 near-duplicate index processes kept up with fewer than 64 workers, 16 with more."""
    options = ShardOptions(workers=workers, near_dedup=NearDedupOptions() if near else None)
    assert options.auto_index_processes() == processes
