"""Parquet files through pyarrow (the `parquet` extra): the text column alone, a row group at a time.

A Parquet file keeps its rows in row groups and each column of a row group in its own chunk,
with the layout in a footer at the end. So a reader needs the footer (`read_footer`: one or two
reads at the end of the file), then only the text column's chunks: the other columns are never
read nor decoded. A row group is the unit of parallel work, as a byte range is for a line file
(convert/run/ranges.py): any process reads any row group on its own (`row_group_batches`).

Memory stays bounded: pyarrow reads a column chunk in buffers of BUFFER_BYTES (not whole, with
`pre_buffer` off) and decodes record batches of about `batch_bytes` of text each. On S3 every
read is one ranged GET through the storage layer (`sources.open_ranged`): nothing downloads the
whole file.

The text field is a column name or a dotted path into struct columns (`content.text`). Its type
must be text: string, large_string, string_view, or a dictionary of those. A missing column or
one of another type is a ConvertError naming the columns the file has. A file that is not
readable Parquet (truncated: its footer is gone; not Parquet at all) and a row group whose data
is corrupt raise `BadParquet`, which the reader counts as malformed (convert/reading/readers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from convert.errors import ConvertError
from convert.reading.extras import pyarrow, pyarrow_parquet
from convert.reading.sources import is_s3, open_ranged

BUFFER_BYTES = 4 << 20  # a column chunk is read in pieces this size (one ranged GET each on S3)
BATCH_BYTES = 1 << 20  # text decoded at a time: about a text batch's worth


class BadParquet(Exception):
    """The file, or one of its row groups, does not read as Parquet; the message says why."""


@dataclass(frozen=True)
class RowGroup:
    index: int
    rows: int
    first_row: int  # rows of the file before this row group
    text_bytes: int  # the text column's bytes in it, decoded (uncompressed pages)

    def batch_rows(self, batch_bytes: int) -> int:
        """Rows per record batch for about `batch_bytes` of text each."""
        return max(1, min(self.rows, batch_bytes * self.rows // max(1, self.text_bytes)))


@dataclass(frozen=True)
class Footer:
    """What the footer says: the text column and the row groups."""

    file: object  # pyarrow.parquet.ParquetFile
    column: str  # the dotted path pyarrow selects it by
    path: tuple[str, ...]  # its names, top level first
    row_groups: tuple[RowGroup, ...]


def read_footer(path: str, field: str, size: int | None = None) -> Footer:
    """Open `path` (local, or S3 with ranged reads; `size`: its length if known) and find `field`.
    Raises BadParquet if it is not readable Parquet, ConvertError if the column is not there or is
    not text."""
    pa = pyarrow(f"reading Parquet ({path})")
    pq = pyarrow_parquet(f"reading Parquet ({path})")
    source = open_ranged(path, size) if is_s3(path) else path
    try:
        parquet = pq.ParquetFile(source, buffer_size=BUFFER_BYTES, pre_buffer=False)
        schema = parquet.schema_arrow
    except MemoryError:
        raise
    except (pa.ArrowException, OSError) as err:
        raise BadParquet(f"not a readable Parquet file ({_first_line(err)})") from None
    names = _text_path(schema, field, path)
    column = ".".join(names)
    metadata = parquet.metadata
    leaf = next(j for j in range(metadata.num_columns) if metadata.schema.column(j).path == column)
    groups, first = [], 0
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        text_bytes = group.column(leaf).total_uncompressed_size
        groups.append(RowGroup(index=index, rows=group.num_rows, first_row=first, text_bytes=text_bytes))
        first += group.num_rows
    return Footer(file=parquet, column=column, path=names, row_groups=tuple(groups))


def row_group_batches(footer: Footer, group: RowGroup) -> Iterator[list]:
    """The text column of one row group, a record batch of about BATCH_BYTES at a time, as Python
    values: a str, None for a null, or the raw bytes of a value that is not valid UTF-8. Raises
    BadParquet when the data turns out corrupt (after the batches before it)."""
    pa = pyarrow("reading Parquet")
    batches = footer.file.iter_batches(
        batch_size=group.batch_rows(BATCH_BYTES), row_groups=[group.index], columns=[footer.column],
        use_threads=False,
    )  # fmt: skip
    while True:
        try:
            batch = next(batches, None)
        except MemoryError:
            raise  # pyarrow's ArrowMemoryError is an ArrowException too: not the data's fault
        except (pa.ArrowException, OSError) as err:
            raise BadParquet(f"corrupt Parquet data ({_first_line(err)})") from None
        if batch is None:
            return
        yield _values(_leaf(batch.column(0), footer.path[1:]))


def _leaf(array, names: tuple[str, ...]):
    """The text values of a struct column's field path (a null struct gives a null)."""
    for name in names:
        array = array.flatten()[array.type.get_field_index(name)]
    return array


def _values(array) -> list:
    pa = pyarrow("reading Parquet")
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    try:
        return array.to_pylist()
    except UnicodeDecodeError:  # pyarrow does not check UTF-8 when it reads: some value is bad
        binary = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}.get(
            array.type, pa.binary_view()
        )
        return [_decoded(value) for value in array.view(binary).to_pylist()]


def _decoded(value: bytes | None) -> str | bytes | None:
    try:
        return None if value is None else value.decode("utf-8")
    except UnicodeDecodeError:
        return value


# --- the text column ---------------------------------------------------------------------------


def _text_path(schema, field: str, source: str) -> tuple[str, ...]:
    """The names leading to `field` (a top-level name first, else a dotted path through structs),
    checked to be text."""
    pa = pyarrow("reading Parquet")
    if field in schema.names:
        names, found = (field,), schema.field(field).type
    else:
        names, found = tuple(field.split(".")), None
        current = schema
        for name in names:
            index = current.get_field_index(name) if current is not None else -1
            if index < 0:
                found = None
                break
            found = current.field(index).type
            current = found if pa.types.is_struct(found) else None
    if found is None:
        raise ConvertError(
            f"{source} has no column {field!r}; its columns: {', '.join(_columns(schema))}; "
            "name the text column with --field (a dotted path for a nested one)"
        )
    if not _is_text(found):
        text = [name for name, kind in _leaves(schema) if _is_text(kind)]
        raise ConvertError(
            f"column {field!r} of {source} holds {found}, not text; its text columns: "
            f"{', '.join(text) or 'none'}; name one with --field"
        )
    return names


def _is_text(kind) -> bool:
    pa = pyarrow("reading Parquet")
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or kind == pa.string_view()


def _leaves(schema_or_struct, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted name, type) of every column, struct fields opened."""
    pa = pyarrow("reading Parquet")
    for index in range(len(schema_or_struct)):
        field = schema_or_struct.field(index)
        name = prefix + field.name
        if pa.types.is_struct(field.type):
            yield from _leaves(field.type, name + ".")
        else:
            yield name, field.type


def _columns(schema) -> list[str]:
    return [f"{name} ({kind})" for name, kind in _leaves(schema)]


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
