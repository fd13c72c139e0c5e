"""MinHash signatures over character n-grams, and the near-duplicate decisions made from them."""

from __future__ import annotations

import numpy as np
import pytest

from convert.dedup.minhash import SIGNATURE_VERSION, estimate_jaccard, jaccard, signatures
from convert.dedup.near_dedup import NearDuplicates, PairSample
from convert.dedup.options import NearDedupOptions, lsh_parameters
from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.filters.quality import utf32
from tests.support.corpus import edited_copy

OPTIONS = NearDedupOptions().resolve(5)


def sign(texts: list[str], options: NearDedupOptions = OPTIONS) -> tuple[np.ndarray, np.ndarray]:
    codes, lengths = utf32(texts)
    return signatures(codes, lengths, options)


@pytest.fixture(scope="module")
def articles(chinese_documents) -> list[str]:
    cleaner = Cleaner()
    return [t for t in map(cleaner.clean, chinese_documents[:600]) if t and len(t) >= 200]


def test_the_estimate_follows_exact_jaccard_on_real_text(articles):
    originals = articles[:150]
    copies = [
        edited_copy(text, share, seed)
        for seed, (text, share) in enumerate(zip(originals, [0.01, 0.03, 0.06] * 50, strict=True))
    ]
    keys, sketches = sign(originals + copies)
    n = len(originals)
    estimates = estimate_jaccard(sketches[:n], sketches[n:])
    exact = np.array([jaccard(a, b, 5) for a, b in zip(originals, copies, strict=True)])
    error = estimates - exact
    assert abs(error.mean()) < 0.01 and error.std() < 0.04, (error.mean(), error.std())
    assert exact.min() < 0.75 < 0.9 < exact.max()  # the pairs span the threshold
    # Neighbouring articles: mostly unrelated, some on one topic; the estimate follows them too.
    neighbours = estimate_jaccard(sketches[: n - 1], sketches[1:n])
    exact_neighbours = np.array([jaccard(a, b, 5) for a, b in zip(originals, originals[1:], strict=False)])
    assert np.abs(neighbours - exact_neighbours).max() < 0.08 and np.median(neighbours) < 0.02


def test_a_text_signs_the_same_alone_or_in_any_batch(articles):
    together_keys, together_sketches = sign(articles[:40])
    for i in (0, 17, 39):
        keys, sketches = sign([articles[i]])
        assert np.array_equal(keys[0], together_keys[i]) and np.array_equal(sketches[0], together_sketches[i])


def test_signatures_are_pinned_to_their_version():
    """Tasks and their merge compare signatures made on different machines: a change to the
    signature code must bump SIGNATURE_VERSION (and then this pin)."""
    keys, sketches = sign(["人民日报社论：新年献词，1998年元旦。"])
    assert SIGNATURE_VERSION == 1
    assert (hex(int(keys[0, 0])), hex(int(keys[0, -1]))) == ("0xdf5a43bc814e8625", "0x2ad7c502cd981c11")
    assert sketches[0, :8].tolist() == [80, 71, 230, 221, 61, 171, 180, 1]


def test_short_texts_are_signed_too():
    keys, sketches = sign(["好", "很好的酒店", "很好的酒店!", ""])
    assert keys.shape == (4, OPTIONS.bands) and sketches.shape == (4, OPTIONS.bins)
    assert estimate_jaccard(sketches[1], sketches[2]) > 0.3


def sequential_reference(
    keys: np.ndarray, sketches: np.ndarray, options: NearDedupOptions, rule: str = "any"
) -> list[int]:
    """The decision rule, one document at a time, with plain Python containers: under "kept" only
    candidates that were kept count."""
    return _reference(keys, sketches, options, rule)[0]


def _reference(keys: np.ndarray, sketches: np.ndarray, options: NearDedupOptions, rule: str):
    """(matches, how many removed documents have close candidates that were all removed)."""
    stored: dict[int, list[int]] = {}
    matches, through_removed = [], 0
    for doc in range(len(keys)):
        candidates = sorted({e for key in keys[doc].tolist() for e in stored.get(key, [])})
        best, best_score, near_kept = -1, -1.0, False
        for earlier in candidates:
            score = float(estimate_jaccard(sketches[doc], sketches[earlier]))
            if score < options.threshold:
                continue
            near_kept |= matches[earlier] < 0
            if (rule == "any" or matches[earlier] < 0) and score > best_score:
                best, best_score = earlier, score
        matches.append(best)
        through_removed += best >= 0 and not near_kept
        for key in keys[doc].tolist():
            bucket = stored.setdefault(key, [])
            if len(bucket) < options.per_key:
                bucket.append(doc)
    return matches, through_removed


def test_decisions_do_not_depend_on_batches_and_follow_the_rule():
    rng = np.random.default_rng(0)
    options = NearDedupOptions(threshold=0.5, bins=16, bands=4, rows=2, per_key=3).resolve(10)
    n = 2500
    # Few distinct keys and values: many collisions, candidates, near and not near pairs.
    keys = rng.integers(0, 40, size=(n, 4)).astype(np.uint64) + (
        np.arange(4, dtype=np.uint64) << np.uint64(40)
    )
    sketches = rng.integers(0, 3, size=(n, 16)).astype(np.uint8)
    results = []
    for size in (1, 137, n):
        near = NearDuplicates(options)
        results.append(
            np.concatenate(
                [near.add(keys[i : i + size], sketches[i : i + size])[0] for i in range(0, n, size)]
            )
        )
    assert all(np.array_equal(results[0], other) for other in results[1:])
    assert results[0].tolist() == sequential_reference(keys, sketches, options)
    assert 0.2 < (results[0] >= 0).mean() < 0.8
    assert len(near.index.levels) < 12  # the sorted levels are merged as they grow


@pytest.mark.parametrize("rule", ["any", "kept"])
def test_close_pairs_decided_in_order_follow_each_rule_whatever_the_batches(rule):
    """A batch's close pairs (`add_pairs`) decided by `NearDecisions`: the rule's decisions, one
    document at a time, for batches of 1, 137 or all; under "any" the documents removed only
    through removed ones are counted."""
    from convert.dedup.pairs import NearDecisions

    rng = np.random.default_rng(0)
    options = NearDedupOptions(threshold=0.5, bins=16, bands=4, rows=2, per_key=3).resolve(10)
    n = 2500
    keys = rng.integers(0, 40, size=(n, 4)).astype(np.uint64) + (
        np.arange(4, dtype=np.uint64) << np.uint64(40)
    )
    sketches = rng.integers(0, 3, size=(n, 16)).astype(np.uint8)
    expected, through_removed = _reference(keys, sketches, options, rule)
    for size in (1, 137, n):
        near, decisions, got = NearDuplicates(options), NearDecisions(rule), []
        for i in range(0, n, size):
            first, count = near.size, len(keys[i : i + size])
            got.append(
                decisions.decide(first, count, *near.add_pairs(keys[i : i + size], sketches[i : i + size]))[0]
            )
        assert np.concatenate(got).tolist() == expected, size
        assert decisions.through_removed == (through_removed if rule == "any" else 0)
    removed_any = sum(m >= 0 for m in sequential_reference(keys, sketches, options))
    if rule == "any":
        assert 50 < through_removed < removed_any
    else:  # a chain's later links stay when nothing kept is near them
        assert 0 < sum(m >= 0 for m in expected) < removed_any


def test_positions_cross_2_to_the_32_in_the_band_index():
    """The index stores 32-bit positions while they fit and 64-bit ones past 2**32, levels of both
    merged: the same decisions as positions from 0, shifted."""
    rng = np.random.default_rng(3)
    options = NearDedupOptions(threshold=0.5, bins=16, bands=4, rows=2, per_key=1000).resolve(10)
    keys = rng.integers(0, 40, size=(1500, 4)).astype(np.uint64) + (
        np.arange(4, dtype=np.uint64) << np.uint64(40)
    )
    sketches = rng.integers(0, 3, size=(1500, 16)).astype(np.uint8)
    start = (1 << 32) - 700
    low, high = NearDuplicates(options), NearDuplicates(options, first=start)
    for lo in range(0, 1500, 100):
        a, _ = low.add(keys[lo : lo + 100], sketches[lo : lo + 100])
        b, _ = high.add(keys[lo : lo + 100], sketches[lo : lo + 100])
        assert np.array_equal(np.where(a >= 0, a + start, -1), b)
    assert (b >= 1 << 32).any()  # matches past the boundary, found in the index
    dtypes = {level.positions.dtype for level in high.index.levels}
    assert np.dtype(np.uint64) in dtypes and high.size > 1 << 32


def test_a_chain_keeps_only_its_first_document():
    """A ~ B and B ~ C while A and C are not near: C goes too (it is near an earlier document)."""
    options = NearDedupOptions(threshold=0.6, bins=16, bands=2, rows=8).resolve(10)
    base = np.arange(16, dtype=np.uint8)
    a, b, c = base.copy(), base.copy(), base.copy()
    b[:5] += 100  # A-B agree on 11 of 16
    c[:5] += 100
    c[11:] += 100  # B-C agree on 11, A-C on 6
    keys = np.array([[1, 2], [1, 3], [4, 3]], dtype=np.uint64)  # A-B share band 0, B-C band 1
    match, estimate = NearDuplicates(options).add(keys, np.stack([a, b, c]))
    assert match.tolist() == [-1, 0, 1]
    assert float(estimate_jaccard(a, c)) < options.threshold < estimate[2]


def test_a_key_keeps_only_its_first_documents():
    options = NearDedupOptions(threshold=0.9, bins=16, bands=1, rows=16, per_key=2).resolve(10)
    sketches = np.stack([np.full(16, v, dtype=np.uint8) for v in (1, 2, 3, 3)])
    keys = np.full((4, 1), 7, dtype=np.uint64)
    # Document 3 equals document 2, but document 2 came after the key's two places were taken.
    assert NearDuplicates(options).add(keys, sketches)[0].tolist() == [-1, -1, -1, -1]
    wider = NearDedupOptions(threshold=0.9, bins=16, bands=1, rows=16, per_key=3).resolve(10)
    assert NearDuplicates(wider).add(keys, sketches)[0].tolist() == [-1, -1, -1, 2]


def test_lsh_parameters_catch_pairs_at_the_threshold():
    for threshold in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95):
        bands, rows = lsh_parameters(threshold, 256)
        assert bands * rows <= 256
        assert 1 - (1 - threshold**rows) ** bands >= 0.99
        # and steeper would not fit: one more row needs more bins than there are
        more = rows + 1
        needed = np.ceil(np.log(0.01) / np.log1p(-(threshold**more)))
        assert needed * more > 256


def test_bad_near_dedup_settings_are_refused():
    with pytest.raises(ConvertError, match=r"threshold 0.0 must be in \(0, 1\]"):
        NearDedupOptions(threshold=0.0).resolve(5)
    with pytest.raises(ConvertError, match="--shingle 8 is longer than the shortest document kept"):
        NearDedupOptions(ngram=8).resolve(5)
    with pytest.raises(ConvertError, match="power of two"):
        NearDedupOptions(bins=100).resolve(5)
    with pytest.raises(ConvertError, match="more than --minhash-bins"):
        NearDedupOptions(bands=20, rows=20).resolve(5)


def test_the_pair_sample_is_the_same_whatever_the_batches(articles):
    texts = articles[:60] + [edited_copy(t, 0.01, i) for i, t in enumerate(articles[:60])]
    keys, sketches = sign(texts)
    samples = []
    for size in (1, 7, len(texts)):
        near, sample = NearDuplicates(OPTIONS), PairSample(keys=40, per_key=2)
        for lo in range(0, len(texts), size):
            first = near.size
            match, estimate = near.add(keys[lo : lo + size], sketches[lo : lo + size])
            for i in range(len(match)):
                sample.offer(int(keys[lo + i, 0]), first + i, texts[lo + i])
                if match[i] >= 0:
                    sample.record(first + i, int(match[i]), float(estimate[i]))
        samples.append(sample.pairs(5))
    assert samples[0] == samples[1] == samples[2]
    assert len(samples[0]) > 5
    for pair in samples[0]:
        assert texts.index(pair["kept"]["text"]) < 60 <= texts.index(pair["removed"]["text"])
        assert pair["jaccard"] >= 0.85 and abs(pair["jaccard"] - pair["estimated_jaccard"]) < 0.1


def test_the_threshold_is_a_jaccard_of_5_grams_not_a_share_of_edited_characters(articles):
    """docs/benchmarks.md's table (`make bench-dedup`'s --edit-table): at 0.8, copies with 1 % of their
    characters substituted at scattered places go, with 5 % they stay (Jaccard about 0.63),
    while a copy with 5 % replaced in one block (Jaccard about 0.89) goes."""
    docs = [a for a in articles if len(a) >= 300][:60]

    def removed(copies: list[str]) -> float:
        keys, sketches = sign(docs + copies)
        match, _ = NearDuplicates(OPTIONS).add(keys, sketches)
        return float((match[len(docs) :] >= 0).mean())

    scattered = [edited_copy(d, 0.05, seed=i) for i, d in enumerate(docs)]
    assert np.mean([jaccard(a, b, 5) for a, b in zip(docs, scattered, strict=True)]) < 0.7
    assert removed([edited_copy(d, 0.01, seed=i) for i, d in enumerate(docs)]) >= 0.95
    assert removed(scattered) == 0.0
    block = [d[: len(d) // 2] + d[len(d) // 2 : len(d) // 2 + len(d) // 20][::-1] + d[len(d) // 2 + len(d) // 20 :]
             for d in docs]  # fmt: skip
    assert removed(block) >= 0.95


class SequentialSample:
    """The pair sample's rule, one offer at a time: keys beyond the `keys` smallest distinct ones
    seen cannot join, a new smaller key evicts the largest, `per_key` documents per key."""

    def __init__(self, keys: int, per_key: int) -> None:
        self.capacity, self.per_key = keys, per_key
        self.members: dict[int, list[tuple[int, str]]] = {}
        self.removed: dict[int, tuple[int, float]] = {}

    def offer(self, key: int, position: int, text: str) -> None:
        if key in self.members:
            if len(self.members[key]) < self.per_key:
                self.members[key].append((position, text))
            return
        if len(self.members) >= self.capacity:
            largest = max(self.members)
            if key >= largest:
                return
            for gone, _ in self.members.pop(largest):
                self.removed.pop(gone, None)
        self.members[key] = [(position, text)]

    def record(self, position: int, match: int, estimate: float) -> None:
        if any(position == p for members in self.members.values() for p, _ in members):
            self.removed[position] = (match, estimate)


def test_the_pair_sample_decides_a_batch_at_once_as_one_offer_after_another():
    """`offer_all` (numpy, a batch at a time) against the rule applied document by document:
    repeated keys, keys that join and leave within a batch, texts that are not there (not offered)."""
    rng = np.random.default_rng(3)
    batched, reference = PairSample(keys=16, per_key=3), SequentialSample(16, 3)
    position = 0
    for size in rng.integers(0, 120, size=60).tolist():
        keys = rng.integers(0, 400, size=size).astype(np.uint64) * np.uint64(1 << 40)
        positions = position + np.arange(size)
        texts = [None if rng.random() < 0.1 else f"doc {position + i}" for i in range(size)]
        batched.offer_all(keys, positions, lambda i, texts=texts: texts[i])
        for i in range(size):
            if texts[i] is not None:
                reference.offer(int(keys[i]), position + i, texts[i])
        for i in rng.choice(size, size=size // 4, replace=False).tolist() if size else []:
            batched.record_all(np.array([position + i]), np.array([position + i - 1]), np.array([0.9]))
            reference.record(position + i, position + i - 1, 0.9)
        position += size
        assert batched.members == reference.members
        assert batched.removed == reference.removed
    assert batched.bound == max(reference.members) < 400 << 40


def test_a_large_band_index_finds_what_a_dictionary_finds():
    """Levels large enough for a directory over the keys' top bits, keys sharing their top bits
    and keys stored many times: every hit and count as a plain dictionary of the entries has."""
    from convert.dedup.near_dedup import BandIndex

    rng = np.random.default_rng(4)
    index, stored = BandIndex(), {}
    position = 0
    for size in (150_000, 40_000, 9_000, 70_000, 2_000, 300):
        keys = rng.integers(0, 1 << 63, size=size, dtype=np.uint64) | np.uint64(1 << 63)
        keys[::5] = keys[1::5]  # the same key twice
        keys[::97] = np.uint64(0xFFFF_0000_0000_0000)  # one key very often; and its top-bit neighbours
        keys[1::97] = np.uint64(0xFFFF_0000_0000_0001)
        positions = np.arange(position, position + size, dtype=np.uint32)
        index.insert(keys, positions)
        for key, pos in zip(keys.tolist(), positions.tolist(), strict=True):
            stored.setdefault(key, []).append(pos)
        position += size
    assert any(level.directory is not None for level in index.levels) and len(index.levels) > 2
    queries = np.sort(np.concatenate([rng.choice(np.fromiter(stored, np.uint64), 5000),
                                      rng.integers(0, 1 << 64, size=5000, dtype=np.uint64)]))  # fmt: skip
    counts, query, found = index.lookup(queries)
    assert counts.tolist() == [len(stored.get(q, ())) for q in queries.tolist()]
    hits: dict[int, list[int]] = {}
    for q, pos in zip(query.tolist(), found.tolist(), strict=True):
        hits.setdefault(q, []).append(pos)
    assert {q: sorted(p) for q, p in hits.items()} == {
        i: sorted(stored[q]) for i, q in enumerate(queries.tolist()) if q in stored
    }
