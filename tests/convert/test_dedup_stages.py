"""The merge's de-duplication stages on their own (convert/dedup/stages.py, pairs.py, runs.py):
partitions of values decide as one index in input order, whatever the partitions and runs;
run files read back by value range or in order, and refuse a damaged copy; 64-bit ids."""

from __future__ import annotations

import numpy as np
import pytest

from convert.dedup.near_dedup import NearDuplicates
from convert.dedup.options import NearDedupOptions
from convert.dedup.pairs import (
    NONE,
    NearDecisions,
    RankedBits,
    candidate_pairs,
    sorted_candidate_pairs,
    sorted_contains,
)
from convert.dedup.runs import FULL, RunCursor, RunFile, RunSpiller, write_run
from convert.dedup.stages import ExactJob, NearJob, RunRef, SketchFile, read_all, run_exact, run_near
from convert.errors import DamagedFile
from storage import open_store
from tests.convert.test_near_dedup import sequential_reference

OPTIONS = NearDedupOptions(threshold=0.5, bins=16, bands=4, rows=2, per_key=3).resolve(10)


def colliding(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Few distinct keys and sketch values: many candidates, near pairs and pairs that are not."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 40, size=(n, 4)).astype(np.uint64) + (
        np.arange(4, dtype=np.uint64) << np.uint64(40)
    )
    keys *= np.uint64(0x9E3779B97F4A7C15)  # spread over the 64-bit range, as band keys are
    return keys, rng.integers(0, 3, size=(n, 16)).astype(np.uint8)


def write_tasks(tmp_path, keys: np.ndarray, sketches: np.ndarray, cuts: list[int], limit: int, base: int = 0):
    """`keys` and `sketches` as tasks cut at `cuts`, each spilling its key runs every `limit` bytes."""
    store = open_store(tmp_path / "out")
    runs, files = [], []
    bounds = [0, *cuts, len(keys)]
    for t, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        spiller = RunSpiller(store, f"tasks/task-{t}/keys", 2, limit)
        pids = np.repeat(np.arange(hi - lo, dtype=np.uint64), keys.shape[1])
        spiller.add(keys[lo:hi].ravel(), pids)
        runs += [RunRef(rel=f"tasks/task-{t}/{r.name}", bytes=r.bytes, row_base=base + lo, pid_base=base + lo)
                 for r in spiller.finish()]  # fmt: skip
        path = tmp_path / f"sketches-{t}.u8"
        sketches[lo:hi].tofile(path)
        files.append(SketchFile(path=str(path), pid_base=base + lo, count=hi - lo))
    return store, tuple(runs), tuple(files)


def near_stage(
    tmp_path, store, runs, files, count: int, duplicates: RankedBits, base: int = 0, rule: str = "any"
):
    """Every partition's close pairs decided as the merge's ordered pass does (`NearDecisions`, in
    blocks of 300 documents): per document, its match (-1: kept) and estimate."""
    bits = str(tmp_path / "duplicates.npy")
    duplicates.save(bits)
    positions = duplicates.size - int(duplicates.below(np.array([base + duplicates.size - 1]))[0])
    found = []
    for q in range(count):
        job = NearJob(out=store.url(), runs=runs, index=q, count=count, output=f"merge/near-{count}-{q}",
                      options=OPTIONS, duplicates=bits, sketches=files, first_pid=base, first_position=base)  # fmt: skip
        result = run_near(job)
        found.append(read_all(store, f"merge/{result.near.name}", result.near.bytes))
    later, before, estimates = (np.concatenate([f[i] for f in found]) for i in range(3))
    decisions, match, estimate = NearDecisions(rule, first=base), [], []
    for first in range(base, base + positions, 300):
        mine = (later >= first) & (later < first + 300)
        count = min(300, base + positions - first)
        got = decisions.decide(first, count, later[mine], before[mine], estimates[mine].view(np.float64))
        match.append(got[0])
        estimate.append(got[1])
    match = np.concatenate(match)
    near_stage.through_removed = decisions.through_removed
    return np.where(match >= 0, match - base, -1), np.concatenate(estimate)


@pytest.mark.parametrize("count", [1, 3, 8])
def test_any_partitions_and_runs_decide_as_one_index_in_input_order(tmp_path, count):
    keys, sketches = colliding(2500)
    expected, expected_estimate = NearDuplicates(OPTIONS).add(keys, sketches)
    assert expected.tolist() == sequential_reference(keys, sketches, OPTIONS)
    store, runs, files = write_tasks(tmp_path, keys, sketches, cuts=[700, 1900], limit=3000)
    assert len(runs) > 20  # spilled every 187 entries
    match, estimate = near_stage(tmp_path, store, runs, files, count, RankedBits(0, len(keys)).freeze())
    assert np.array_equal(match, expected) and np.array_equal(estimate, expected_estimate)
    assert 0.2 < (match >= 0).mean() < 0.8


@pytest.mark.parametrize("rule", ["any", "kept"])
def test_the_partitions_close_pairs_decide_either_rule_in_input_order(tmp_path, rule):
    """Every partition writes all its close pairs; decided in input order (`NearDecisions`) they
    give one index's decisions by the rule, and the same count of documents removed only through
    removed ones."""
    from tests.convert.test_near_dedup import _reference

    keys, sketches = colliding(2500)
    expected, through_removed = _reference(keys, sketches, OPTIONS, rule)
    store, runs, files = write_tasks(tmp_path, keys, sketches, cuts=[700, 1900], limit=3000)
    match, _ = near_stage(tmp_path, store, runs, files, 3, RankedBits(0, len(keys)).freeze(), rule=rule)
    assert match.tolist() == expected
    assert near_stage.through_removed == (through_removed if rule == "any" else 0)


def test_pairs_verified_a_few_entries_at_a_time_decide_the_same(tmp_path, monkeypatch):
    """The near stage verifies a partition's pairs a block of entries at a time and keeps each
    block's best (the pairs' memory bounded whatever a key links): blocks of 5 entries decide as
    one index."""
    from convert.dedup import stages

    keys, sketches = colliding(2500)
    expected, expected_estimate = NearDuplicates(OPTIONS).add(keys, sketches)
    store, runs, files = write_tasks(tmp_path, keys, sketches, cuts=[700, 1900], limit=3000)
    monkeypatch.setattr(stages, "_PAIR_BLOCK", 5)
    match, estimate = near_stage(tmp_path, store, runs, files, 3, RankedBits(0, len(keys)).freeze())
    assert np.array_equal(match, expected) and np.array_equal(estimate, expected_estimate)


def test_pairs_worked_out_a_few_entries_at_a_time_are_the_same():
    """A partition's sorted entries are turned into pairs in blocks that end on a key's last entry
    (bounded temporaries): any block size, down to one entry, gives the same pairs."""
    keys, _ = colliding(800, seed=7)
    docs = np.repeat(np.arange(800, dtype=np.uint64), keys.shape[1])
    flat = keys.ravel()
    whole = candidate_pairs(flat, docs, 3)
    order = np.lexsort((docs, flat))
    for block in (1, 7, 100):
        later, before = sorted_candidate_pairs(flat[order], docs[order], 3, block)
        assert np.array_equal(later, whole[0]) and np.array_equal(before, whole[1])
    assert len(whole[0]) > 1000


def test_duplicate_documents_are_left_out_and_positions_skip_them(tmp_path):
    """Documents that are exact duplicates are not indexed: the rest decide as an index without
    them, at positions that do not count them; ids start just below 2**32 and cross it."""
    keys, sketches = colliding(1200, seed=3)
    duplicate = np.random.default_rng(1).random(len(keys)) < 0.3
    kept = np.flatnonzero(~duplicate)
    first = (1 << 32) - 100  # the one index's positions cross 2**32 too
    expected, _ = NearDuplicates(OPTIONS, first=first).add(keys[kept], sketches[kept])
    base = (1 << 32) - 600
    store, runs, files = write_tasks(tmp_path, keys, sketches, cuts=[500], limit=1 << 20, base=base)
    bits = RankedBits(base, len(keys))
    bits.add(np.flatnonzero(duplicate).astype(np.uint64) + np.uint64(base))
    match, _ = near_stage(tmp_path, store, runs, files, 4, bits.freeze(), base=base)
    assert np.array_equal(match, np.where(expected >= 0, expected - first, -1))
    assert (expected >= 1 << 32).any()


def test_the_exact_stage_keeps_each_digest_first_seen(tmp_path):
    rng = np.random.default_rng(2)
    n = 3000
    digests = rng.integers(0, 400, size=n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    low = digests ^ np.uint64(12345)
    passing = rng.random(n) < 0.8
    pids = np.full(n, NONE, dtype=np.uint64)
    pids[passing] = np.arange(int(passing.sum()), dtype=np.uint64)
    store = open_store(tmp_path / "out")
    runs = []
    for lo, hi in ((0, 1000), (1000, 3000)):
        spiller = RunSpiller(store, f"t{lo}/digests", 4, 4000)
        local_pids = np.where(pids[lo:hi] == NONE, NONE, pids[lo:hi] - pids[lo:hi][pids[lo:hi] != NONE].min())
        spiller.add(digests[lo:hi], low[lo:hi], np.arange(hi - lo, dtype=np.uint64), local_pids)
        pid_base = int(pids[lo:hi][pids[lo:hi] != NONE].min())
        runs += [
            RunRef(rel=f"t{lo}/{r.name}", bytes=r.bytes, row_base=lo, pid_base=pid_base)
            for r in spiller.finish()
        ]
    _, first = np.unique(digests, return_index=True)
    seen = np.zeros(n, dtype=bool)
    seen[first] = True
    for count in (1, 5):
        rows, dup_pids = [], []
        for p in range(count):
            result = run_exact(
                ExactJob(out=store.url(), runs=tuple(runs), index=p, count=count, output=f"e{count}-{p}")
            )
            rows.append(read_all(store, result.rows.name, result.rows.bytes)[0])
            dup_pids.append(read_all(store, result.pids.name, result.pids.bytes)[0])
        assert np.array_equal(np.sort(np.concatenate(rows)), np.flatnonzero(~seen))
        assert np.array_equal(np.sort(np.concatenate(dup_pids)), np.sort(pids[~seen & passing]))


def test_run_files_read_back_by_value_range_and_in_order(tmp_path):
    store = open_store(tmp_path)
    rng = np.random.default_rng(4)
    values = rng.integers(0, 1 << 63, size=50_000, dtype=np.uint64) * np.uint64(2)
    other = rng.integers(0, 9, size=50_000).astype(np.uint64)
    info = write_run(store, "hash.run", [values, other])
    run = RunFile(store, "hash.run", info.bytes)
    assert run.entries == 50_000 and run.segments == 64  # about 1,024 entries a segment
    order = np.lexsort((other, values))
    lo, hi = 1 << 62, 3 << 61
    got = run.values(lo, hi)
    inside = order[(values[order] >= lo) & (values[order] < hi)]
    assert np.array_equal(got[0], values[inside]) and np.array_equal(got[1], other[inside])
    assert np.array_equal(run.values(0, FULL)[0], values[order])
    positions = np.sort(rng.choice(1 << 40, size=20_000, replace=False)).astype(np.uint64) + np.uint64(
        (1 << 32) - 5
    )
    info = write_run(store, "ids.run", [positions], by_id=True, ordered=True)
    cursor, taken = RunCursor(RunFile(store, "ids.run", info.bytes), block_bytes=4096), []
    for stop in np.linspace(int(positions[0]), int(positions[-1]) + 1, 37).astype(np.int64).tolist():
        part = cursor.below(stop)[0]
        assert not len(part) or int(part[-1]) < stop
        taken.append(part)
    assert np.array_equal(np.concatenate(taken), positions)


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_a_damaged_run_file_is_refused(tmp_path, damage):
    store = open_store(tmp_path)
    values = np.arange(0, 1 << 60, 1 << 44, dtype=np.uint64)
    info = write_run(store, "a.run", [values])
    path = tmp_path / "a.run"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[:-9]))
    elif damage == "flip":
        data[100] ^= 1
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(DamagedFile, match=str(path)):
        RunFile(store, "a.run", None if damage == "missing" else info.bytes).values()


def test_ranked_bits_count_the_members_below_any_id():
    base = (1 << 32) - 1000
    rng = np.random.default_rng(5)
    members = np.sort(rng.choice(5000, size=1800, replace=False)) + base
    bits = RankedBits(base, 5000)
    bits.add(members.astype(np.uint64))
    bits.freeze()
    ids = np.arange(base, base + 5000, dtype=np.uint64)
    assert np.array_equal(np.flatnonzero(bits.contains(ids)) + base, members)
    assert np.array_equal(bits.below(ids), np.searchsorted(members, ids.astype(np.int64)))
    # The merge asks for a piece's rows at once: any window, word-aligned or not, says the same.
    for first, count in [(0, 5000), (0, 1), (63, 2), (64, 64), (1, 4999), (4999, 1), (777, 3000), (10, 0)]:
        window = np.arange(base + first, base + first + count, dtype=np.uint64)
        assert np.array_equal(bits.contains_range(base + first, count), bits.contains(window)), (first, count)


def test_sorted_contains_is_isin_against_an_ascending_array():
    rng = np.random.default_rng(6)
    for size in (0, 1, 7, 500):
        members = np.sort(rng.choice(2000, size=size, replace=False)).astype(np.int64)
        ids = rng.integers(-5, 2005, size=1000)
        assert np.array_equal(sorted_contains(members, ids), np.isin(ids, members)), size
