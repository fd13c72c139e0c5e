"""Which documents a conversion keeps: the main process's decisions on each worker batch, in input order.

For every row of a `TokenizedBatch` (a cleaned text), in order:

  0. too short for --min-chars ("too_short_chars"): counted so even when it repeats an earlier
     document, and left out of the exact-duplicate set (the first rule that drops it counts);
  1. exact duplicate: the same digest as an earlier document ("duplicate"), unless the main
     process already de-duplicated the texts before sending them;
  2. another quality filter's reason, found by the worker (convert/quality.py);
  3. near duplicate of an earlier document ("near_duplicate", convert/near_dedup.py);
  4. otherwise kept, with its split.

Each drop is counted by reason in `cleaner.drops`, and for the filters and near duplicates its
tokens too (`dropped_tokens`). The decisions depend only on the sequence of rows, never on how
they were cut into batches, so a merge of multi-machine tasks (convert/tasks.py) feeds the
tasks' stored rows through the same `Selection` and keeps the same documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from convert.cleaning import Cleaner
from convert.near_dedup import KeyPartitions, NearDuplicates, PairSample, split_digests, split_keys
from convert.options import ShardOptions
from convert.quality import REASON_CODES, REASONS
from convert.worker import DIGEST_BYTES, TokenizedBatch

NEAR_DUPLICATE = "near_duplicate"
_TOO_SHORT = REASON_CODES["too_short_chars"]


class Doc(NamedTuple):
    """One kept document on its way into a chunk: its tokens end with EOS (BOS first if asked)."""

    digest: bytes
    size: int  # characters of cleaned text (token count for imported token files)
    tokens: np.ndarray
    split: str


def in_val(digests: bytes, val_fraction: float) -> np.ndarray:
    """The split rule, for documents given by their concatenated digests: True for val.

    A document is in val when its digest's upper 8 bytes, as a fraction of 2**64, are below
    `val_fraction`: stable across runs, machines and worker counts.
    """
    upper = np.frombuffer(digests, dtype="<u8")[1::2]
    return upper / 2.0**64 < val_fraction


@dataclass
class Selected:
    """One batch's decisions: the rows that reached near-duplicate removal (`indexed`), which of
    them are near-duplicates (`match` >= 0), and the filtered rows (first seen, not indexed)."""

    batch: TokenizedBatch
    indexed: np.ndarray  # row numbers, in order
    match: np.ndarray  # per indexed row: position of its earlier near-duplicate, -1 for none
    filtered: np.ndarray  # row numbers dropped by a quality filter (not exact duplicates)
    first_position: int  # position (in the near-duplicate index) of the first indexed row

    def documents(self, val_fraction: float) -> Iterator[Doc]:
        """The kept documents, in order, with their split. A val document's tokens are a copy:
        val chunks fill slowly, and a view would keep the whole batch's array in memory."""
        batch = self.batch
        passing = np.flatnonzero(batch.passing())
        ends = np.cumsum(batch.lengths[passing])
        start_of = dict(zip(passing.tolist(), (ends - batch.lengths[passing]).tolist(), strict=True))
        kept = self.indexed[self.match < 0]
        digests = [batch.digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in kept.tolist()]
        is_val = in_val(b"".join(digests), val_fraction).tolist() if digests else []
        lengths, chars = batch.lengths.tolist(), batch.chars.tolist()
        for row, digest, val in zip(kept.tolist(), digests, is_val, strict=True):
            start = start_of[row]
            piece = batch.tokens[start : start + lengths[row]]
            yield Doc(digest, chars[row], piece.copy() if val else piece, "val" if val else "train")


class Selection:
    """The decisions of one conversion (module docstring); `decide_near=False` (a multi-machine
    task) only counts positions and samples pairs, and leaves near duplicates to the merge."""

    def __init__(self, options: ShardOptions, cleaner: Cleaner, *, decide_near: bool = True,
                 sample: PairSample | None = None) -> None:  # fmt: skip
        self.options, self.cleaner = options, cleaner
        cleaner.filtered_below = options.filters.min_chars or 0  # too short before duplicate
        near = options.near_dedup
        parts = options.index_processes
        # With many workers the exact and near-duplicate state lives in index processes.
        self.partitions = (
            KeyPartitions(parts, near)
            if decide_near and parts > 1 and (cleaner.dedup or near is not None)
            else None
        )
        self.near = NearDuplicates(near, self.partitions) if near is not None and decide_near else None
        self.sample = sample if sample is not None else (PairSample() if near is not None else None)
        self.dropped_tokens: dict[str, int] = {}
        self.positions = 0  # documents indexed so far (positions in the near-duplicate index)

    def select(self, batch: TokenizedBatch, text: Callable[[int], str | None], *, deduped: bool) -> Selected:
        """Decide a batch's rows in order. `text(row)` gives a row's cleaned text for the pair
        sample (rarely called), or (text, input file, line), or None; `deduped`: exact duplicates were removed before the workers."""
        check = self.cleaner.dedup and not deduped
        # Every row at once: the exact-duplicate check (in order, counted as "duplicate"), then
        # the filters' reasons among the first-seen rows, counted by reason with their tokens.
        reasons = batch.reasons.astype(np.int64) if batch.reasons is not None else None
        short = reasons == _TOO_SHORT if reasons is not None else None  # dropped as too short first
        if check and self.partitions is not None:
            fresh = self._first_seen_in_partitions(batch, short)
        elif check:
            fresh = self.cleaner.first_seen_all(batch.digests, short)
        else:
            fresh = np.ones(len(batch), dtype=bool)
        if reasons is not None:
            rows = np.flatnonzero(fresh & (reasons == 0))
            filtered = np.flatnonzero(fresh & (reasons != 0))
            codes = reasons[filtered]
            counts = np.bincount(codes, minlength=len(REASONS) + 1).tolist()
            tokens = np.bincount(codes, weights=batch.lengths[filtered], minlength=len(REASONS) + 1).tolist()
            for code in np.flatnonzero(counts).tolist():
                self._drop(REASONS[code - 1], int(tokens[code]), counts[code])
        else:
            rows, filtered = np.flatnonzero(fresh), np.empty(0, dtype=np.int64)
        first = self.positions
        self.positions += len(rows)
        match = np.full(len(rows), -1, dtype=np.int64)
        if batch.keys is not None and len(rows):
            # keys and sketches are there for passing rows only: their index among those
            among_passing = (np.cumsum(batch.passing()) - 1)[rows]
            sketches = batch.sketches[among_passing]
            offered = self._offer(batch.keys[among_passing, 0], rows, first, text)
            if self.near is not None:
                if self.near.partitions is not None:
                    parts = batch.key_parts or split_keys(batch.keys, self.partitions.parts)
                    document_of = np.full(len(batch.keys), -1, dtype=np.int64)
                    document_of[among_passing] = np.arange(len(rows))
                    match, estimate = self.near.add(None, sketches, (parts, document_of))
                else:
                    match, estimate = self.near.add(batch.keys[among_passing], sketches)
                near = np.flatnonzero(match >= 0)
                if len(near):
                    self._drop(NEAR_DUPLICATE, int(batch.lengths[rows[near]].sum()), len(near))
                if self.sample is not None:  # only a document offered to the sample can be a member
                    for i in near[offered[near]].tolist():
                        self.sample.record(first + i, int(match[i]), float(estimate[i]))
        return Selected(batch, rows, match, filtered, first)

    def _first_seen_in_partitions(self, batch: TokenizedBatch, short: np.ndarray | None) -> np.ndarray:
        parts = batch.digest_parts
        if parts is None:
            rows = np.flatnonzero(~short) if short is not None else np.arange(len(batch))
            parts = split_digests(batch.digests, rows, self.partitions.parts)
        fresh = self.partitions.first_seen(parts, len(batch))
        duplicates = int(len(batch) - fresh.sum())
        if duplicates:
            self.cleaner.drops.add("duplicate", duplicates)
        return fresh

    def close(self) -> None:
        """Stop the index processes, if there are any."""
        if self.partitions is not None:
            self.partitions.close()

    def _offer(self, first_keys: np.ndarray, rows: np.ndarray, first: int, text) -> np.ndarray:
        """Offer the rows whose first key may join the pair sample; returns which were offered."""
        if self.sample is None:
            return np.zeros(len(rows), dtype=bool)
        offered = first_keys <= np.uint64(min(self.sample.bound, (1 << 64) - 1))
        for i in np.flatnonzero(offered).tolist():
            cleaned = text(int(rows[i]))
            if isinstance(cleaned, tuple):  # (text, input file, line)
                self.sample.offer(int(first_keys[i]), first + i, cleaned[0], cleaned[1:])
            elif cleaned is not None:
                self.sample.offer(int(first_keys[i]), first + i, cleaned)
        return offered

    def _drop(self, reason: str, tokens: int, count: int = 1) -> None:
        self.cleaner.drops.add(reason, count)
        self.dropped_tokens[reason] = self.dropped_tokens.get(reason, 0) + tokens
