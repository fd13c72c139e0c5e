"""A corpus file's compression, decompressed on the fly: gzip, zstd, bzip2 and xz.

Compression is a property of the file (its suffix: convert/reading/formats.py), not of the
reader: every line or JSON reader gets a plain byte stream from `open_decompressed`, with
`peek` (the format guess looks at the first bytes) and line iteration. Memory stays bounded: a
buffer of 1 MiB plus the decompressor's window. Files of several members (gzip, bzip2, xz:
what parallel compressors write) or frames (zstd) read whole.

gzip, bzip2 and xz come from the standard library; zstd from pyarrow's `CompressedInputStream`
(the `parquet` extra; convert/reading/extras.py says why not `zstd` or `zstandard`). A stream that
is truncated or corrupt raises one of its compression's `errors` while it is read: the reader
counts one malformed record for the file and skips the rest of it.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from convert.reading.extras import pyarrow
from convert.reading.formats import COMPRESSION_SUFFIXES, compression_of
from convert.reading.sources import open_binary

BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class Compression:
    name: str  # as messages say it: gzip, zstd, bzip2, xz; "none"
    errors: tuple[type[BaseException], ...]  # what a truncated or corrupt stream raises when read
    wrap: Callable[[BinaryIO], BinaryIO]  # the compressed stream -> the decompressed one


def _gzip(raw: BinaryIO) -> BinaryIO:
    return gzip.GzipFile(fileobj=raw, mode="rb")


class _Members(io.RawIOBase):
    """Concatenated bzip2 or xz streams (members), decompressed one after another.

    Why not `bz2.BZ2File` / `lzma.LZMAFile`: after the first member they take whatever does not
    decompress as "trailing garbage" and end the file there, quietly, so a member whose start is
    corrupt ended the file unseen. Here anything after a member must be another member: else the
    codec's error is raised, as for corrupt bytes inside a member, and a file that ends inside a
    member raises EOFError."""

    def __init__(self, raw: BinaryIO, new_decompressor: Callable[[], object]) -> None:
        self._raw, self._new = raw, new_decompressor
        self._decompressor = new_decompressor()
        self._pending = b""  # compressed bytes read and not yet given to the decompressor

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _read(self, size: int) -> bytes:
        while True:
            if self._decompressor.eof:
                rest = self._decompressor.unused_data or self._raw.read(BUFFER_BYTES)
                if not rest:
                    return b""  # the end of the last member
                self._decompressor, self._pending = self._new(), rest
            if self._decompressor.needs_input and not self._pending:
                self._pending = self._raw.read(BUFFER_BYTES)
                if not self._pending:
                    raise EOFError("the file ends inside a compressed member")
            data = self._decompressor.decompress(self._pending, size)
            self._pending = b""
            if data:
                return data


def _bzip2(raw: BinaryIO) -> BinaryIO:
    return _Members(raw, bz2.BZ2Decompressor)


def _xz(raw: BinaryIO) -> BinaryIO:
    return _Members(raw, lzma.LZMADecompressor)


def _zstd(raw: BinaryIO) -> BinaryIO:
    pa = pyarrow("reading zstd-compressed files (.zst)")
    # pyarrow reads `raw` through Python (local or S3 alike) and re-raises its exceptions as they are.
    return pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")


NONE = Compression("none", (), lambda raw: raw)
_COMPRESSIONS = {
    "gzip": Compression("gzip", (gzip.BadGzipFile, EOFError, zlib.error), _gzip),
    # bz2 raises a plain OSError ("Invalid data stream") for corrupt data; a cut one: EOFError.
    "bzip2": Compression("bzip2", (EOFError, OSError), _bzip2),
    "xz": Compression("xz", (EOFError, lzma.LZMAError), _xz),
    # pyarrow raises OSError for both ("Truncated compressed stream", "ZSTD decompress failed").
    "zstd": Compression("zstd", (OSError,), _zstd),
}


def compression(path: str) -> Compression:
    """How `path` is compressed, from its suffix."""
    suffix = compression_of(path)
    return _COMPRESSIONS[COMPRESSION_SUFFIXES[suffix]] if suffix else NONE


@contextlib.contextmanager
def open_decompressed(path: str) -> Iterator[BinaryIO]:
    """`path` (local or S3) as a buffered stream of its decompressed bytes; both closed at the end."""
    raw = open_binary(path)
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        how = compression(path)
        if how is NONE:
            yield raw
            return
        stream = io.BufferedReader(how.wrap(raw), buffer_size=BUFFER_BYTES)
        stack.callback(stream.close)
        yield stream
