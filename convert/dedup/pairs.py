"""Duplicate decisions from the entries of one partition, for the merge's stages
(convert/dedup/stages.py): no state carried from one document to the next, so any partition of
the digests or band keys by value gives the same decisions as one index in input order.

Exact duplicates: entries (digest's first 8 bytes, its last 8, row, pid). Among equal digests
every entry after the first in row order is a duplicate: the first occurrence in input order is
kept (`exact_duplicates`).

Near duplicates: entries (band key, document) of the documents that reach near-duplicate removal,
documents numbered in input order. The rule of convert/dedup/near_dedup.py's `candidates` is
decided key by key: an entry that is the r-th of its key (in document order, from 0) is compared
with the key's first min(r, per_key) entries, because the index keeps the first `per_key`
documents of a key, removed or not (`candidate_pairs`). The distinct pairs are verified by their
sketches, and the close ones (at or above the threshold) of every partition are decided in input
order (`NearDecisions`): under the rule "any" a document with a close pair goes, whatever became
of the earlier document, so the decisions need no order (only the count of documents removed
only through removed ones does); under "kept" a document goes when a close pair is with a kept
document, known by then in input order. Either way its match is its best counting pair: the
highest estimate, then the earliest document (`best_pairs`, `NearDuplicates.best`). The stages
stay parallel: only the last step, one bit per document, is in order.

Ids are 64-bit throughout; `RankedBits` is a set of ids as a bitmap with the count of members
below any id (1 bit per id plus 1 bit for the counts), which turns a document's pid into its
position once the exact duplicates among them are known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from convert.dedup.minhash import estimate_jaccard

NONE = np.uint64((1 << 64) - 1)  # a row that has no pid (it does not pass the filters)
_SCORE_STEP_BYTES = 1 << 22  # sketches compared per step (bounded temporary arrays)


def _group_starts(*sorted_columns: np.ndarray) -> np.ndarray:
    """True where an entry starts a new group of equal values (columns sorted together)."""
    count = len(sorted_columns[0])
    starts = np.zeros(count, dtype=bool)
    if count:
        starts[0] = True
        for column in sorted_columns:
            starts[1:] |= column[1:] != column[:-1]
    return starts


def exact_duplicates(
    high: np.ndarray, low: np.ndarray, rows: np.ndarray, pids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows (ascending) whose digest came earlier, and the pids among them (NONE left out)."""
    order = np.lexsort((rows, low, high))
    duplicate = ~_group_starts(high[order], low[order])
    order = order[duplicate]  # (the entries' own arrays are the caller's: only indexes here)
    dup_rows, dup_pids = rows[order], pids[order]
    return np.sort(dup_rows), np.sort(dup_pids[dup_pids != NONE])


def expand(items: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each item repeated `count` times, with 0..count-1 beside it."""
    repeated = np.repeat(items, counts)
    starts = np.cumsum(counts) - counts
    return repeated, np.arange(len(repeated)) - np.repeat(starts, counts)


def candidate_pairs(keys: np.ndarray, docs: np.ndarray, per_key: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (later, before) document pairs the rule compares, sorted by later then before."""
    order = np.lexsort((docs, keys))
    return sorted_candidate_pairs(keys[order], docs[order], per_key)


def sorted_candidate_pairs(
    keys: np.ndarray, docs: np.ndarray, per_key: int, block: int = 1 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """`candidate_pairs` of entries sorted by key, then document (`candidate_pair_blocks` joined)."""
    laters, befores = [], []
    for later, before in candidate_pair_blocks(keys, docs, per_key, block):
        laters.append(later)
        befores.append(before)
    empty = np.empty(0, dtype=docs.dtype)
    return distinct(
        np.concatenate(laters) if laters else empty, np.concatenate(befores) if befores else empty
    )


def candidate_pair_blocks(
    keys: np.ndarray, docs: np.ndarray, per_key: int, block: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The candidate pairs of entries sorted by key, then document, worked out `block` entries at
    a time (whole groups of a key): each block's distinct pairs, by later then before. A pair
    that two keys share may come in two blocks; the pairs of one block are at most `per_key`
    times its entries, so the temporary arrays stay small beside the entries."""
    at = 0
    while at < len(keys):
        end = min(len(keys), at + block)
        if end < len(keys):  # to the end of the last key's group
            end = int(np.searchsorted(keys, keys[end - 1], side="right"))
        block_keys, block_docs = keys[at:end], docs[at:end]
        starts = _group_starts(block_keys)
        group_start = np.flatnonzero(starts)[np.cumsum(starts) - 1]
        rank = np.arange(len(block_keys)) - group_start
        source, offset = expand(np.arange(len(block_keys)), np.minimum(rank, per_key))
        yield distinct(block_docs[source], block_docs[group_start[source] + offset])
        at = end


def distinct(later: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs, by later then before, without a document and itself (a document's
    two bands with one key)."""
    order = np.lexsort((before, later))
    later, before = later[order], before[order]
    keep = _group_starts(later, before) & (later != before)
    return later[keep], before[keep]


def scores(
    later: np.ndarray, before: np.ndarray, sketch_of: Callable[[np.ndarray], np.ndarray], bins: int
) -> np.ndarray:
    """Each pair's estimated Jaccard, from the sketches `sketch_of(documents)` gives."""
    out = np.empty(len(later))
    step = max(1, _SCORE_STEP_BYTES // bins)
    for lo in range(0, len(later), step):
        hi = lo + step
        out[lo:hi] = estimate_jaccard(sketch_of(later[lo:hi]), sketch_of(before[lo:hi]))
    return out


def best_pairs(
    later: np.ndarray, before: np.ndarray, estimates: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per document with a pair: its best one (highest estimate, then the earliest document), as
    (documents ascending, matches, estimates)."""
    if not len(later):
        return later, before, estimates
    best = np.lexsort((before, -estimates, later))
    first = best[np.r_[True, later[best][1:] != later[best][:-1]]]
    return later[first], before[first], estimates[first]


class NearDecisions:
    """Near-duplicate decisions in input order from the documents' close pairs: each pair of a
    document with an earlier one whose estimate is at or above the threshold, as any index or
    partition of the keys finds them (repeats allowed). By `rule` (NearDedupOptions):

      any   a document goes when it has a close pair, removed or not (no order between the
            decisions needed); `through_removed` counts those whose every close pair is with a
            removed document: they go only through one that went (the later links of a chain
            A ~ B ~ C, C not near A);
      kept  a document goes when it has a close pair with a kept document, decided in input
            order (an earlier document's fate is known when a later one is decided).

    A removed document's match is its best pair that counts (with a kept document under "kept"):
    the highest estimate, then the earliest. Holds a bit per document (the removed ones)."""

    def __init__(self, rule: str = "any", first: int = 0) -> None:
        self.rule, self.first = rule, first
        self.words = np.zeros(1 << 10, dtype=np.uint64)
        self.through_removed = 0

    @property
    def nbytes(self) -> int:
        return self.words.nbytes

    def removed(self, positions: np.ndarray) -> np.ndarray:
        """Whether each (decided) position was removed."""
        local = np.asarray(positions, dtype=np.int64) - self.first
        return ((self.words[local >> 6] >> (local & 63).astype(np.uint64)) & np.uint64(1)).astype(bool)

    def _reserve(self, end: int) -> None:
        """Room for positions below `end`."""
        need = ((end - self.first) >> 6) + 1
        if need > len(self.words):
            grown = np.zeros(max(need, 2 * len(self.words)), dtype=np.uint64)
            grown[: len(self.words)] = self.words
            self.words = grown

    def _mark(self, positions: np.ndarray) -> None:
        local = np.asarray(positions, dtype=np.int64) - self.first
        np.bitwise_or.at(self.words, local >> 6, np.uint64(1) << (local & 63).astype(np.uint64))

    def decide(
        self, first: int, count: int, later: np.ndarray, before: np.ndarray, estimates: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Documents `first` .. `first + count - 1`, the next in input order, from their close
        pairs (`later` among them, `before` an earlier position). Returns each one's match (-1:
        kept) and that pair's estimate."""
        self._reserve(first + count)
        doc = np.asarray(later, dtype=np.int64) - first
        before = np.asarray(before, dtype=np.int64)
        if self.rule == "kept":
            removed = self._decide_kept(first, count, doc, before)
            self._mark(first + np.flatnonzero(removed))
            counts = ~self.removed(before)
        else:
            removed = np.zeros(count, dtype=bool)
            removed[doc] = True
            self._mark(first + np.flatnonzero(removed))
            near_kept = np.zeros(count, dtype=bool)
            near_kept[doc[~self.removed(before)]] = True
            self.through_removed += int(np.count_nonzero(removed & ~near_kept))
            counts = np.ones(len(doc), dtype=bool)
        match, estimate = np.full(count, -1, dtype=np.int64), np.zeros(count)
        documents, matches, best = best_pairs(doc[counts], before[counts], np.asarray(estimates)[counts])
        match[documents], estimate[documents] = matches, best
        return match, estimate

    def _decide_kept(self, first: int, count: int, doc: np.ndarray, before: np.ndarray) -> np.ndarray:
        """Under "kept": which documents go. A pair with an earlier block's kept document decides
        at once; pairs within the block are walked in input order of their later document."""
        outside = before < first
        removed = np.zeros(count, dtype=bool)
        removed[doc[outside][~self.removed(before[outside])]] = True
        inside = np.flatnonzero(~outside)
        if not len(inside):
            return removed
        inside = inside[np.lexsort((before[inside], doc[inside]))]
        gone = removed.tolist()
        for d, b in zip(doc[inside].tolist(), (before[inside] - first).tolist(), strict=True):
            if not gone[d] and not gone[b]:  # b's pairs all came before d's: its fate is known
                gone[d] = True
        return np.array(gone, dtype=bool)


def sorted_contains(members: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per id, whether it is among `members` (ascending): a binary search per id, O(n log m), where
    `np.isin` would sort both arrays again on every call."""
    if not len(members):
        return np.zeros(len(ids), dtype=bool)
    at = np.minimum(np.searchsorted(members, ids), len(members) - 1)
    return members[at] == ids


class RankedBits:
    """A set of ids in [base, base + size) as a bitmap; `below(ids)` counts the members under each
    (after `freeze`, which adds a running count per 64 ids)."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        self.words = np.zeros((size + 63) // 64, dtype=np.uint64)
        self.counts: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + (self.counts.nbytes if self.counts is not None else 0)

    def add(self, ids: np.ndarray) -> None:
        local = np.asarray(ids, dtype=np.uint64) - np.uint64(self.base)
        np.bitwise_or.at(
            self.words, (local >> np.uint64(6)).astype(np.intp), np.uint64(1) << (local & np.uint64(63))
        )

    def freeze(self) -> RankedBits:
        self.counts = np.zeros(len(self.words), dtype=np.int64)
        np.cumsum(np.bitwise_count(self.words)[:-1], out=self.counts[1:])
        return self

    def _split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        local = np.asarray(ids, dtype=np.uint64) - np.uint64(self.base)
        return (local >> np.uint64(6)).astype(np.intp), local & np.uint64(63)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        word, bit = self._split(ids)
        return ((self.words[word] >> bit) & np.uint64(1)).astype(bool)

    def contains_range(self, first: int, count: int) -> np.ndarray:
        """`contains(np.arange(first, first + count))`, from the words' bits unpacked at once."""
        local = first - self.base
        start = local // 64
        words = self.words[start : (local + count + 63) // 64].astype("<u8", copy=False)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return bits[local - 64 * start : local - 64 * start + count].view(bool)

    def below(self, ids: np.ndarray) -> np.ndarray:
        word, bit = self._split(ids)
        under = self.words[word] & ((np.uint64(1) << bit) - np.uint64(1))
        return self.counts[word] + np.bitwise_count(under).astype(np.int64)

    def save(self, path: str) -> None:
        np.save(path, np.concatenate([np.array([self.base, self.size], dtype=np.uint64), self.words,
                                      self.counts.view(np.uint64)]))  # fmt: skip

    @classmethod
    def load(cls, path: str) -> RankedBits:
        """A saved set, mapped from its file (the near stage's workers share one copy)."""
        data = np.load(path, mmap_mode="r")
        bits = cls.__new__(cls)
        bits.base, bits.size = int(data[0]), int(data[1])
        words = (bits.size + 63) // 64
        bits.words = data[2 : 2 + words]
        bits.counts = data[2 + words : 2 + 2 * words].view(np.int64)
        return bits
