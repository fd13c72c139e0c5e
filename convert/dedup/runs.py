"""Sorted runs on disk: what the de-duplication stages spill, and read back by value range.

A run file holds entries of a few uint64 columns, sorted by all of them, the first column first.
Its entries are cut into segments by the first column's top bits (`value >> shift`), each with
an XXH3-64 checksum, so that a reader gets every entry whose first column lies in a range
[lo, hi) with one ranged read (`RunFile.values`), or walks the file segment by segment
(`RunCursor`). Two kinds of first column:

  * hash values (band keys, digests), spread evenly: the segments are the top `bits` bits, more
    of them for a larger run (about `SEGMENT_ENTRIES` entries each, at most 2^16 segments), and a
    partition of the stages (convert/dedup/stages.py) is a range of values, so it reads a slice of
    every run whatever the number of partitions;
  * ids in input order (rows, positions): the writer gives the shift, so a reader going through
    the ids in order reads one block of entries at a time.

Layout (little-endian):

    segment 0: column 0's entries, column 1's, ...  (8 bytes each)
    segment 1: ...
    table:     per segment: its byte offset and its XXH3-64; then the end of the last segment, 0
    footer:    magic "convrun1", columns, entries, shift, origin (the first segment's value >> shift),
               segments, the table's offset, the XXH3-64 of these fields

A reader reads the footer, then only the table entries of the segments it needs (a partition's
range of a large run is a small part of its table).

A file that does not read back as written (shorter, a flipped bit) raises `DamagedFile`.
Nothing here is kept per entry in Python objects; a run is written with one buffer of its size,
laid out in place (`write_run`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from convert.errors import DamagedFile
from storage import Store

_MAGIC = b"convrun1"
_FIELDS = struct.Struct("<8s6Q")
_FOOTER = struct.Struct("<8s7Q")
SEGMENT_ENTRIES = 1024  # entries per segment of a hash-keyed run, about
_MAX_BITS = 16
_TABLE_BLOCK = 4096  # segments whose table entries a cursor reads at once
_WRITE_BLOCK = 1 << 16  # entries laid out at a time when a run is written (bounded temporary arrays)
FULL = 1 << 64  # the end of the value range


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """A run written: its name (under its folder), entries and bytes (recorded in task.json)."""

    name: str
    entries: int
    bytes: int


def hash_shift(entries: int) -> int:
    """The shift of a hash-keyed run of `entries`: about SEGMENT_ENTRIES per segment."""
    bits = 0
    while bits < _MAX_BITS and entries >> bits > SEGMENT_ENTRIES:
        bits += 1
    return 64 - bits


def _id_shift(first: int, last: int, entries: int) -> int:
    """The shift of an id-keyed run: about SEGMENT_ENTRIES entries a segment however sparse the ids."""
    target = max(1, -(-entries // SEGMENT_ENTRIES))
    span = (last - first) if entries else 0
    shift = 0
    while (span >> shift) >= target:
        shift += 1
    return shift


def write_run(
    store: Store, rel: str, columns: list[np.ndarray], *, by_id: bool = False, ordered: bool = False
) -> RunInfo:
    """Sort the entries (unless `ordered`) and write them as one run file at `rel`. `by_id`: the
    first column holds ids in input order (rows, positions), else hash values.

    The call takes `columns` (a list) over: each array is replaced by its sorted copy in turn, and
    the file's bytes are laid out in place in one buffer, a block of entries at a time, so a
    caller that keeps no other reference holds at the peak the entries, their order and one
    sorted column, then the entries and the file (about twice the entries' bytes)."""
    for c, column in enumerate(columns):
        columns[c] = np.ascontiguousarray(column, dtype=np.uint64)
    width, entries = len(columns), len(columns[0])
    if not ordered and entries > 1:
        order = np.lexsort(columns[::-1])
        for c in range(width):
            columns[c] = columns[c][order]
        del order
    if by_id:
        first, last = (int(columns[0][0]), int(columns[0][-1])) if entries else (0, 0)
        shift = _id_shift(first, last, entries)
        origin = first >> shift
        segments = ((last >> shift) - origin + 1) if entries else 1
    else:
        shift, origin = hash_shift(entries), 0
        segments = 1 << (64 - shift)
    # Segment s holds the entries whose first column is in [(origin + s) << shift, (origin + s + 1) << shift).
    bounds = np.full(segments + 1, entries, dtype=np.int64)
    if shift < 64:
        edges = (np.arange(segments, dtype=np.uint64) + np.uint64(origin)) << np.uint64(shift)
        bounds[:-1] = np.searchsorted(columns[0], edges, side="left")
    else:
        bounds[0] = 0
    data_bytes = 8 * width * entries
    table_bytes = 16 * (segments + 1)
    buffer = bytearray(data_bytes + table_bytes + _FOOTER.size)
    data = np.frombuffer(buffer, dtype=np.uint64, count=width * entries)
    # Segment s holds column 0's entries bounds[s]:bounds[s+1], then column 1's, ...: entry i of
    # segment s, column c, goes to i + bounds[s] * (width - 1) + c * (its entries).
    for lo in range(0, entries, _WRITE_BLOCK):
        at = np.arange(lo, min(entries, lo + _WRITE_BLOCK), dtype=np.int64)
        segment = np.searchsorted(bounds, at, side="right") - 1
        start, count = bounds[segment], bounds[segment + 1] - bounds[segment]
        at += start * (width - 1)
        del segment, start
        for c in range(width):
            data[at + c * count] = columns[c][lo : lo + len(at)]
    columns.clear()
    del data
    offsets = (bounds * 8 * width).astype(np.uint64)
    raw = memoryview(buffer)
    empty = xxhash.xxh3_64_intdigest(b"")
    checksums = np.full(segments, empty, dtype=np.uint64)
    for s in np.flatnonzero(np.diff(bounds)).tolist():
        checksums[s] = xxhash.xxh3_64_intdigest(raw[int(offsets[s]) : int(offsets[s + 1])])
    del raw
    table = np.zeros((segments + 1, 2), dtype=np.uint64)
    table[:, 0], table[:-1, 1] = offsets, checksums
    fields = (_MAGIC, width, entries, shift, origin, segments, data_bytes)
    buffer[data_bytes : data_bytes + table_bytes] = table.tobytes()
    buffer[data_bytes + table_bytes :] = _FOOTER.pack(
        *fields, xxhash.xxh3_64_intdigest(_FIELDS.pack(*fields))
    )
    store.write_bytes(rel, buffer)
    return RunInfo(name=rel.rsplit("/", 1)[-1], entries=entries, bytes=len(buffer))


class RunFile:
    """A run file to read: its footer is read once, the segment table where a read needs it."""

    def __init__(self, store: Store, rel: str, size: int | None = None) -> None:
        self.store, self.rel, self.url = store, rel, store.url(rel)
        size = store.size(rel) if size is None else size
        if size is None:
            raise DamagedFile(self.url, "missing")
        if size < _FOOTER.size:
            raise DamagedFile(self.url, f"{size} bytes, shorter than its footer")
        *fields, checksum = _FOOTER.unpack(self._read(size - _FOOTER.size, size))
        magic, self.columns, self.entries, self.shift, self.origin, self.segments, self.table_at = fields
        if (
            magic != _MAGIC
            or checksum != xxhash.xxh3_64_intdigest(_FIELDS.pack(*fields))
            or self.table_at + 16 * (self.segments + 1) + _FOOTER.size != size
        ):
            raise DamagedFile(
                self.url, "its footer does not describe it (truncated, changed or not a run file)"
            )

    def _read(self, start: int, end: int) -> bytes:
        data = self.store.read_range(self.rel, start, end)
        if data is None:
            raise DamagedFile(self.url, "missing")
        if len(data) != end - start:
            raise DamagedFile(self.url, "shorter than written")
        return data

    def table(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of segments first..end (end's is where end - 1 stops), and the checksums
        of segments first..end - 1."""
        entries = np.frombuffer(
            self._read(self.table_at + 16 * first, self.table_at + 16 * (end + 1)), np.uint64
        )
        offsets = entries[0::2].astype(np.int64)
        if (np.diff(offsets) < 0).any() or offsets[-1] > self.table_at or offsets[0] < 0:
            raise DamagedFile(self.url, "its segment table is not in order")
        return offsets, entries[1::2][:-1]

    def segments_of(self, lo: int, hi: int) -> tuple[int, int]:
        """The segments holding values in [lo, hi)."""
        if self.shift >= 64:
            return 0, self.segments
        first = min(max((lo >> self.shift) - self.origin, 0), self.segments)
        end = min(max(((hi - 1) >> self.shift) - self.origin + 1, 0), self.segments) if hi > lo else first
        return first, max(first, end)

    def read_segments(
        self, first: int, end: int, table: tuple[np.ndarray, np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """The entries of segments [first, end), checked, as columns (`table`: theirs, if read)."""
        offsets, checksums = table if table is not None else self.table(first, end)
        start, stop = int(offsets[0]), int(offsets[-1])
        parts: list[list[np.ndarray]] = [[] for _ in range(self.columns)]
        data = self._read(start, stop) if stop > start else b""
        for s in range(end - first):
            lo, hi = int(offsets[s]) - start, int(offsets[s + 1]) - start
            if (hi - lo) % (8 * self.columns):
                raise DamagedFile(self.url, f"segment {first + s} is not whole entries")
            if xxhash.xxh3_64_intdigest(memoryview(data)[lo:hi]) != int(checksums[s]):
                raise DamagedFile(self.url, f"segment {first + s}'s checksum does not match")
            count = (hi - lo) // (8 * self.columns)
            for c in range(self.columns):
                if count:
                    parts[c].append(
                        np.frombuffer(data, dtype=np.uint64, count=count, offset=lo + 8 * count * c)
                    )
        return [np.concatenate(p) if p else np.empty(0, dtype=np.uint64) for p in parts]

    def values(self, lo: int = 0, hi: int = FULL) -> list[np.ndarray]:
        """Every entry whose first column lies in [lo, hi), as columns, in order."""
        columns = self.read_segments(*self.segments_of(lo, hi))
        keep = columns[0] >= np.uint64(lo)
        if hi < FULL:
            keep &= columns[0] < np.uint64(hi)
        return columns if keep.all() else [c[keep] for c in columns]


class RunCursor:
    """A run read in order of its first column, a few segments (about `block_bytes`) at a time."""

    def __init__(self, run: RunFile, block_bytes: int = 1 << 20) -> None:
        self.run, self.block_bytes = run, block_bytes
        self.next_segment = 0
        self.table: tuple[np.ndarray, np.ndarray] | None = None
        self.table_start = self.table_end = 0
        self.buffer = [np.empty(0, dtype=np.uint64) for _ in range(run.columns)]

    def below(self, value: int) -> list[np.ndarray]:
        """The entries not taken yet whose first column is below `value`."""
        run = self.run
        while self.next_segment < run.segments and (
            run.shift >= 64 or (self.next_segment + run.origin) << run.shift < value
        ):
            if self.table is None or self.next_segment >= self.table_end:
                self.table_start = self.next_segment
                self.table_end = min(run.segments, self.next_segment + _TABLE_BLOCK)
                self.table = run.table(self.table_start, self.table_end)
            offsets = self.table[0]
            at = self.next_segment - self.table_start
            start = offsets[at]
            end = at + 1 + int(np.searchsorted(offsets[at + 1 :], start + self.block_bytes, side="right"))
            end = min(max(end - 1, at + 1), len(offsets) - 1)
            fresh = run.read_segments(
                self.next_segment, self.table_start + end, (offsets[at : end + 1], self.table[1][at:end])
            )
            self.buffer = [np.concatenate([b, f]) for b, f in zip(self.buffer, fresh, strict=True)]
            self.next_segment = self.table_start + end
            if len(self.buffer[0]) and int(self.buffer[0][-1]) >= value:
                break
        cut = len(self.buffer[0]) if value >= FULL else int(np.searchsorted(self.buffer[0], np.uint64(value)))
        taken = [b[:cut] for b in self.buffer]
        self.buffer = [b[cut:] for b in self.buffer]
        return taken


class RunSpiller:
    """Entries gathered in memory and written as sorted runs of about `limit` bytes each,
    named `<prefix>-NNNNN.run`; `finish` writes the last and returns them all."""

    def __init__(self, store: Store, prefix: str, columns: int, limit: int) -> None:
        self.store, self.prefix, self.columns, self.limit = store, prefix, columns, max(limit, 8 * columns)
        self.parts: list[list[np.ndarray]] = []
        self.bytes = 0
        self.runs: list[RunInfo] = []

    def add(self, *columns: np.ndarray) -> None:
        """Entries (columns of equal length); a run is written whenever `limit` bytes are gathered."""
        per_run = max(1, self.limit // (8 * self.columns))
        at = 0
        while at < len(columns[0]):
            take = min(len(columns[0]) - at, per_run - self.bytes // (8 * self.columns))
            self.parts.append([np.asarray(c[at : at + take], dtype=np.uint64) for c in columns])
            self.bytes += 8 * take * self.columns
            at += take
            if self.bytes >= 8 * self.columns * per_run:
                self.spill()

    def spill(self) -> None:
        """The gathered entries as one run; each column's parts are let go as it is joined, and
        `write_run` takes the joined columns over (the entries are held about twice at the peak)."""
        if not self.parts:
            return
        parts, columns = self.parts, []
        self.parts, self.bytes = [], 0
        for c in range(self.columns):
            columns.append(np.concatenate([part[c] for part in parts]))
            for part in parts:
                part[c] = None
        del parts
        self.runs.append(write_run(self.store, f"{self.prefix}-{len(self.runs):05d}.run", columns))

    def finish(self) -> list[RunInfo]:
        self.spill()
        return self.runs
