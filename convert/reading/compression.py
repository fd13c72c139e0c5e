"""A corpus file's compression, decompressed on the fly: gzip, zstd, bzip2 and xz.

Compression is a property of the file (its suffix: convert/reading/formats.py), not of the
reader: every line or JSON reader gets a plain byte stream from `open_decompressed`, with
`peek` (the format guess looks at the first bytes) and line iteration. Memory stays bounded: a
buffer of 1 MiB plus the decompressor's window. Multi-member gzip and bzip2 files and
multi-frame zstd files read whole.

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


def _bzip2(raw: BinaryIO) -> BinaryIO:
    return bz2.BZ2File(raw, mode="rb")


def _xz(raw: BinaryIO) -> BinaryIO:
    return lzma.LZMAFile(raw, mode="rb")


def _zstd(raw: BinaryIO) -> BinaryIO:
    pa = pyarrow("reading zstd-compressed files (.zst)")
    # pyarrow reads `raw` through Python (local or S3 alike) and re-raises its exceptions as they are.
    return pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")


NONE = Compression("none", (), lambda raw: raw)
_COMPRESSIONS = {
    "gzip": Compression("gzip", (gzip.BadGzipFile, EOFError, zlib.error), _gzip),
    # bz2 raises a plain OSError ("Invalid data stream") for corrupt data, EOFError for a cut one.
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
