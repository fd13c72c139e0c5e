"""What runs in a worker process: clean, digest, filter, sign and tokenize a batch of texts; pack
and write a chunk of tokenized documents as one part of a split.

A worker's state lives in this module's globals, set once by `init_worker` (the pool's
initializer): the options, the output store, the tokenizer (`shards.tokenizer`) and a cleaner that does
not de-duplicate (the main process does that, in input order). When the main process writes
parts itself it calls `init_worker` without a tokenizer, before the workers are forked; they
replace the state with their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convert.dedup.index_processes import partition
from convert.dedup.minhash import signatures
from convert.filters.cleaning import Cleaner, DropCounts
from convert.filters.quality import REASON_CODES, filter_reasons, utf32
from convert.records import ChunkTokens, PartResult, TextBatch, TokenizedBatch
from convert.run.options import ShardOptions
from convert.tokens.packing import Packer, concat_documents, drop_short_documents
from shards.tokenizer import Tokenizer
from shards.writer import ShardWriter, index_entries_text, prefixed_entries
from storage import Store, open_store

_TOO_SHORT = REASON_CODES["too_short_chars"]
# Texts are filtered, signed and tokenized in runs of about this many characters, whatever the
# batch (a range of several MB with many index processes): numpy's arrays for them (code points,
# shingle hashes) then stay in the CPU's cache, which keeps a worker's time per document the same.
SUB_BATCH_CHARS = 1 << 18


@dataclass
class WorkerState:
    options: ShardOptions
    store: Store
    tokenizer: Tokenizer | None = None  # in a process that tokenizes
    cleaner: Cleaner | None = None  # cleans without de-duplicating; None: texts come cleaned


_state: WorkerState


def init_worker(
    options: ShardOptions,
    out: str,
    tokenizer_files: dict[str, bytes] | None = None,
    cleaner: Cleaner | None = None,
) -> None:
    global _state
    tokenizer = Tokenizer.from_files(tokenizer_files) if tokenizer_files is not None else None
    _state = WorkerState(options, open_store(out), tokenizer, cleaner)


def current_cleaner() -> Cleaner | None:
    """This process's cleaner (`init_worker`): the workers' cleans without de-duplicating."""
    return _state.cleaner


def current_store() -> Store:
    """This process's output store (`init_worker`)."""
    return _state.store


def clean_batch(texts: list[str], cleaner: Cleaner) -> tuple[TextBatch, np.ndarray]:
    """The texts that survive `cleaner` (drops counted in `cleaner.drops`), with their digests,
    and the index in `texts` of each."""
    kept, sources = [], []
    for i, text in enumerate(texts):
        result = cleaner.clean_with_digest(text)
        if result is not None:
            kept.append(result)
            sources.append(i)
    batch = TextBatch(texts=[text for text, _ in kept], digests=b"".join(digest for _, digest in kept))
    return batch, np.array(sources, dtype=np.int64)


def tokenize_batch(batch: TextBatch) -> TokenizedBatch:
    """Clean the texts (unless done already), apply the quality filters, compute near-duplicate
    signatures, and tokenize: each document ended by EOS, the passing ones into one array."""
    drops: dict[str, int] = {}
    sources = None
    if batch.digests is None:
        _state.cleaner.drops = DropCounts()
        batch, sources = clean_batch(batch.texts, _state.cleaner)
        drops = _state.cleaner.drops.as_dict()
    options = _state.options
    texts = batch.texts
    parts = [_filter_sign_tokenize(texts[lo:hi], options) for lo, hi in _spans(texts, SUB_BATCH_CHARS)]
    chars, reasons, lengths, tokens = (np.concatenate([part[i] for part in parts]) for i in range(4))
    keys = sketches = None
    if options.near_dedup is not None:
        keys, sketches = (np.concatenate([part[i] for part in parts]) for i in (4, 5))
    shares = None
    if options.index_processes > 1:
        # The index processes de-duplicate all but the too-short rows (counted as such), unless
        # the main process cleaned and de-duplicated the texts already.
        exact = sources is not None
        rows = np.flatnonzero(reasons != _TOO_SHORT) if exact else None
        shares = partition(batch.digests if exact else None, rows, keys, options.index_processes)
    all_pass = not reasons.any()
    return TokenizedBatch(
        digests=batch.digests, chars=chars, lengths=lengths, tokens=tokens, drops=drops,
        reasons=None if all_pass else reasons, keys=keys, sketches=sketches, sources=sources, index_shares=shares,
    )  # fmt: skip


def _spans(texts: list[str], chars: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive runs of `texts` of about `chars` characters (one, if empty)."""
    spans, start, size = [], 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= chars:
            spans.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(texts) or not spans:
        spans.append((start, len(texts)))
    return spans


def _filter_sign_tokenize(texts: list[str], options: ShardOptions) -> tuple:
    """(characters, filter reasons, token counts, the passing texts' tokens, band keys, sketches)
    of some cleaned texts."""
    chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    codes = None
    if options.filters.needs_classes or options.near_dedup is not None:
        codes, chars = utf32(texts)
    reasons = filter_reasons(texts, codes, chars, options.filters)
    passing = reasons == 0
    # One core per worker (N workers = N cores), the tokenizer library's batched call.
    # Filtered texts are tokenized too, for the summary's count of the tokens each filter removed.
    ids = _state.tokenizer.encode_batch(texts, add_bos=options.add_bos, add_eos=True, num_threads=1)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    all_pass = bool(passing.all())
    tokens, _ = concat_documents(ids if all_pass else [ids[i] for i in np.flatnonzero(passing).tolist()])
    keys = sketches = None
    if options.near_dedup is not None:
        if not all_pass:
            codes = codes[np.repeat(passing, chars)]
        keys, sketches = signatures(codes, chars[passing], options.near_dedup)
    return chars, reasons, lengths, tokens, keys, sketches


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
    result = PartResult(
        split=chunk.split, index=chunk.index, shards=shards, samples=writer.samples, documents=kept,
        too_short=too_short, tail=packer.tail,
        index_text=index_entries_text(prefixed_entries(shards, part_name(chunk.index))),
    )  # fmt: skip
    store.write_json(f"{folder}/part.json", result.marker(chunk.fingerprint))  # last: the part is done
    return result
