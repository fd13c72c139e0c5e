"""Conversion with the workers reading the inputs: the main process handles compact records only.

Used for local, uncompressed files of one document per line (txt, jsonl) and for Parquet files,
local or on S3 (`readers.range_format`); every other input (S3 line files, compressed files, JSON
lists, txt-blank, --strict) takes convert/run/conversion.py's path, where the main process reads
the documents and sends their texts. Both give the same bytes.

    main process                                  worker processes (`read_range`)
    cut each file into byte ranges at line        read the range, parse its lines (`read_range`,
    ends (`byte_ranges`: a seek and a short   ---> convert/reading/readers.py), clean, digest,
    read per range), a Parquet file into its      filter, sign, tokenize it (the
    row groups (`row_groups`: its footer)         (a row group: `read_row_group`, a record batch
                                                  at a time, each one such a step and result)
                                                  batch step of convert/run/worker.py); write the
                                                  tokens of the train documents to a spool file
                                 <--------------- digests, sizes, filter reasons, band keys and
                                                  sketches, line numbers; the val documents' tokens
                                                  (about val_fraction of them); the texts that may
                                                  join the near-duplicate pair sample
    `Selection`, in input order (convert/dedup/selection.py), then per batch, with numpy: the kept
    documents' split, sizes and spool offsets; each split cut into chunks exactly where
    `chunk_documents` cuts (after the document that brings a chunk to chunk_chars)
                                 ---------------> a chunk as spool offsets and lengths (val: tokens):
                                                  gather the tokens, then `process_chunk`
    a spool file goes when its batch is routed and every chunk reading it is written

The main process never touches a text or a token of the train split: per document it does the
exact-duplicate set lookup and a few numpy operations per batch, and the near-duplicate index's
lookups and inserts (vectorised per batch). The spool files live in a temporary folder of the
machine (one per run, removed at the end; one a killed run left behind is removed by the next run:
convert/scratch.py), and
hold the tokens of the batches in flight and of the open train chunk: bounded by the window of
batches and the chunk size. Decisions depend only on the sequence of documents, so the kept
documents, the chunks, their fingerprints and the parts are those of the main-process path, for
any range size and worker count (tests/convert/test_convert_golden.py compares the bytes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np

from convert.dedup.selection import Selection
from convert.executor import Executor, ordered
from convert.reading.options import ReadOptions
from convert.reading.readers import (
    ReadStats,
    byte_ranges,
    empty_corpus_error,
    range_format,
    read_range,
    read_row_group,
    row_groups,
)
from convert.reading.sources import input_sizes
from convert.records import (
    DIGEST_BYTES,
    ChunkTokens,
    PartResult,
    Selected,
    TextBatch,
    TokenizedBatch,
    ToSelect,
    gathered,
    in_val,
)
from convert.run.conversion import BATCH_CHARS, Conversion, OpenChunk
from convert.run.worker import current_cleaner, process_chunk, tokenize_batch
from convert.scratch import make_scratch
from shards.meta import SPLITS

# Bytes of a range: ~ as many characters of Chinese UTF-8 as a text batch holds, times half the
# index processes. The main process's work per range is mostly fixed (a message to and from each
# index process, a few numpy calls), so with more workers (and so more index processes) the
# ranges grow with them (`RangeFeed.range_bytes`).
RANGE_BYTES = 3 * BATCH_CHARS
_DIGEST = np.dtype((np.void, DIGEST_BYTES))


def range_formats(paths: list[str], read: ReadOptions) -> list[str] | None:
    """Each file's format when the workers can read all of them in byte ranges, else None."""
    if read.strict:
        return None  # the first bad line must stop the run before any later one is read
    formats = []
    for path in paths:
        fmt = range_format(path, read.fmt, read.preset)
        if fmt is None:
            return None
        formats.append(fmt)
    return formats


@dataclass(kw_only=True)
class RangeTask:
    """One byte range, or one row group of a Parquet file, for a worker to read and process."""

    path: str
    fmt: str
    start: int  # the byte range (0, 0 for a row group)
    end: int
    row_group: int | None = None  # of a Parquet file of `size` bytes
    size: int = 0
    text_field: str | None
    preset: str | None
    spool: str  # where the worker writes the train documents' tokens
    sample_bound: int  # texts of passing rows whose first band key is at most this come back
    val_fraction: float


@dataclass(kw_only=True)
class RangeResult:
    """What a worker sends back for a byte range, or for one record batch of a row group (a row
    group gives one per batch, in order: its memory stays that of one batch)."""

    batch: TokenizedBatch  # its `tokens` left empty: they are in the spool, or `val_tokens`
    lines: np.ndarray  # per row: line number within the range (row within the batch), from 0
    range_lines: int  # lines in the range (rows in the batch)
    is_val: np.ndarray  # per passing row
    offsets: np.ndarray  # per passing row: start in the spool (train) or in val_tokens (val)
    val_tokens: np.ndarray
    documents: int
    malformed: int
    malformed_examples: list[tuple[str, int, str]]  # line numbers within the range, from 0
    texts: dict[int, str] = field(default_factory=dict)  # row -> cleaned text, for the pair sample


class _Arrived(NamedTuple):
    """A range's task and what its worker sent back, handed through the selection."""

    task: RangeTask
    result: RangeResult


def read_range_batch(task: RangeTask) -> list[RangeResult]:
    """In a worker: read, clean, filter, sign and tokenize one byte range or row group (see the
    module docstring); a row group's record batches one after another, into one spool file."""
    spool = _SpoolFile(task.spool)
    try:
        return [_process_slice(task, *piece, spool) for piece in _pieces(task)]
    finally:
        spool.close()


def _pieces(task: RangeTask) -> Iterator[tuple[int, list, ReadStats, int]]:
    """(lines, documents, their counts, the number of the first line) of each piece of the task."""
    if task.row_group is not None:
        for rows, docs, stats in read_row_group(
            task.path, task.size, task.row_group, text_field=task.text_field
        ):
            yield rows, docs, stats, 1
        return
    with open(task.path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.end - task.start)
    stats = ReadStats()
    first = 1 if task.start == 0 else 2
    docs = list(
        read_range(data, task.fmt, task.path, at_start=first == 1, text_field=task.text_field,
                   preset=task.preset, stats=stats)
    )  # fmt: skip
    range_lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    yield range_lines, docs, stats, first


class _SpoolFile:
    """A task's spool file, opened at its first write; `write` returns where the tokens start."""

    def __init__(self, path: str) -> None:
        self.path, self.file, self.tokens = path, None, 0

    def write(self, tokens: np.ndarray) -> int:
        if self.file is None:
            self.file = open(self.path, "wb")  # noqa: SIM115 (closed by `close`)
        start = self.tokens
        tokens.tofile(self.file)
        self.tokens += len(tokens)
        return start

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _process_slice(
    task: RangeTask, range_lines: int, docs: list, stats: ReadStats, first: int, spool: _SpoolFile
) -> RangeResult:
    if not docs:
        none = np.empty(0, dtype=np.int64)
        empty = TokenizedBatch(
            digests=b"", chars=none, lengths=none, tokens=np.empty(0, dtype=np.uint32), drops={}
        )
        return RangeResult(
            batch=empty, lines=none, range_lines=range_lines, is_val=np.zeros(0, dtype=bool), offsets=none,
            val_tokens=empty.tokens, documents=0, malformed=stats.malformed,
            malformed_examples=_shifted(stats, first),
        )  # fmt: skip
    batch = tokenize_batch(TextBatch(texts=[doc.text for doc in docs]))
    if batch.index_shares is not None and batch.keys is not None:  # the index processes have the keys
        batch.keys = np.ascontiguousarray(batch.keys[:, :1])
    doc_lines = np.fromiter((doc.line for doc in docs), dtype=np.int64, count=len(docs))
    lines = doc_lines[batch.sources] - first if len(batch) else np.empty(0, dtype=np.int64)
    passing = np.flatnonzero(batch.passing())
    lengths = batch.lengths[passing]
    digests = np.frombuffer(batch.digests, dtype=_DIGEST)[passing].tobytes()
    is_val = in_val(digests, task.val_fraction) if len(passing) else np.zeros(0, dtype=bool)
    token_val = np.repeat(is_val, lengths)
    spooled = spool.write(batch.tokens[~token_val])
    val_tokens = batch.tokens[token_val]
    offsets = np.zeros(len(passing), dtype=np.int64)
    for split_rows in (~is_val, is_val):
        offsets[split_rows] = np.cumsum(lengths[split_rows]) - lengths[split_rows]
    offsets[~is_val] += spooled
    texts = {}
    if batch.keys is not None and len(passing):
        bound = np.uint64(min(task.sample_bound, (1 << 64) - 1))
        cleaned = None
        for i in np.flatnonzero(batch.keys[:, 0] <= bound).tolist():
            row = int(passing[i])
            if cleaned is None:
                cleaned = current_cleaner()
            texts[row] = cleaned.normalize(docs[int(batch.sources[row])].text)
    examples = _shifted(stats, first)
    batch.tokens = np.empty(0, dtype=batch.tokens.dtype)
    return RangeResult(
        batch=batch, lines=lines, range_lines=range_lines, is_val=is_val, offsets=offsets, val_tokens=val_tokens,
        documents=stats.documents, malformed=stats.malformed, malformed_examples=examples, texts=texts,
    )  # fmt: skip


def _sample_text(texts: dict[int, str], lines: np.ndarray, path: str, before: int, row: int):
    """A row's cleaned text with its input file and line, if the worker sent it (for the pair sample)."""
    cleaned = texts.get(row)
    return None if cleaned is None else (cleaned, path, before + int(lines[row]) + 1)


def _shifted(stats: ReadStats, first: int) -> list[tuple[str, int, str]]:
    return [(source, line - first, reason) for source, line, reason in stats.malformed_examples]


@dataclass(kw_only=True)
class SpooledChunk:
    """A chunk as a worker gets it on this path: the train documents as spool offsets."""

    split: str
    index: int
    fingerprint: str
    lengths: np.ndarray
    segments: list[tuple[str, np.ndarray]]  # (spool file, document starts in it)
    tokens: np.ndarray | None = None  # val: the tokens themselves

    def gather(self) -> ChunkTokens:
        if self.tokens is not None:
            return gathered(self, [self.tokens], np.uint32)
        pieces, at = [], 0
        for path, starts in self.segments:
            spool = np.fromfile(path, dtype=np.uint32)
            for start, length in zip(
                starts.tolist(), self.lengths[at : at + len(starts)].tolist(), strict=True
            ):
                pieces.append(spool[start : start + length])
            at += len(starts)
        return gathered(self, pieces, np.uint32)


def process_spooled_chunk(chunk: SpooledChunk) -> PartResult:
    return process_chunk(chunk.gather())


@dataclass
class _OpenChunk(OpenChunk):
    segments: list[tuple[str, np.ndarray]] = field(default_factory=list)
    val_pieces: list[np.ndarray] = field(default_factory=list)


class RangeFeed:
    """The main process's side: hands out ranges, selects, routes, cuts chunks, frees spools."""

    def __init__(self, conversion: Conversion, selection: Selection, read: ReadOptions, paths: list[str],
                 formats: list[str], stats: ReadStats, bar, spool_dir: str) -> None:  # fmt: skip
        self.conversion, self.selection, self.read = conversion, selection, read
        self.paths, self.formats, self.stats, self.bar = paths, formats, stats, bar
        self.spool_dir = spool_dir
        self.options = conversion.options
        self.open = {split: _OpenChunk(index=0) for split in SPLITS}
        self.users: dict[str, int] = {}  # spool file -> batch routing + chunks still to write it
        self.chunk_spools: dict[tuple[str, int], list[str]] = {}
        self.smallest_keys = np.empty(0, dtype=np.uint64)  # of the passing rows received so far
        self.range_bytes = RANGE_BYTES * max(1, self.options.index_processes // 2)

    def _tasks(self) -> Iterator[RangeTask]:
        number = 0
        for path, fmt in zip(self.paths, self.formats, strict=True):
            self.stats.files += 1
            for start, end, group, size in self._pieces(path, fmt):
                spool = os.path.join(self.spool_dir, f"{number:08d}.u32")
                number += 1
                yield RangeTask(
                    path=path, fmt=fmt, start=start, end=end, row_group=group, size=size,
                    text_field=self.read.text_field, preset=self.read.preset, spool=spool,
                    sample_bound=self._sample_bound(), val_fraction=self.options.val_fraction,
                )  # fmt: skip

    def _pieces(self, path: str, fmt: str) -> Iterator[tuple[int, int, int | None, int]]:
        """(start, end, row group, size) of each task of one file: its byte ranges, or its row groups."""
        if fmt == "parquet":
            size = input_sizes([path])[0]
            for group in row_groups(path, self.read.text_field, self.stats, size):
                yield 0, 0, group.index, size
            return
        size = os.path.getsize(path)
        for start, end in byte_ranges(path, size, self.range_bytes):
            yield start, end, None, size

    def _sample_bound(self) -> int:
        """A first band key above which no row of a range handed out now can join the pair sample.

        The sample keeps the rows whose first key is among its `capacity` smallest distinct
        first keys (near_dedup.py `PairSample`). The distinct first keys of the passing rows
        received so far are those of the indexed ones among them (an exact duplicate has its
        original's keys), so the sample's bound once they are decided is their `capacity`-th
        smallest, and it only falls after: known here, without waiting for the decisions."""
        sample = self.selection.sample
        if sample is None:
            return 0
        return int(self.smallest_keys[-1]) if len(self.smallest_keys) >= sample.capacity else 1 << 64

    def _note_keys(self, batch: TokenizedBatch) -> None:
        sample = self.selection.sample
        if sample is None or batch.keys is None or not len(batch.keys):
            return
        first = batch.keys[:, 0]
        if len(self.smallest_keys) >= sample.capacity:
            first = first[first < self.smallest_keys[-1]]
        self.smallest_keys = np.unique(np.concatenate([self.smallest_keys, first]))[: sample.capacity]

    def chunks(self, executor: Executor) -> Iterator[SpooledChunk]:
        # Ranges in flight: 4 per worker, as many bytes when they are larger, 2 per worker at least.
        workers = self.options.workers
        window = max(2 * workers + 2, (4 * workers + 4) * RANGE_BYTES // self.range_bytes)
        tasks = self._tasks()
        lines_in_file: dict[str, int] = {}
        pending: list[RangeTask] = []

        def tracked() -> Iterator[RangeTask]:
            for task in tasks:
                pending.append(task)
                yield task

        def arrived() -> Iterator[ToSelect]:
            for results in ordered(executor, read_range_batch, tracked(), window):
                task = pending.pop(0)
                self.users[task.spool] = len(results)  # each result routed lets go of it once
                for result in results:
                    before = lines_in_file.get(task.path, 0)
                    lines_in_file[task.path] = before + result.range_lines
                    self._absorb(task, result, before)
                    self._note_keys(result.batch)
                    text = partial(_sample_text, result.texts, result.lines, task.path, before)
                    yield ToSelect(
                        batch=result.batch,
                        text=text,
                        deduped=False,
                        payload=_Arrived(task=task, result=result),
                    )

        for selected in self.selection.select_all(arrived()):
            arrived_range = selected.payload
            yield from self._route(arrived_range.task, arrived_range.result, selected)
            self._release(arrived_range.task.spool)
        for split in SPLITS:
            if self.open[split].size:
                yield self._seal(split)
        if self.stats.documents == 0:
            raise empty_corpus_error(self.paths, self.read.fmt, self.stats)

    def _absorb(self, task: RangeTask, result: RangeResult, before: int) -> None:
        stats = self.stats
        stats.documents += result.documents
        stats.malformed += result.malformed
        for source, line, reason in result.malformed_examples:
            if len(stats.malformed_examples) < stats.MAX_EXAMPLES:
                stats.malformed_examples.append((source, before + line + 1, reason))
        self.bar.update(result.documents)
        for reason, count in result.batch.drops.items():
            self.selection.cleaner.drops.add(reason, count)

    def _route(self, task: RangeTask, result: RangeResult, selected: Selected) -> Iterator[SpooledChunk]:
        batch = result.batch
        kept = selected.indexed[selected.match < 0]
        if not len(kept):
            return
        among = (np.cumsum(batch.passing()) - 1)[kept]
        is_val = result.is_val[among]
        offsets, lengths, chars = result.offsets[among], batch.lengths[kept], batch.chars[kept]
        digests = np.frombuffer(batch.digests, dtype=_DIGEST)[kept]
        for split, rows in (("train", ~is_val), ("val", is_val)):
            if rows.any():
                yield from self._add(split, task.spool, result, offsets[rows], lengths[rows], chars[rows],
                                     digests[rows])  # fmt: skip

    def _add(self, split, spool, result, offsets, lengths, chars, digests) -> Iterator[SpooledChunk]:
        """Add documents to the split's open chunk, sealing it where `chunk_documents` would."""
        limit = self.options.chunk_chars
        at = 0
        while at < len(chars):
            chunk = self.open[split]
            filled = np.cumsum(chars[at:]) + chunk.size
            cut = int(filled.searchsorted(limit, side="left"))  # first document reaching the limit
            take = min(cut + 1, len(chars) - at)
            part = slice(at, at + take)
            chunk.lengths.append(lengths[part])
            chunk.digests.append(digests[part].tobytes())
            if split == "train":
                if not chunk.segments or chunk.segments[-1][0] != spool:
                    self.users[spool] += 1  # the open chunk reads it too
                chunk.segments.append((spool, offsets[part]))
            else:
                for start, length in zip(offsets[part].tolist(), lengths[part].tolist(), strict=True):
                    chunk.val_pieces.append(result.val_tokens[start : start + length].copy())
            chunk.size = int(filled[take - 1])
            at += take
            if chunk.size >= limit:
                yield self._seal(split)

    def _seal(self, split: str) -> SpooledChunk:
        chunk = self.open[split]
        self.open[split] = _OpenChunk(index=chunk.index + 1)
        fingerprint, lengths = chunk.identity(self.options, self.conversion.tokenizer)
        if split == "val":
            pieces = chunk.val_pieces
            tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint32)
            return SpooledChunk(
                split=split,
                index=chunk.index,
                fingerprint=fingerprint,
                lengths=lengths,
                segments=[],
                tokens=tokens,
            )
        self.chunk_spools[(split, chunk.index)] = sorted({path for path, _ in chunk.segments})
        return SpooledChunk(
            split=split, index=chunk.index, fingerprint=fingerprint, lengths=lengths, segments=chunk.segments
        )

    def done(self, result: PartResult) -> None:
        """A part is written (or reused): the spool files only it still read go."""
        for path in self.chunk_spools.pop((result.split, result.index), []):
            self._release(path)

    def _release(self, path: str) -> None:
        self.users[path] -= 1
        if self.users[path] == 0:
            del self.users[path]
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


@contextlib.contextmanager
def spool_folder() -> Iterator[str]:
    """A temporary folder for one run's spool files, removed at the end (after a SIGKILL, by the
    next conversion on this machine: convert/scratch.py)."""
    folder = make_scratch("spool")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
