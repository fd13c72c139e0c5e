"""The optional package some inputs need: pyarrow (the `parquet` extra) reads Parquet and zstd.

A conversion of txt, JSON, JSON lines (plain, gzip, bzip2, xz) never imports it. Why pyarrow
for zstd too: the `zstd` module that mosaicml-streaming installs compresses whole buffers only,
and `zstandard`'s stream reader ends a truncated stream quietly (0.25.0 returned the first MiB of
a frame cut in half, no error), where pyarrow's `CompressedInputStream` raises "Truncated
compressed stream"; one extra then covers both formats of the published corpora.
"""

from __future__ import annotations

from types import ModuleType

from convert.errors import ConvertError

EXTRA = "parquet"


def pyarrow(purpose: str) -> ModuleType:
    """The pyarrow module, or a ConvertError naming the extra: `purpose` says what needs it."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ConvertError(
            f"{purpose} needs pyarrow, which is not installed: add the {EXTRA} extra, pip install -e '.[{EXTRA}]'"
        ) from None
    return pa


def pyarrow_parquet(purpose: str) -> ModuleType:
    pyarrow(purpose)
    import pyarrow.parquet as pq

    return pq
