"""One conversion, run by the main process: texts -> workers (clean, filter, sign, tokenize) ->
select, split, chunk -> workers (pack, write a part) -> meta, summary, index.

This module's loop, where the main process reads the documents and sends their texts, serves
the inputs that cannot be cut into byte ranges (S3, gzip, JSON lists, txt-blank, --strict) and
the multi-machine tasks; for local line files the workers read the inputs themselves
(convert/run/ranges.py) and only compact records reach the main process. Both give the same bytes.

    main process                                worker processes (N, `convert.run.worker`)
    read documents, cut into batches  --------> clean* and digest each text, quality filters,
                                                MinHash signature (band keys, sketch), tokenize
                                      <-------- digests, filter reasons, signatures, lengths,
                                                one token array per batch
    `Selection`, in input order: exact duplicates by digest, filter drops, near duplicates
    (band lookups and sketch checks, convert/dedup/near_dedup.py)
    (* here instead, de-duplicating before tokenizing, and ** too, when there are more CPUs than workers)
    split by digest (train/val), cut each split into chunks (boundaries independent of N)
                                      --------> drop too-short documents, pack into seq_len rows,**
                                                write the rows as MDS part-NNNNN/, done marker
                                      <-------- the chunk's tail (< seq_len tokens)
    pack the tails in chunk order into a final part (only the split's last partial row is lost)
    meta.json, near_duplicates.json, summary.json, then each split's merged index.json LAST

Where the work runs: with fewer workers than CPUs the main process has a core to spare: it
cleans, de-duplicates and sends only kept, cleaned texts, and packs and writes the parts itself
(the workers filter, sign and tokenize); otherwise the workers clean and write too, and a
duplicate is tokenized before the main process sees that it is one (a little waste on
duplicate-heavy corpora). Either way text crosses to a worker once, what comes back is compact
(16-byte digests, band keys and a 256-byte sketch per document, token arrays), and every drop
decision is global and in input order, so the kept documents do not depend on the worker count
or the placement. Chunk boundaries depend only on the kept documents, so the samples (and their
order) are identical for any worker count. Each part's `part.json` is written after its shards
and names the chunk's fingerprint; a re-run after a kill reads and tokenizes the input again (to
rebuild the de-duplication state and the chunks) but reuses the parts whose marker matches
instead of writing them again. Memory is bounded by a few batches and chunks in flight, plus
the de-duplication state (16-byte digests, and with near-dedup the index of
convert/dedup/near_dedup.py); when that state would pass `--memory-budget` the conversion runs
in two passes instead (convert/run/jobs.py). The parts' records (shard entries, tails) go to a
scratch file as they come back (`PartLog`).

A conversion can also be split over machines (convert/run/tasks.py): each task runs the same loop
over its share of the files up to the `Selection` and stores the selected rows; the merge
(convert/run/merge.py) decides the duplicates across tasks by partition and hands the kept
documents' chunks to `Conversion.run`'s part steps here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np
import xxhash

from convert.dedup.near_dedup import PairSample
from convert.dedup.selection import Selection
from convert.errors import ConvertError
from convert.executor import Executor, ordered, start_workers
from convert.filters.cleaning import Cleaner, text_digest
from convert.filters.quality import dominant_drop
from convert.records import (
    ChunkTokens,
    Doc,
    PartResult,
    Selected,
    TextBatch,
    TokenizedBatch,
    ToSelect,
    in_val,
)
from convert.run.options import ShardOptions
from convert.run.report import NearDedupSummary, SplitSummary, Summary, build_summary, print_summary
from convert.run.worker import clean_batch, init_worker, part_name, process_chunk, tokenize_batch
from convert.scratch import make_scratch
from convert.tokens.packing import TOKEN_DTYPE, Packer
from shards.meta import SPLITS, SplitMeta, now, write_meta
from shards.output import open_output, prepare_output
from shards.tokenizer import Tokenizer, TokenizerInfo
from shards.writer import ShardWriter, index_entries_text, prefixed_entries, write_index_json
from storage import Store

_PIPELINE_VERSION = "2"  # part in every chunk fingerprint: bump when packing/writing changes
BATCH_CHARS = 1 << 18  # texts per tokenizing task: amortises the hand-off, bounds the lists
NEAR_REPORT = "near_duplicates.json"  # a sample of removed pairs, beside summary.json


def digest_of(doc: str | np.ndarray) -> bytes:
    """A document's 16-byte identity: `text_digest` of a text, XXH3-128 of a token array's bytes."""
    return text_digest(doc) if isinstance(doc, str) else xxhash.xxh3_128_digest(doc.tobytes())


def split_of(digest: bytes, val_fraction: float) -> str:
    """train or val for one document (`in_val`)."""
    return "val" if in_val(digest, val_fraction)[0] else "train"


def batch_documents(batch: TokenizedBatch, val_fraction: float) -> Iterator[Doc]:
    """Every row of a tokenized batch as a kept document, in order, with its split."""
    rows = np.arange(len(batch))
    selected = Selected(
        batch=batch, indexed=rows, match=np.full(len(rows), -1), filtered=np.empty(0, dtype=np.int64),
        first_position=0,
    )  # fmt: skip
    return selected.documents(val_fraction)


def tokenize_in_workers(
    executor: Executor, texts: Iterable[str], *, selection: Selection, window: int, clean_here: bool,
    val_fraction: float,
) -> Iterator[Doc]:  # fmt: skip
    """The kept documents, tokenized, in input order, with their split; drops are counted in `selection`."""
    for selected in select_in_workers(
        executor, texts, selection=selection, window=window, clean_here=clean_here
    ):
        yield from selected.documents(val_fraction)


def select_in_workers(
    executor: Executor, texts: Iterable[str], *, selection: Selection, window: int, clean_here: bool
) -> Iterator[Selected]:
    """Each batch of texts cleaned, filtered, signed and tokenized by the workers, then decided by
    `selection`, in input order.

    Cleaning (Unicode normalisation is the costly part) runs in the workers, or here when
    `clean_here`: with fewer workers than cores this process has a core of its own, and
    cleaning here (with exact de-duplication) leaves the workers the rest. The texts sent stay
    here until their batch comes back, for the few that the near-duplicate pair sample keeps.
    """
    cleaner = selection.cleaner
    sent: deque[tuple[list[str], list]] = deque()

    def batches() -> Iterator[TextBatch]:
        for items in _batches(texts, BATCH_CHARS):
            texts_in = [item if isinstance(item, str) else item.text for item in items]
            if clean_here:
                batch, sources = clean_batch(texts_in, cleaner)
                places = [_place(items[i]) for i in sources.tolist()]
            else:
                batch, places = TextBatch(texts=texts_in), [_place(item) for item in items]
            sent.append((batch.texts, places))
            yield batch

    def tokenized() -> Iterator[ToSelect]:
        for batch in ordered(executor, tokenize_batch, batches(), window):
            texts_sent, places = sent.popleft()
            for reason, count in batch.drops.items():
                cleaner.drops.add(reason, count)
            if clean_here:
                text = partial(_sent, texts_sent, places)
            else:
                text = partial(_cleaned, cleaner, texts_sent, places, batch.sources)
            yield ToSelect(batch=batch, text=text, deduped=clean_here)

    yield from selection.select_all(tokenized())


def _place(item) -> tuple[str, int] | None:
    """A `readers.Document`'s file and line; None for a bare text."""
    return None if isinstance(item, str) else (item.source, item.line)


def _located(text: str, place: tuple[str, int] | None):
    return text if place is None else (text, *place)


def _sent(texts: list[str], places: list, row: int):
    return _located(texts[row], places[row])


def _cleaned(cleaner: Cleaner, texts: list[str], places: list, sources, row: int):
    source = int(sources[row])
    return _located(cleaner.normalize(texts[source]), places[source])


def _batches(texts: Iterable, batch_chars: int) -> Iterator[list]:
    """Texts (or `readers.Document`s) in batches of about `batch_chars` characters."""
    batch: list = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text if isinstance(text, str) else text.text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@dataclass
class Chunk:
    """A run of kept documents of one split, tokenized, on their way to becoming one part."""

    split: str
    index: int
    pieces: list[np.ndarray] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list, repr=False)
    size: int = 0  # characters (or tokens) of its documents

    def add(self, doc: Doc) -> None:
        self.pieces.append(doc.tokens)
        self.digests.append(doc.digest)
        self.size += doc.size

    def seal(self, options: ShardOptions, tokenizer: TokenizerInfo) -> ChunkTokens:
        """The chunk as a worker gets it, with its fingerprint (`chunk_fingerprint`)."""
        fingerprint = chunk_fingerprint(b"".join(self.digests), options, tokenizer)
        lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
        tokens = np.concatenate(self.pieces) if self.pieces else np.empty(0, dtype=TOKEN_DTYPE)
        return ChunkTokens(
            split=self.split, index=self.index, tokens=tokens, lengths=lengths, fingerprint=fingerprint
        )


@dataclass
class OpenChunk:
    """A chunk being filled with runs of documents (their lengths and digests), where a worker gets
    their tokens' whereabouts rather than the tokens (`ranges.RangeFeed`, the merge's ordered pass)."""

    index: int
    size: int = 0  # characters of its documents
    lengths: list[np.ndarray] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)

    def identity(self, options: ShardOptions, tokenizer: TokenizerInfo) -> tuple[str, np.ndarray]:
        """Its fingerprint (`chunk_fingerprint`) and its documents' lengths, in order."""
        fingerprint = chunk_fingerprint(b"".join(self.digests), options, tokenizer)
        lengths = np.concatenate(self.lengths) if self.lengths else np.empty(0, dtype=np.int64)
        return fingerprint, lengths


def chunk_fingerprint(digests: bytes, options: ShardOptions, tokenizer: TokenizerInfo) -> str:
    """A chunk's identity: its documents by digest (concatenated, in order), and what else shapes
    the part's bytes (an earlier run's part is reused only if they all match)."""
    bos_id = tokenizer.bos_id if options.add_bos else None
    shaping = (_PIPELINE_VERSION, tokenizer.sha256, options.seq_len, options.dtype,
               options.size_limit, bos_id, options.min_tokens)  # fmt: skip
    key = digests + "|".join(map(str, shaping)).encode()
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def chunk_documents(docs: Iterable[Doc], *, chunk_size: int) -> Iterator[Chunk]:
    """Route documents to their split; cut each split's stream into ~chunk_size chunks."""
    open_chunks = {split: Chunk(split=split, index=0) for split in SPLITS}
    for doc in docs:
        chunk = open_chunks[doc.split]
        chunk.add(doc)
        if chunk.size >= chunk_size:
            yield chunk
            open_chunks[chunk.split] = Chunk(split=chunk.split, index=chunk.index + 1)
    for chunk in open_chunks.values():
        if chunk.size:
            yield chunk


def reuse_part(
    store: Store, chunk: ChunkTokens, existing: dict[str, set[str]] | None = None
) -> PartResult | None:
    """The finished part of an earlier run for this exact chunk, if all its shards are stored.
    `existing`: each split's part folders when the run started (no read for a part not there)."""
    folder = f"{chunk.split}/{part_name(chunk.index)}"
    if existing is not None and part_name(chunk.index) not in existing[chunk.split]:
        return None
    marker = store.read_json(f"{folder}/part.json")
    if not marker or marker.get("fingerprint") != chunk.fingerprint:
        return None
    for shard in marker["shards"]:
        if store.size(f"{folder}/{shard['zip_data']['basename']}") != shard["zip_data"]["bytes"]:
            return None
    return PartResult.from_marker(chunk.split, chunk.index, marker)


class SelectionReport(Protocol):
    """What `Conversion.finish` reports of the decisions: a `Selection`'s, or the merge's."""

    dropped_tokens: dict[str, int]
    sample: PairSample | None

    @property
    def near_index_bytes(self) -> int | None: ...

    @property
    def near_through_removed(self) -> int: ...


class PartLog:
    """One split's parts as they come back, on disk rather than in memory: a conversion has a part
    per chunk (about a million characters), 1.7 M of them at 1.2 T tokens, whose tails and shard
    entries would take gigabytes. Each part's prefixed shard entries go to a JSON-lines file and
    its tail's tokens to a token file, both in a scratch folder, and are read back in order for
    the split's last part and its index.json."""

    def __init__(self, folder: str, split: str) -> None:
        self.split = split
        self.entries_path = os.path.join(folder, f"{split}.shards.jsonl")
        self.tails_path = os.path.join(folder, f"{split}.tails.u32")
        self._entries = open(self.entries_path, "w", encoding="utf-8")  # noqa: SIM115
        self._tails = open(self.tails_path, "wb")  # noqa: SIM115
        self.parts = self.samples = self.documents = self.too_short = self.shards = 0

    def add(self, part: PartResult) -> None:
        if part.index != self.parts:
            raise RuntimeError(f"{self.split} part {part.index} came back after part {self.parts - 1}")
        text = part.index_text or index_entries_text(prefixed_entries(part.shards, part_name(part.index)))
        self._entries.write(json.dumps(text, ensure_ascii=False) + "\n")
        self._tails.write(part.tail.astype(np.uint32).tobytes())
        self.parts += 1
        self.shards += len(part.shards)
        self.samples += part.samples
        self.documents += part.documents
        self.too_short += part.too_short

    def close(self) -> None:
        self._entries.close()
        self._tails.close()

    def tails(self, block: int = 1 << 24) -> Iterator[np.ndarray]:
        """Every part's tail, concatenated in part order, in blocks of `block` tokens."""
        with open(self.tails_path, "rb") as f:
            while len(tokens := np.fromfile(f, dtype=np.uint32, count=block)):
                yield tokens

    def entries(self) -> Iterator[str]:
        """Each part's shard entries as index.json holds them (`index_entries_text`), in order."""
        with open(self.entries_path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


@dataclass
class SplitTotals:
    log: PartLog
    tail_shards: list[dict] = field(default_factory=list)  # the split's last part's, prefixed
    samples: int = 0
    documents: int = 0
    too_short: int = 0
    lost_tail_tokens: int = 0

    def summary(self, seq_len: int) -> SplitSummary:
        return SplitSummary(
            documents=self.documents, too_short_tokens=self.too_short, samples=self.samples,
            tokens=self.samples * seq_len, shards=self.log.shards + len(self.tail_shards), parts=self.log.parts,
            lost_tail_tokens=self.lost_tail_tokens,
        )  # fmt: skip


class Conversion:
    """One run: prepares the output, farms chunks out, then writes tails, meta, summary, indexes."""

    def __init__(self, *, tokenizer: str, out: str, options: ShardOptions):
        loaded = Tokenizer(tokenizer)
        self.tokenizer_files, self.tokenizer = loaded.files, loaded.info()
        self.options = options.resolve(self.tokenizer)
        self.out = out
        self.store = open_output(out)
        self.scratch = make_scratch("spool")  # the parts' records (`PartLog`), removed by `finish`
        self.totals = {split: SplitTotals(log=PartLog(self.scratch, split)) for split in SPLITS}
        self.reused_parts = 0

    def prepare_output(self) -> None:
        """Refuse a complete output (unless overwrite); make an incomplete one resumable (its
        finished parts are reused, see `reuse_part`)."""
        prepare_output(
            self.store, overwrite=self.options.overwrite, resume=True, files=("summary.json", NEAR_REPORT)
        )

    def run(
        self,
        documents: Callable[[Executor], Iterable[Doc]] | None = None,
        *,
        chunks: Callable[[Executor], Iterable] | None = None,
        process: Callable = process_chunk,
        done: Callable[[PartResult], None] | None = None,
        write_here: bool = False,
        cleaner: Cleaner | None = None,
    ) -> None:
        """Convert the documents that `documents(executor)` yields, in order; or write the sealed
        chunks that `chunks(executor)` yields (each with split, index and fingerprint), each by
        `process` in a worker, `done(result)` called as each part comes back, in order. With
        `write_here` this process packs and writes the parts, not the workers; `cleaner` is the
        workers' (without de-duplication) for texts sent to them uncleaned."""
        window = 2 * self.options.workers
        if write_here:
            init_worker(self.options, self.out)  # before the workers are forked: they set their own
        worker_setup = (self.options, self.out, self.tokenizer_files, cleaner)
        with start_workers(self.options.workers, init_worker, *worker_setup) as executor:
            if chunks is None:
                cut = chunk_documents(documents(executor), chunk_size=self.options.chunk_chars)
                tasks = (chunk.seal(self.options, self.tokenizer) for chunk in cut)
            else:
                tasks = chunks(executor)
            parts = None if write_here else executor
            existing = {split: set(self.store.list_dirs(split)) for split in SPLITS}
            reusable = partial(reuse_part, self.store, existing=existing)
            for result in ordered(parts, process, tasks, window, shortcut=reusable):
                self.totals[result.split].log.add(result)
                self.reused_parts += result.reused
                if done is not None:
                    done(result)
        for split in SPLITS:
            self._finish_split(split)

    def _finish_split(self, split: str) -> None:
        """Pack the parts' tails, in chunk order, into one last part; count the split."""
        totals, options = self.totals[split], self.options
        log = totals.log
        log.close()
        packer = Packer(options.seq_len)
        tail_index = log.parts
        folder = f"{split}/{part_name(tail_index)}"
        self.store.delete_tree(folder)
        writer = ShardWriter(
            self.store, folder, seq_len=options.seq_len, dtype=options.dtype, size_limit=options.size_limit
        )
        for tails in log.tails():
            writer.write(packer.add(tails))
        tail_shards = writer.finish()
        self._remove_stale_parts(split, keep=tail_index + (1 if tail_shards else 0))
        totals.samples = log.samples + writer.samples
        totals.documents, totals.too_short = log.documents, log.too_short
        totals.tail_shards = prefixed_entries(tail_shards, part_name(tail_index))
        totals.lost_tail_tokens = len(packer.tail)

    def _remove_stale_parts(self, split: str, keep: int) -> None:
        """Parts numbered past this run's last one come from an earlier, different run."""
        for name in self.store.list_dirs(split):
            if name.startswith("part-") and name[5:].isdigit() and int(name[5:]) >= keep:
                self.store.delete_tree(f"{split}/{name}")

    def finish(
        self,
        *,
        read: dict,
        dropped: dict[str, int],
        start: float,
        command: str,
        selection: SelectionReport | None = None,
        tasks: int | None = None,
    ) -> Summary:
        """Check there is something to write; write meta, the near-duplicate report, summary,
        then the indexes last. `selection` adds its dropped tokens and pair sample; `tasks`, a
        merge's task count."""
        totals, options = self.totals, self.options
        warning = dominant_drop(dropped, read.get("documents", 0), options.filters) if selection else None
        if warning:  # before "nothing to write", which it often explains
            print(warning, file=sys.stderr, flush=True)
        if totals["train"].samples == 0:
            read_docs = read.get("documents", "the")
            raise ConvertError(
                f"nothing to write: {read_docs} documents gave no full training sample of {options.seq_len} tokens "
                f"(dropped: {dropped or 'none'}, too short in tokens: {totals['train'].too_short}); "
                "add text, lower --seq-len or --min-tokens"
            )
        malformed = {"malformed": read["malformed"]} if read.get("malformed") else {}
        for split in SPLITS:
            self.write_meta(split, {**dropped, **malformed}, command)
        all_dropped = {**dropped, **malformed, "too_short_tokens": sum(t.too_short for t in totals.values())}
        elapsed = time.monotonic() - start
        dropped_tokens = filters = near = None
        if selection is not None:
            dropped_tokens = dict(sorted(selection.dropped_tokens.items()))
            filters = options.filters if options.filters.active else None
            near = self._near_report(selection)
        summary = build_summary(
            out=self.store.url(),
            read=read,
            dropped=all_dropped,
            splits={split: totals[split].summary(options.seq_len) for split in SPLITS},
            seq_len=options.seq_len,
            workers=options.workers,
            elapsed=elapsed,
            reused_parts=self.reused_parts,
            dropped_tokens=dropped_tokens,
            filters=filters,
            near_dedup=near,
            tasks=tasks,
        )
        self.store.write_json("summary.json", summary.to_json())
        self.write_indexes()
        print_summary(summary, sys.stdout)
        if totals["val"].samples == 0 and options.val_fraction > 0:
            sys.stderr.write(
                f"warning: the val split is empty (too little text for a {options.seq_len}-token sample at "
                f"--val-fraction {options.val_fraction}); raise --val-fraction for a validation set\n"
            )
        return summary

    def _near_report(self, selection: SelectionReport) -> NearDedupSummary | None:
        """With near-dedup: the sample of removed pairs written beside summary.json, and its summary."""
        near = self.options.near_dedup
        if near is None:
            return None
        pairs = selection.sample.pairs(near.ngram) if selection.sample is not None else []
        self.store.write_json(NEAR_REPORT, {"threshold": near.threshold, "ngram": near.ngram, "pairs": pairs})
        return NearDedupSummary(
            options=near,
            report=NEAR_REPORT,
            pairs_in_report=len(pairs),
            through_removed=selection.near_through_removed,
            index_bytes=selection.near_index_bytes,
        )

    def write_meta(self, split: str, dropped: dict[str, int], command: str) -> None:
        totals, options, tokenizer = self.totals[split], self.options, self.tokenizer
        meta = SplitMeta(
            split=split, seq_len=options.seq_len, dtype=options.dtype, **tokenizer.meta_fields(),
            add_bos=options.add_bos, num_samples=totals.samples,
            num_tokens=totals.samples * options.seq_len, num_documents=totals.documents,
            dropped={**dropped, "too_short_tokens": totals.too_short}, created_at=now(), command=command,
        )  # fmt: skip
        write_meta(self.store, meta)

    def write_indexes(self) -> None:
        """Last step: each split's merged index.json; its presence marks the split complete."""
        for split in ("val", "train"):
            totals = self.totals[split]
            local = os.path.join(self.scratch, f"{split}.index.json")
            with open(local, "w", encoding="utf-8") as stream:
                write_index_json(
                    stream, itertools.chain(totals.log.entries(), [index_entries_text(totals.tail_shards)])
                )
            self.store.upload(local, f"{split}/index.json")
        shutil.rmtree(self.scratch, ignore_errors=True)
