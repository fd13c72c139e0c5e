"""Near-duplicate decisions, in input order (main process), from the workers' MinHash signatures.

The workers send, per document, its LSH band keys and its 8-bit sketch (convert/dedup/minhash.py).
Here each batch of documents, in input order:

  1. looks its band keys up in the band index: every earlier document sharing a band key is a
     candidate (an earlier document of the same batch too);
  2. verifies each candidate pair by the sketches: the document goes, as a near-duplicate of the
     candidate with the highest estimate, when an estimate is >= the threshold. Without this
     step a band collision alone would decide, and LSH's S-curve lets through many pairs well
     below the threshold: on `make bench-dedup`'s brute-force sample, LSH alone (datasketch,
     same bands) has a precision of 0.39 at threshold 0.8, with the check 0.91, its errors
     within 0.04 of the threshold;
  3. indexes every document of the batch, removed or not, under each band key that has fewer
     than `per_key` documents yet.

So a document is removed exactly when it is near an earlier document, whatever batches the
documents came in: the result is the same for any number of workers, and on resume. The first
document of every cluster is kept; a chain A ~ B ~ C keeps only A, even when A and C are not
near each other (a removed document still counts: the rule "any"). The pairs at or above the
threshold go to `NearDecisions` (convert/dedup/pairs.py), which counts such documents and, under
the rule "kept", removes a document only when it is near an earlier kept one (steps 1-3 do not
change). Nothing carries over from one key to another, so the merge of a multi-machine
conversion decides the same pairs partition by partition of the keys, from sorted runs on disk
(convert/dedup/stages.py, pairs.py), with no index in memory. `per_key` bounds the work on boilerplate: a key shared by thousands of
documents keeps the first `per_key`, and a new document is compared with those.

Split over processes (convert/dedup/index_processes.py, with many workers): every step above is
decided key by key (a key's earlier documents, its room under `per_key`, its order in the batch),
so the keys are split by value over index processes, each finding and verifying its candidate
pairs (`candidates`) against the sketches, and the main process picks each document's best pair
among theirs: the same decisions as one index.

Memory: the band index holds 12 bytes (64-bit key, 32-bit position; 16 once positions pass
2**32) per band and document, the sketches `bins` bytes per document: with the defaults (26
bands at threshold 0.8, 256 bins) about 570 bytes per document, 5.7 GB per 10 M documents
(`make bench-dedup` measures it). A one-machine conversion whose state would not fit its
`--memory-budget` runs in two passes instead (convert/run/jobs.py `plan_memory`). The index is a log-structured set of sorted numpy arrays: a few levels, a new run merged
into the last (a linear merge, no sort) while it is at least a quarter of it, so inserting
costs O(log n) per key; a lookup is a binary search in a small level and, in a large one, a
look at the few entries that a directory over the keys' top bits points to (about 1 byte per
entry; without it, each binary search in a level of millions of keys is some 20 cache misses),
and the index never holds Python objects per key
(datasketch's in-memory MinHashLSH, a dict of Python sets per band, holds about 8,900 bytes per
document with the same bands: `make bench-dedup`).
"""

from __future__ import annotations

import numpy as np

from convert.dedup.minhash import estimate_jaccard, jaccard
from convert.dedup.options import NearDedupOptions
from convert.dedup.pairs import best_pairs, distinct, expand, sorted_contains

_BLOCK_ROWS = 1 << 16  # sketches are stored in blocks of this many documents
_MERGE_RATIO = 4  # a new run joins the last level while it is at least 1/_MERGE_RATIO of it
_DIRECTORY_FROM = 1 << 16  # levels of this many keys or more get a directory


class _Level:
    """One sorted run of the band index: keys ascending (equal keys oldest first), their
    positions, and for a large run a directory over the keys' top bits (keys are hash values,
    spread evenly): `directory[j]` is the first entry whose key's top bits are at least j."""

    def __init__(self, keys: np.ndarray, positions: np.ndarray) -> None:
        self.keys, self.positions = keys, positions
        self.directory, self.shift = None, np.uint64(0)
        if len(keys) >= _DIRECTORY_FROM:
            bits = (len(keys) // 4).bit_length()  # about 2 to 4 entries per slot
            self.shift = np.uint64(64 - bits)
            counts = np.bincount((keys >> self.shift).astype(np.intp), minlength=1 << bits)
            self.directory = np.zeros((1 << bits) + 1, dtype=np.uint32 if len(keys) < 1 << 32 else np.int64)
            np.cumsum(counts, out=self.directory[1:])

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query index, entry) of every entry whose key equals a query, and each query's count."""
        if self.directory is None:  # a binary search per query (the run is small: in cache)
            low = self.keys.searchsorted(queries, side="left")
            found = np.zeros(len(queries), dtype=np.int64)
            present = np.flatnonzero(self.keys[np.minimum(low, len(self.keys) - 1)] == queries)
            if len(present):
                found[present] = self.keys.searchsorted(queries[present], side="right") - low[present]
            which = np.flatnonzero(found)
            query, offset = expand(which, found[which])
            return query, low[query] + offset
        # The directory narrows each query to a few entries, compared all at once.
        slot = (queries >> self.shift).astype(np.intp)
        start = self.directory[slot].astype(np.int64)
        query, offset = expand(np.arange(len(queries)), self.directory[slot + 1] - start)
        entry = start[query] + offset
        equal = self.keys[entry] == queries[query]
        return query[equal], entry[equal]


class BandIndex:
    """Band key -> positions of the documents that have it, oldest first, in sorted levels."""

    def __init__(self) -> None:
        self.levels: list[_Level] = []  # oldest (and largest) first

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    @property
    def nbytes(self) -> int:
        """The keys and positions (the directories add about 1 byte per entry of a large level)."""
        return sum(level.keys.nbytes + level.positions.nbytes for level in self.levels)

    def lookup(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each query key: how many documents have it; and every (query index, position) hit.

        Queries in ascending order are faster (the binary searches of small levels stay in cache)."""
        counts = np.zeros(len(queries), dtype=np.int64)
        hit_queries, hit_positions = [], []
        for level in self.levels:
            query, entry = level.find(queries)
            if len(query):
                counts += np.bincount(query, minlength=len(queries))
                hit_queries.append(query)
                hit_positions.append(level.positions[entry])
        if not hit_queries:
            return counts, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint32)
        return counts, np.concatenate(hit_queries), np.concatenate(hit_positions)

    def insert(self, keys: np.ndarray, positions: np.ndarray, *, ordered: bool = False) -> None:
        """Add entries; among equal keys, these come after every entry already there. A new run
        is merged into the last level while it is at least a quarter of it: a few levels, each a
        quarter or less of the one before, so a lookup visits few and an entry is copied
        O(log n) times. `ordered`: the keys are ascending already."""
        if not len(keys):
            return
        if ordered:  # keys ascending already
            run = (keys, positions)
        else:
            order = np.argsort(keys, kind="stable")
            run = (keys[order], positions[order])
        while self.levels and _MERGE_RATIO * len(run[0]) >= len(self.levels[-1]):
            older = self.levels.pop()
            run = _merge_sorted((older.keys, older.positions), run)
        self.levels.append(_Level(*run))


def _merge_sorted(older: tuple[np.ndarray, np.ndarray], newer: tuple[np.ndarray, np.ndarray]):
    """Two sorted levels as one; equal keys keep the older level's entries first."""
    (old_keys, old_pos), (new_keys, new_pos) = older, newer
    total = len(old_keys) + len(new_keys)
    slots = old_keys.searchsorted(new_keys, side="right") + np.arange(len(new_keys))
    from_old = np.ones(total, dtype=bool)
    from_old[slots] = False
    keys = np.empty(total, dtype=old_keys.dtype)
    positions = np.empty(total, dtype=np.result_type(old_pos, new_pos))
    keys[slots], positions[slots] = new_keys, new_pos
    keys[from_old], positions[from_old] = old_keys, old_pos
    return keys, positions


class SketchStore:
    """Every indexed document's 8-bit sketch, by position, in fixed-size blocks (no regrowth copies)."""

    def __init__(self, bins: int) -> None:
        self.bins = bins
        self.blocks: list[np.ndarray] = []
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self.size * self.bins

    def append(self, sketches: np.ndarray) -> None:
        done = 0
        while done < len(sketches):
            if self.size == len(self.blocks) * _BLOCK_ROWS:
                self.blocks.append(np.empty((_BLOCK_ROWS, self.bins), dtype=np.uint8))
            row = self.size % _BLOCK_ROWS
            take = min(len(sketches) - done, _BLOCK_ROWS - row)
            self.blocks[-1][row : row + take] = sketches[done : done + take]
            done += take
            self.size += take

    def take(self, positions: np.ndarray) -> np.ndarray:
        out = np.empty((len(positions), self.bins), dtype=np.uint8)
        block = positions // _BLOCK_ROWS
        for b in np.unique(block).tolist():
            where = np.flatnonzero(block == b)
            out[where] = self.blocks[b][positions[where] % _BLOCK_ROWS]
        return out


def candidates(index: BandIndex, flat: np.ndarray, doc: np.ndarray, base: int, per_key: int):
    """Look a batch's keys up in `index` and insert them: (later, before) candidate pairs, `later`
    a document of the batch (0-based), `before` the position of an earlier one (this batch's at
    `base` on). `flat`: the keys, `doc`: each key's document; equal keys in document order (any
    order otherwise: runs of ascending keys are sorted fastest).

    Everything here is decided key by key (a key's earlier documents, its room under `per_key`,
    its order in the batch), so the keys can be split by value across indexes
    (convert/dedup/index_processes.py) and the union of their pairs is this function's pairs on all keys."""
    # Equal keys in document order (the index is searched with the keys sorted).
    order = np.argsort(flat, kind="stable")
    sorted_keys, sorted_doc = flat[order], doc[order]
    stored_before, hit_query, hit_position = index.lookup(sorted_keys)

    # Within the batch: each key takes the documents that fit, in document order.
    starts_group = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]
    group_start = np.flatnonzero(starts_group)[np.cumsum(starts_group) - 1]
    rank = np.arange(len(sorted_keys)) - group_start
    room = np.maximum(per_key - stored_before, 0)
    earlier = np.minimum(rank, room)  # stored documents of this batch before this one
    source, offset = expand(np.arange(len(sorted_keys)), earlier)

    later = np.concatenate([sorted_doc[hit_query], sorted_doc[source]])
    before = np.concatenate([hit_position.astype(np.int64), base + sorted_doc[group_start[source] + offset]])
    stored = rank < room
    index.insert(
        sorted_keys[stored], position_array(base + sorted_doc[stored], base + len(flat)), ordered=True
    )
    return later, before


def position_array(positions: np.ndarray, end: int) -> np.ndarray:
    """Positions below `end` as the index stores them: 32-bit while they fit, 64-bit past 2**32."""
    return positions.astype(np.uint32 if end <= 1 << 32 else np.uint64)


def distinct_pairs(later: np.ndarray, before: np.ndarray, base: int, count: int):
    """The distinct (later, before) pairs, by later then before, without a document and itself;
    `later` within the batch (0-based, its first document at position `base`)."""
    later, before = distinct(later + base, before)
    return later - base, before


class NearDuplicates:
    """The near-duplicate decisions of one conversion in this process (see the module docstring)."""

    def __init__(self, options: NearDedupOptions, first: int = 0) -> None:
        self.options = options
        self.first = first  # the first document's position (a test starts just below 2**32)
        self.index = BandIndex()
        self.sketches = SketchStore(options.bins)
        self.candidates = 0  # pairs verified, for the benchmark

    @property
    def size(self) -> int:
        """The next document's position."""
        return self.first + self.sketches.size

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.sketches.nbytes

    def add(self, keys: np.ndarray, sketches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decide and index a batch of documents in input order (rows of `keys`, `sketches`), by
        the rule "any".

        Returns, per document, the position of the earlier document it is a near-duplicate of
        (-1: none) and that pair's estimated Jaccard. The batch's documents get positions
        `size`, `size + 1`, ... (read `size` before the call).
        """
        base, count = self.size, len(sketches)
        later, before, scores = self.add_pairs(keys, sketches)
        return self.best(later - base, before, scores, count)

    def add_pairs(self, keys: np.ndarray, sketches: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Index a batch of documents (as `add`) and return its close pairs: (document's position,
        earlier position, estimate) for every candidate pair at or above the threshold, for
        `NearDecisions` to decide by either rule."""
        count = len(sketches)
        base = self.size
        self.sketches.append(sketches)
        flat = keys.ravel()
        doc = np.repeat(np.arange(count), keys.shape[1])
        later, before = candidates(self.index, flat, doc, base, self.options.per_key)
        later, before, scores = self._verify(later, before, base, count, sketches)
        return later + base, before, scores

    def _verify(self, later: np.ndarray, before: np.ndarray, base: int, count: int, sketches: np.ndarray):
        """The distinct candidate pairs at or above the threshold, and their estimates."""
        later, before = distinct_pairs(later, before, base, count)
        self.candidates += len(later)
        scores = np.empty(len(later))
        step = max(1, (1 << 24) // self.options.bins)  # bounded temporary arrays
        for lo in range(0, len(later), step):
            hi = lo + step
            earlier = self.sketches.take(before[lo:hi] - self.first)
            scores[lo:hi] = estimate_jaccard(sketches[later[lo:hi]], earlier)
        near = scores >= self.options.threshold
        return later[near], before[near], scores[near]

    @staticmethod
    def best(later: np.ndarray, before: np.ndarray, scores: np.ndarray, count: int):
        """Per document of the batch: its match among the near pairs and the estimate (-1, 0: none):
        the highest estimate, then the earliest document."""
        match = np.full(count, -1, dtype=np.int64)
        estimate = np.zeros(count, dtype=np.float64)
        documents, matches, estimates = best_pairs(later, before, scores)
        match[documents], estimate[documents] = matches, estimates
        return match, estimate


class PairSample:
    """A fixed-size, deterministic sample of near-duplicate pairs with their texts, for the report.

    Members are the indexed documents whose first band key is among the `keys` smallest distinct
    first band keys seen, at most `per_key` per key (the first in input order). Near-duplicates
    often share that key, so a member's match is often a member too; the report shows the removed
    members whose match is one. The members depend only on the documents, not on batches or
    workers, and the smallest keys of several tasks together are the smallest keys of all, so a
    merge of tasks finds the same sample (tasks keep `2 * per_key` per key as a margin for
    documents that turn out to be exact duplicates across tasks).
    """

    def __init__(self, keys: int = 1024, per_key: int = 4) -> None:
        self.capacity, self.per_key = keys, per_key
        self.members: dict[int, list[tuple[int, str]]] = {}
        self._keys = np.empty(0, dtype=np.uint64)  # the members' keys, ascending
        self._key_of: dict[int, int] = {}  # position -> key
        self.removed: dict[int, tuple[int, float]] = {}  # position -> (match position, estimate)
        self.where: dict[int, tuple[str, int]] = {}  # position -> (input file, line), when known

    @property
    def bound(self) -> int:
        """Keys above this cannot join (2**64 while there is room)."""
        return int(self._keys[-1]) if len(self._keys) >= self.capacity else 1 << 64

    def offer(self, key: int, position: int, text: str, where: tuple[str, int] | None = None) -> None:
        """`where`: the document's input file and line (record) number, when known."""
        item = (text, *where) if where is not None else text
        self.offer_all(np.array([key], dtype=np.uint64), np.array([position]), lambda _: item)

    def offer_all(self, keys: np.ndarray, positions: np.ndarray, text) -> None:
        """`offer` for each document of a batch, in input order (`keys`, `positions` ascending),
        decided at once with the same outcome: members are the `capacity` smallest distinct keys
        offered, each with its first `per_key` documents, and a key once evicted never returns
        (it is above the bound from then on). `text(i)` gives the i-th document's text, or
        (text, input file, line), or None (then it is not offered); it is called only for the
        documents that join."""
        candidates = np.flatnonzero(keys <= np.uint64(min(self.bound, (1 << 64) - 1)))
        while len(candidates):
            chosen, joining = self._joining(keys[candidates])
            texts = [text(i) for i in candidates[joining].tolist()]
            missing = [j for j, item in zip(joining.tolist(), texts, strict=True) if item is None]
            if not missing:
                self._join(
                    chosen, keys[candidates[joining]].tolist(), positions[candidates[joining]].tolist(), texts
                )
                return
            candidates = np.delete(candidates, missing)  # not offered after all: decide again

    def _joining(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The member keys after offering `keys`, and which of them join (indexes, in order)."""
        chosen = np.unique(np.concatenate([self._keys, keys]))[: self.capacity]
        inside = np.flatnonzero(np.isin(keys, chosen))
        order = inside[np.argsort(keys[inside], kind="stable")]  # by key, then input order
        grouped = keys[order]
        starts = np.r_[True, grouped[1:] != grouped[:-1]] if len(grouped) else np.empty(0, dtype=bool)
        group = np.cumsum(starts) - 1
        rank = np.arange(len(grouped)) - np.flatnonzero(starts)[group]
        have = np.array([len(self.members.get(k, ())) for k in grouped[starts].tolist()], dtype=np.int64)
        return chosen, np.sort(order[rank < (self.per_key - have)[group]])

    def _join(self, chosen: np.ndarray, keys: list[int], positions: list[int], texts: list) -> None:
        if len(chosen) >= self.capacity:
            for key in self._keys[self._keys > chosen[-1]].tolist():  # evicted: above the new bound
                self._evict(key)
        for key, position, item in zip(keys, positions, texts, strict=True):
            text, where = (item[0], item[1:]) if isinstance(item, tuple) else (item, None)
            self.members.setdefault(key, []).append((position, text))
            self._key_of[position] = key
            self._where_of(position, where)
        self._keys = chosen

    def _where_of(self, position: int, where: tuple[str, int] | None) -> None:
        if where is not None:
            self.where[position] = where

    def _evict(self, key: int) -> None:
        for position, _ in self.members.pop(key):
            del self._key_of[position]
            self.removed.pop(position, None)
            self.where.pop(position, None)

    def record_all(self, positions: np.ndarray, matches: np.ndarray, estimates: np.ndarray) -> None:
        """`record` for each near-duplicate of a batch. Only members are recorded, and they are few
        (at most `capacity * per_key`): they are found by a search, not a loop over the batch."""
        if not self._key_of:
            return
        members = np.sort(np.fromiter(self._key_of, dtype=np.int64, count=len(self._key_of)))
        hits = np.flatnonzero(sorted_contains(members, positions.astype(np.int64, copy=False)))
        for position, match, estimate in zip(
            positions[hits].tolist(), matches[hits].tolist(), estimates[hits].tolist(), strict=True
        ):
            self.removed[position] = (match, estimate)

    def record(self, position: int, match: int, estimate: float) -> None:
        if position in self._key_of:
            self.removed[position] = (match, estimate)

    def _document(self, position: int, text: str) -> dict:
        """A document of the report: its input file and line (1-based; a JSON list's item
        number) when known, its position among the documents that reached near-dedup, its text."""
        where = self.where.get(position)
        place = {"file": where[0], "line": where[1]} if where is not None else {}
        return {**place, "position": position, "text": text}

    def texts(self) -> list[tuple[int, int, str]]:
        """(key, position, text) of every member, by key then position."""
        return [(key, pos, text) for key in sorted(self.members) for pos, text in self.members[key]]

    def pairs(self, ngram: int, limit: int = 100) -> list[dict]:
        """Up to `limit` removed members with their (member) match, exact Jaccard computed."""
        text_of = {pos: text for _, pos, text in self.texts()}
        out = []
        for _, position, text in self.texts():
            if position not in self.removed:
                continue
            match, estimate = self.removed[position]
            if match not in text_of:
                continue
            kept = text_of[match]
            out.append({
                "kept": self._document(match, kept),
                "removed": self._document(position, text),
                "estimated_jaccard": round(estimate, 4),
                "jaccard": round(jaccard(kept, text, ngram), 4),
            })  # fmt: skip
            if len(out) == limit:
                break
        return out
