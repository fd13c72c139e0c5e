"""What the stages of a conversion hand each other: the data model at the bottom of convert/.

In the order a document meets them (convert/run/conversion.py draws the flow):

  TextBatch       texts on their way to a worker: raw, or cleaned and de-duplicated with their digests
  TokenizedBatch  a worker's answer for a batch: per row its digest, size, filter reason, token count,
                  and for the passing rows their tokens and near-duplicate signatures
  ToSelect        a tokenized batch handed to the selection (convert/dedup/selection.py), with the
                  caller's payload
  Selected        the selection's decisions on one batch, the payload handed back; its kept rows as
                  `Doc`s, each with its split (`in_val`)
  ChunkTokens     kept documents of one split as a worker packs them into a part
  PartResult      a part written (its part.json marker), or found written by an earlier run

A document's identity is its DIGEST_BYTES-byte digest (`convert.filters.cleaning.text_digest`),
and its split follows from the digest alone (`in_val`). Nothing here imports another stage: every
stage imports this module, never a stage's module for its data types. The dataclasses are built
by keyword only; `Doc` is a NamedTuple (one per document: cheaper), built by keyword too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

DIGEST_BYTES = 16  # a document's identity: XXH3-128 of its cleaned text (or of its tokens)


@dataclass(kw_only=True)
class TextBatch:
    """Texts for a worker to tokenize. With digests, they are cleaned and de-duplicated already."""

    texts: list[str]
    digests: bytes | None = None


@dataclass(kw_only=True)
class TokenizedBatch:
    """What a worker returns for a batch of texts: one row per text that survived cleaning.

    Every row has its digest, size and token count; `reasons` says which quality filter drops it
    (0: none). Only the rows that pass (reason 0) have their tokens here, and their band keys and
    sketches when near-duplicates are removed. Rows of a multi-machine task's pieces are the same
    (convert/run/tasks.py), so a merge replays them through the same decisions.
    """

    digests: bytes  # DIGEST_BYTES per row
    chars: np.ndarray  # cleaned length in characters, per row
    lengths: np.ndarray  # tokens per row, EOS (and BOS) included, whether it passes or not
    tokens: np.ndarray  # the passing rows' tokens, one after another
    drops: dict[str, int]  # cleaning's drops in the worker ("empty")
    reasons: np.ndarray | None = None  # int8 per row (convert.filters.quality.REASONS); None: all pass
    keys: np.ndarray | None = None  # passing rows x bands, uint64
    sketches: np.ndarray | None = None  # passing rows x bins, uint8
    sources: np.ndarray | None = None  # index of each row's text in the batch sent (cleaned here)
    index_shares: list[bytes] | None = None  # the digests and keys split for the index processes

    def __len__(self) -> int:
        return len(self.chars)

    def passing(self) -> np.ndarray:
        return np.ones(len(self), dtype=bool) if self.reasons is None else self.reasons == 0


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


@dataclass(frozen=True, kw_only=True)
class ToSelect:
    """A tokenized batch on its way into the selection (`Selection.select_all`), with what the
    selection hands back with its decisions."""

    batch: TokenizedBatch
    # A row's cleaned text for the near-duplicate pair sample (rarely called): the text, or
    # (text, input file, line), or None when it is not known.
    text: Callable[[int], str | tuple[str, str, int] | None]
    deduped: bool  # exact duplicates were removed before the workers (this process cleaned the texts)
    payload: object = None  # the caller's, handed back on the batch's `Selected`


@dataclass(kw_only=True)
class Selected:
    """One batch's decisions: the rows that reached near-duplicate removal (`indexed`), which of
    them are near-duplicates (`match` >= 0), and the filtered rows (first seen, not indexed)."""

    batch: TokenizedBatch
    indexed: np.ndarray  # row numbers, in order
    match: np.ndarray  # per indexed row: position of its earlier near-duplicate, -1 for none
    filtered: np.ndarray  # row numbers dropped by a quality filter (not exact duplicates)
    first_position: int  # position (in the near-duplicate index) of the first indexed row
    payload: object = None  # the `ToSelect`'s

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
            tokens = piece.copy() if val else piece
            yield Doc(digest=digest, size=chars[row], tokens=tokens, split="val" if val else "train")


@dataclass(kw_only=True)
class ChunkTokens:
    """A chunk as a worker gets it: one token array, the documents' lengths, its fingerprint."""

    split: str
    index: int
    tokens: np.ndarray
    lengths: np.ndarray
    fingerprint: str


class ChunkHead(Protocol):
    """What a chunk is, before its tokens are gathered (the run's spooled chunks, the merge's)."""

    split: str
    index: int
    fingerprint: str
    lengths: np.ndarray


def gathered(head: ChunkHead, pieces: list[np.ndarray], dtype: str | np.dtype) -> ChunkTokens:
    """The chunk `head` with its tokens: its documents' `pieces`, in order (one piece: as it is)."""
    tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    return ChunkTokens(
        split=head.split, index=head.index, tokens=tokens, lengths=head.lengths, fingerprint=head.fingerprint
    )


@dataclass(kw_only=True)
class PartResult:
    """A part written (or found written by an earlier run): its shards, counts and tail."""

    split: str
    index: int
    shards: list[dict]
    samples: int
    documents: int
    too_short: int
    tail: np.ndarray
    reused: bool = False
    # Its prefixed shard entries as index.json holds them (`shards.writer.index_entries_text`),
    # formatted where the part is written; empty for a part reused from part.json.
    index_text: str = ""

    def marker(self, fingerprint: str) -> dict:
        """part.json: written after the part's shards; a re-run reuses the part when it matches."""
        return {
            "fingerprint": fingerprint,
            "shards": self.shards,
            "samples": self.samples,
            "documents": self.documents,
            "too_short": self.too_short,
            "tail": self.tail.tolist(),
        }

    @classmethod
    def from_marker(cls, split: str, index: int, marker: dict) -> PartResult:
        return cls(
            split=split, index=index, shards=marker["shards"], samples=marker["samples"],
            documents=marker["documents"], too_short=marker["too_short"],
            tail=np.array(marker["tail"], dtype=np.uint32), reused=True,
        )  # fmt: skip
