"""What runs in a worker process: clean, digest and tokenize a batch of texts; pack and write a
chunk of tokenized documents as one part of a split.

A worker's state lives in this module's globals, set once by `init_worker` (the pool's
initializer): the options, the output store, the SentencePiece model and a cleaner that does
not de-duplicate (the main process does that, in input order). When the main process writes
parts itself it calls `init_worker` without a tokenizer, before the workers are forked; they
replace the state with their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convert.cleaning import Cleaner, DropCounts
from convert.options import ShardOptions
from convert.packing import Packer, concat_documents, drop_short_documents
from convert.tokenizer import load_processor
from convert.writer import ShardWriter
from storage import Store, open_store

DIGEST_BYTES = 16


@dataclass
class WorkerState:
    options: ShardOptions
    store: Store
    processor: object = None  # a SentencePieceProcessor, in a process that tokenizes
    cleaner: Cleaner | None = None  # cleans without de-duplicating; None: texts come cleaned


_state: WorkerState


def init_worker(
    options: ShardOptions, out: str, model_bytes: bytes | None = None, cleaner: Cleaner | None = None
) -> None:
    global _state
    processor = load_processor(model_bytes) if model_bytes is not None else None
    _state = WorkerState(options, open_store(out), processor, cleaner)


@dataclass
class TextBatch:
    """Texts for a worker to tokenize. With digests, they are cleaned and de-duplicated already."""

    texts: list[str]
    digests: bytes | None = None


def clean_batch(texts: list[str], cleaner: Cleaner) -> TextBatch:
    """The texts that survive `cleaner` (drops counted in `cleaner.drops`), with their digests."""
    kept = [k for k in map(cleaner.clean_with_digest, texts) if k is not None]
    return TextBatch([text for text, _ in kept], b"".join(digest for _, digest in kept))


@dataclass
class TokenizedBatch:
    """What a worker returns for a batch of texts: the documents that survived cleaning."""

    digests: bytes  # DIGEST_BYTES per document
    chars: np.ndarray  # cleaned length in characters, per document
    lengths: np.ndarray  # tokens per document, EOS (and BOS) included
    tokens: np.ndarray  # all documents' tokens, one after another
    drops: dict[str, int]


def tokenize_batch(batch: TextBatch) -> TokenizedBatch:
    """Clean the texts (unless done already), then tokenize them into one array, each document
    ended by EOS."""
    drops: dict[str, int] = {}
    if batch.digests is None:
        _state.cleaner.drops = DropCounts()
        batch = clean_batch(batch.texts, _state.cleaner)
        drops = _state.cleaner.drops.as_dict()
    # One core per worker (N workers = N cores); SentencePiece adds EOS (and BOS) in C++.
    add_bos = _state.options.add_bos
    ids = _state.processor.encode(batch.texts, add_bos=add_bos, add_eos=True, num_threads=1)
    tokens, lengths = concat_documents(ids)
    chars = np.fromiter(map(len, batch.texts), dtype=np.int64, count=len(batch.texts))
    return TokenizedBatch(batch.digests, chars, lengths, tokens, drops)


@dataclass
class ChunkTokens:
    """A chunk as a worker gets it: one token array, the documents' lengths, its fingerprint."""

    split: str
    index: int
    tokens: np.ndarray
    lengths: np.ndarray
    fingerprint: str


@dataclass
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
        tail = np.array(marker["tail"], dtype=np.uint32)
        return cls(
            split, index, marker["shards"], marker["samples"], marker["documents"], marker["too_short"],
            tail, reused=True,
        )  # fmt: skip


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def process_chunk(chunk: ChunkTokens) -> PartResult:
    """Drop too-short documents, pack the chunk into rows, write them as a part; return the tail."""
    options, store = _state.options, _state.store
    folder = f"{chunk.split}/{part_name(chunk.index)}"
    store.delete_tree(folder)  # leftovers of a killed run must not mix with the new shards
    tokens, kept = drop_short_documents(chunk.tokens, chunk.lengths, options.min_tokens)
    writer = ShardWriter(
        store, folder, seq_len=options.seq_len, dtype=options.dtype, size_limit=options.size_limit
    )
    packer = Packer(options.seq_len)
    writer.write(packer.add(tokens))
    shards = writer.finish()
    too_short = len(chunk.lengths) - kept
    result = PartResult(chunk.split, chunk.index, shards, writer.samples, kept, too_short, packer.tail)
    store.write_json(f"{folder}/part.json", result.marker(chunk.fingerprint))  # last: the part is done
    return result
