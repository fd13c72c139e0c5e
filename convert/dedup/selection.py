"""Which documents a conversion keeps: the main process's decisions on each worker batch, in input order.

For every row of a `TokenizedBatch` (a cleaned text), in order:

  0. too short for --min-chars ("too_short_chars"): counted so even when it repeats an earlier
     document, and left out of the exact-duplicate set (the first rule that drops it counts);
  1. exact duplicate: the same digest as an earlier document ("duplicate"), unless the main
     process already de-duplicated the texts before sending them;
  2. another quality filter's reason, found by the worker (convert/filters/quality.py);
  3. near duplicate of an earlier document ("near_duplicate", convert/dedup/near_dedup.py);
  4. otherwise kept, with its split.

Each drop is counted by reason in `cleaner.drops`, and for the filters and near duplicates its
tokens too (`dropped_tokens`). The decisions depend only on the sequence of rows, never on how
they were cut into batches. A multi-machine task runs a `Selection` without near duplicates
(exact duplicates within the task, filter counts); the merge (convert/run/merge.py) decides the
rest by the same rules from sorted runs, partition by partition (convert/dedup/stages.py), and
counts in this order too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

import numpy as np

from convert.dedup.index_processes import Answer, IndexProcesses, partition, pipelined
from convert.dedup.near_dedup import NearDuplicates, PairSample
from convert.dedup.options import NearDedupOptions
from convert.dedup.pairs import NearDecisions
from convert.filters.cleaning import Cleaner
from convert.filters.quality import REASON_CODES, REASONS, QualityFilters
from convert.records import Selected, TokenizedBatch, ToSelect

NEAR_DUPLICATE = "near_duplicate"
_TOO_SHORT = REASON_CODES["too_short_chars"]


class _Rows(NamedTuple):
    """A batch's rows decided up to near duplicates (`Selection._decide`)."""

    indexed: np.ndarray  # the rows that reach near-duplicate removal, in order
    filtered: np.ndarray  # the rows a quality filter drops (first seen)
    first_position: int  # the first indexed row's position in the near-duplicate index


class SelectionSettings(Protocol):
    """What a `Selection` reads of a conversion's options: `convert.run.options.ShardOptions`,
    resolved, has these fields (the run sits above this stage, so the fields are named here)."""

    @property
    def filters(self) -> QualityFilters: ...

    @property
    def near_dedup(self) -> NearDedupOptions | None: ...

    @property
    def index_processes(self) -> int: ...


class Selection:
    """The decisions of one conversion (module docstring); `decide_near=False` (a multi-machine
    task) only counts positions and samples pairs, and leaves near duplicates to the merge.

    The duplicate state lives in this process, or, with more than one `index_processes` (many
    workers), in index processes (convert/dedup/index_processes.py) that decide several batches at
    once while this process goes on: `select_all` gives the same decisions either way."""

    def __init__(self, options: SelectionSettings, cleaner: Cleaner, *, decide_near: bool = True,
                 sample: PairSample | None = None) -> None:  # fmt: skip
        self.cleaner = cleaner
        cleaner.filtered_below = options.filters.min_chars or 0  # too short before duplicate
        near = options.near_dedup if decide_near else None
        parts = options.index_processes
        self.processes = (
            IndexProcesses(parts, near)
            if decide_near and parts > 1 and (cleaner.dedup or near is not None)
            else None
        )
        self.near = NearDuplicates(near) if near is not None and self.processes is None else None
        self.near_in_processes = near is not None and self.processes is not None
        self.decisions = NearDecisions(near.rule) if near is not None else None  # by position
        self.sample = (
            sample if sample is not None else (PairSample() if options.near_dedup is not None else None)
        )
        self.dropped_tokens: dict[str, int] = {}
        self.positions = 0  # documents indexed so far (positions in the near-duplicate index)

    @property
    def index_bytes(self) -> int:
        """The near-duplicate index's bytes (band index and sketches; known at `close` with
        index processes)."""
        if self.processes is not None:
            return self.processes.nbytes
        return self.near.nbytes if self.near is not None else 0

    @property
    def near_through_removed(self) -> int:
        """Removed documents whose every near pair is with a removed one (`NearDecisions`)."""
        return self.decisions.through_removed if self.decisions is not None else 0

    @property
    def near_index_bytes(self) -> int | None:
        """`index_bytes` when this selection decides near duplicates, else None."""
        return self.index_bytes if self.near is not None or self.near_in_processes else None

    def select(self, batch: TokenizedBatch, text: Callable[[int], str | None], *, deduped: bool) -> Selected:
        """One batch decided at once (`select_all`)."""
        [selected] = self.select_all([ToSelect(batch=batch, text=text, deduped=deduped)])
        return selected

    def select_all(self, items: Iterable[ToSelect]) -> Iterator[Selected]:
        """Decide each item's rows in order; yields each batch's `Selected`, with the item's payload,
        in input order."""
        if self.processes is None:
            for item in items:
                yield self._select_here(item)
            return
        yield from pipelined(self.processes, items, self._shares, self._decided, self._finished)

    def _select_here(self, item: ToSelect) -> Selected:
        batch = item.batch
        fresh = np.ones(len(batch), dtype=bool)
        if self.cleaner.dedup and not item.deduped:
            fresh = self.cleaner.first_seen_all(batch.digests, self._too_short(batch))
        rows = self._decide(batch, fresh)
        match, estimate = np.full(len(rows.indexed), -1, dtype=np.int64), None
        if self.near is not None and batch.keys is not None and len(rows.indexed):
            among_passing = self._among_passing(batch, rows.indexed)
            pairs = self.near.add_pairs(batch.keys[among_passing], batch.sketches[among_passing])
            match, estimate = self.decisions.decide(rows.first_position, len(rows.indexed), *pairs)
        return self._finish(item, rows, match, estimate)

    # --- through the index processes: `pipelined`'s three steps ---------------------------------

    def _shares(self, item: ToSelect) -> list[bytes]:
        batch = item.batch
        if batch.index_shares is not None:  # split by the worker; not kept while the batch waits
            shares, batch.index_shares = batch.index_shares, None
            return shares
        short = self._too_short(batch)
        exact = self.cleaner.dedup and not item.deduped
        rows = (np.flatnonzero(~short) if short is not None else np.arange(len(batch))) if exact else None
        keys = batch.keys if self.near_in_processes else None
        return partition(batch.digests if exact else None, rows, keys, self.processes.parts)

    def _decided(self, item: ToSelect, duplicates: np.ndarray) -> tuple[_Rows, np.ndarray | None]:
        """The batch's exact duplicates are known: decide up to near duplicates; with them, the
        mask of its indexed rows among the passing ones, their sketches appended for the processes."""
        batch = item.batch
        fresh = np.ones(len(batch), dtype=bool)
        if self.cleaner.dedup and not item.deduped and len(duplicates):
            fresh[duplicates] = False
            self.cleaner.drops.add("duplicate", len(duplicates))
        rows = self._decide(batch, fresh)
        if not self.near_in_processes:
            return rows, None
        passing = int(batch.passing().sum())
        mask = np.zeros(passing, dtype=bool)
        if len(rows.indexed):
            among_passing = self._among_passing(batch, rows.indexed)
            mask[among_passing] = True
            self.processes.append_sketches(
                batch.sketches if len(rows.indexed) == passing else batch.sketches[among_passing]
            )
        batch.sketches = None  # with the index processes now; not kept while the batch waits
        return rows, mask

    def _finished(self, item: ToSelect, rows: _Rows, answers: list[Answer] | None) -> Selected:
        """The batch's near duplicates are known (`answers`, one per index process, or None)."""
        count = len(rows.indexed)
        match, estimate = np.full(count, -1, dtype=np.int64), np.zeros(count)
        if answers and self.decisions is not None:  # every process's close pairs, decided in order
            first = rows.first_position
            documents = np.concatenate([answer.documents for answer in answers]) + first
            matches = np.concatenate([answer.matches for answer in answers])
            estimates = np.concatenate([answer.estimates for answer in answers])
            match, estimate = self.decisions.decide(first, count, documents, matches, estimates)
        return self._finish(item, rows, match, estimate)

    # --- the steps ---------------------------------------------------------------------------------

    @staticmethod
    def _too_short(batch: TokenizedBatch) -> np.ndarray | None:
        """Rows too short for --min-chars: dropped as such, even when they repeat an earlier row."""
        return batch.reasons == _TOO_SHORT if batch.reasons is not None else None

    @staticmethod
    def _among_passing(batch: TokenizedBatch, rows: np.ndarray) -> np.ndarray:
        """Keys and sketches are there for the passing rows only: each row's index among those."""
        return rows if batch.reasons is None else (np.cumsum(batch.passing()) - 1)[rows]

    def _decide(self, batch: TokenizedBatch, fresh: np.ndarray) -> _Rows:
        """The first-seen rows' filter reasons counted (with their tokens); the rows that reach
        near-dedup, the filtered rows, and the first one's position."""
        if batch.reasons is not None:
            reasons = batch.reasons.astype(np.int64)
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
        return _Rows(indexed=rows, filtered=filtered, first_position=first)

    def _finish(
        self, item: ToSelect, rows: _Rows, match: np.ndarray, estimate: np.ndarray | None
    ) -> Selected:
        """Near duplicates counted; the rows offered to the pair sample, its removed members recorded."""
        batch, indexed, first = item.batch, rows.indexed, rows.first_position
        if batch.keys is not None and len(indexed):
            if self.sample is not None:
                first_keys = batch.keys[self._among_passing(batch, indexed), 0]
                positions = first + np.arange(len(indexed))
                self.sample.offer_all(first_keys, positions, lambda i: item.text(int(indexed[i])))
            near = np.flatnonzero(match >= 0)
            if len(near):
                self._drop(NEAR_DUPLICATE, int(batch.lengths[indexed[near]].sum()), len(near))
                if self.sample is not None:
                    self.sample.record_all(first + near, match[near], estimate[near])
        return Selected(
            batch=batch, indexed=indexed, match=match, filtered=rows.filtered, first_position=first,
            payload=item.payload,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the index processes, if there are any."""
        if self.processes is not None:
            self.processes.close()

    def _drop(self, reason: str, tokens: int, count: int = 1) -> None:
        self.cleaner.drops.add(reason, count)
        self.dropped_tokens[reason] = self.dropped_tokens.get(reason, 0) + tokens
