"""Read documents out of corpus files: plain text, JSON lists, JSON lines and Parquet, local or on S3.

Formats (`--format`; convert/reading/formats.py says how `auto` guesses them from a file's name):
  txt        one document per non-empty line
  txt-blank  documents separated by blank lines (lines of one document are joined with "\\n")
  json       a JSON list of objects, `[{"text": ...}, ...]`; read item by item (see below)
  jsonl      one JSON object per line
  parquet    the text column of a Parquet file (convert/reading/parquet.py; the `parquet` extra)
  auto       guess per file: .txt -> txt, .jsonl/.json-lines/.ndjson -> jsonl, .parquet -> parquet,
             and .json by its first character: `[` -> json, anything else -> jsonl (many corpora,
             e.g. 563w_baidubaike.json, are JSON lines named .json)
Compression is a property of the file: a trailing .gz, .zst, .bz2 or .xz is decompressed on the
fly (convert/reading/compression.py) and ignored when guessing. One reader per format, each a
function of a decompressed stream (or, for Parquet, of the file's row groups), over one base,
`_read_file`, that opens the file, counts it and its documents, and turns a corrupt stream into
one counted malformed record.

The text of a record is its `text_field` (default "text"), a dotted path for a nested one
(`content.text`: `{"content": {"text": ...}}`, or a struct column in Parquet); a key that holds
the dots itself is taken first. A null text is malformed, an empty one is left to the cleaner
(dropped as "empty").

Memory stays bounded: text and JSON-lines files are read a line at a time, and JSON lists are
decoded incrementally, one item at a time, so memory grows with the largest item, not the file
(an item over 64 Mi characters is reported malformed); Parquet is read a record batch of its
text column at a time. A local line file (txt, jsonl) can also be cut at line ends into byte
ranges that are read one by one, in any process (`byte_ranges`, `read_range`), and a Parquet
file (local or S3) into its row groups (`read_row_group`): the same documents, with the same
line numbers (a Parquet document's is its row, from 1).

Bad input never stops a run silently or noisily: a line that is not valid UTF-8, not valid JSON,
not an object, or lacks a string text field is counted in `ReadStats` with its file and line,
and skipped; so is a null in a Parquet text column, a Parquet file that does not read (its row 0)
and a corrupt row group (the rest of it skipped). With `strict=True` the first one raises a
ConvertError naming file:line instead. A Parquet file without the text column, or with one that
is not text, is a ConvertError: the flag, not the data, is wrong.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, ClassVar, NamedTuple

from convert.errors import ConvertError
from convert.reading.compression import compression, open_decompressed
from convert.reading.extras import pyarrow
from convert.reading.formats import AUTO, FORMATS, compression_of, guess_format, is_parquet
from convert.reading.parquet import BadParquet, Footer, RowGroup, read_footer, row_group_batches
from convert.reading.presets import Preset, get_preset
from convert.reading.sources import is_s3, open_binary

DEFAULT_TEXT_FIELD = "text"
_JSON_CHUNK_BYTES = 1 << 20
_MAX_JSON_ITEM_CHARS = 64 << 20
_WHITESPACE = re.compile(r"\s*")
# Bytes that are not valid UTF-8 come back as lone surrogates under errors="surrogateescape".
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]")


class Document(NamedTuple):  # a tuple: built once per document, 5x cheaper than a frozen dataclass
    text: str
    source: str  # path or s3:// URL
    line: int  # 1-based line number (txt/jsonl) or 1-based item index (json list)


@dataclass
class ReadStats:
    files: int = 0
    documents: int = 0
    malformed: int = 0
    malformed_examples: list[tuple[str, int, str]] = field(default_factory=list)
    MAX_EXAMPLES: ClassVar[int] = 20

    def record_malformed(self, source: str, line: int, reason: str) -> None:
        self.malformed += 1
        if len(self.malformed_examples) < self.MAX_EXAMPLES:
            self.malformed_examples.append((source, line, reason))

    def merge(self, other: ReadStats) -> None:
        """Add another reader's counts (e.g. a parallel worker's) into this one."""
        self.files += other.files
        self.documents += other.documents
        self.malformed += other.malformed
        room = self.MAX_EXAMPLES - len(self.malformed_examples)
        self.malformed_examples.extend(other.malformed_examples[: max(room, 0)])

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "documents": self.documents,
            "malformed": self.malformed,
            "malformed_examples": [
                {"source": source, "line": line, "reason": reason}
                for source, line, reason in self.malformed_examples
            ],
        }


@dataclass(frozen=True)
class _TextExtractor:
    """Pulls the text out of one JSON record: a preset's layout or a plain field."""

    preset: Preset | None
    text_field: str

    def extract(self, obj: object) -> tuple[str | None, str]:
        """(text, "") or (None, why the record is unusable)."""
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {_json_type(obj)}"
        if self.preset is not None:
            text = self.preset.extract(obj)
            return text, "" if text is not None else f"no usable text for preset {self.preset.name!r}"
        value = obj.get(self.text_field)
        if value is None and "." in self.text_field and self.text_field not in obj:
            value = _nested(obj, self.text_field)
        if isinstance(value, str):
            return value, ""
        problem = "missing" if value is None else f"not a string ({_json_type(value)})"
        return None, f"text field {self.text_field!r} is {problem}; pick the field with --text-field"


def _nested(obj: dict, path: str) -> object:
    """The value at a dotted path of nested objects, or None."""
    for name in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(name)
    return obj


def read_documents(
    paths: list[str],
    fmt: str,
    *,
    text_field: str | None = None,
    preset: str | None = None,
    strict: bool = False,
    stats: ReadStats,
    allow_empty: bool = False,
) -> Iterator[Document]:
    """Yield the documents of already-expanded `paths`, in order, counting into `stats`.

    `fmt` is one of FORMATS or "auto". JSON records give their text through `preset` (see
    convert.reading.presets) or `text_field` (default "text"), not both. Raises ConvertError at the end
    when no document at all was found, unless `allow_empty` (parallel workers reading a slice).
    JSON list files are decoded incrementally; memory grows with the largest item only.
    """
    preset_obj = get_preset(preset) if preset else None
    _check_options(fmt, text_field, preset_obj)
    if not paths:
        raise ConvertError("no input files to read")
    # Options are checked above, at call time; the reading itself is lazy.
    extractor = _TextExtractor(preset_obj, text_field or DEFAULT_TEXT_FIELD)
    return _iter_documents(paths, fmt, extractor, strict, stats, allow_empty)


def _iter_documents(
    paths: list[str], fmt: str, extractor: _TextExtractor, strict: bool, stats: ReadStats, allow_empty: bool
) -> Iterator[Document]:
    found_before = stats.documents
    for path in paths:
        yield from _read_file(path, fmt, extractor, strict, stats)
    if stats.documents == found_before and not allow_empty:
        raise _empty_corpus_error(paths, fmt, stats)


@dataclass(frozen=True)
class _RecordExtractor:
    """Any `extract(obj) -> (value, "")` or `(None, why it is unusable)`, for `read_json_records`."""

    extract: Callable[[object], tuple[object | None, str]]
    preset: None = None


def read_json_records(
    path: str,
    fmt: str,
    extract: Callable[[object], tuple[object | None, str]],
    *,
    strict: bool,
    stats: ReadStats,
) -> Iterator[Document]:
    """The records of one JSON-list or JSON-lines file (`fmt`: json, jsonl or auto), each passed
    through `extract`, with the same streaming, line numbers and malformed-record counting as
    documents (`convert.sft.pairs` reads prompt/answer pairs this way). `Document.text` holds what
    `extract` returned; a record it refuses is counted as malformed with its reason, or raises
    when `strict`.
    """
    if fmt not in ("json", "jsonl", AUTO):
        raise ConvertError(f"format {fmt!r} holds no JSON records; use json, jsonl or auto")
    return _read_file(path, fmt, _RecordExtractor(extract), strict, stats)


# --- per file ----------------------------------------------------------------------------------


def _check_options(fmt: str, text_field: str | None, preset: Preset | None) -> None:
    if fmt != AUTO and fmt not in FORMATS:
        raise ConvertError(f"unknown format {fmt!r}; use one of: {', '.join(FORMATS)}, {AUTO}")
    if preset is not None and text_field:
        raise ConvertError(f"--preset {preset.name} fixes where the text is; drop --text-field")
    if preset is not None and fmt in ("txt", "txt-blank", "parquet"):
        raise ConvertError(
            f"--preset {preset.name} reads JSON records; drop --format {fmt}"
            + (" and name the text column with --field" if fmt == "parquet" else "")
        )


def _read_file(
    path: str, fmt: str, extractor: _TextExtractor, strict: bool, stats: ReadStats
) -> Iterator[Document]:
    stats.files += 1
    report = _MalformedReporter(stats, strict, path)
    if is_parquet(path, fmt):
        for doc in _read_parquet(path, extractor, report):
            stats.documents += 1
            yield doc
        return
    how = compression(path)
    try:
        with open_decompressed(path) as stream:
            read = _READERS[_resolve_format(path, fmt, extractor.preset, stream)]
            for doc in read(stream, path, extractor, report):
                stats.documents += 1
                yield doc
    except how.errors as err:
        report(0, f"corrupt {how.name} data ({err}); the rest of the file is skipped")


def _resolve_format(path: str, fmt: str, preset: Preset | None, stream: BinaryIO) -> str:
    if fmt != AUTO:
        return fmt
    guessed = guess_format(path, stream.peek(4096)[:4096])
    if preset is not None:
        # A preset knows its records are JSON; the file name only says list or lines.
        return guessed if guessed in ("json", "jsonl") else preset.fmt
    if guessed is None:
        raise ConvertError(
            f"cannot guess the format of {path} from its name; pass --format ({', '.join(FORMATS)})"
        )
    if guessed == "parquet":  # a compressed Parquet file (Parquet compresses inside)
        raise ConvertError(f"{path}: Parquet compresses its pages itself; decompress the file first")
    return guessed


class _MalformedReporter:
    """Counts a bad line/item, or raises at the first one when strict."""

    def __init__(self, stats: ReadStats, strict: bool, source: str) -> None:
        self.stats, self.strict, self.source = stats, strict, source

    def __call__(self, line: int, reason: str) -> None:
        if self.strict:
            raise ConvertError(f"{self.source}:{line}: {reason}; fix the line or drop --strict")
        self.stats.record_malformed(self.source, line, reason)


# --- line formats ------------------------------------------------------------------------------


def _decoded_lines(stream: BinaryIO, report: _MalformedReporter, first: int = 1) -> Iterator[tuple[int, str]]:
    """(line number, text without line ending); lines that are not UTF-8 are reported and skipped.
    `first`: the number of the stream's first line (only line 1 may start with a byte order mark)."""
    for number, raw in enumerate(stream, start=first):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            report(number, f"invalid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)")
            continue
        if number == 1:
            text = text.removeprefix("\ufeff")
        yield number, text.rstrip("\r\n")


def _read_txt(
    stream: BinaryIO, source: str, extractor: _TextExtractor, report: _MalformedReporter, first: int = 1
) -> Iterator[Document]:
    for number, text in _decoded_lines(stream, report, first):
        if text.strip():
            yield Document(text, source, number)


def _read_txt_blank(
    stream: BinaryIO, source: str, extractor: _TextExtractor, report: _MalformedReporter
) -> Iterator[Document]:
    lines: list[str] = []
    first = 0
    for number, text in _decoded_lines(stream, report):
        if text.strip():
            first = first if lines else number
            lines.append(text)
        elif lines:
            yield Document("\n".join(lines), source, first)
            lines = []
    if lines:
        yield Document("\n".join(lines), source, first)


def _read_jsonl(
    stream: BinaryIO, source: str, extractor: _TextExtractor, report: _MalformedReporter, first: int = 1
) -> Iterator[Document]:
    import orjson

    # orjson parses the raw bytes (checking the UTF-8 too) about 3x faster than decoding and
    # json.loads; whatever it refuses (blank lines, a byte order mark, NaN, lone surrogate
    # escapes, bad lines) takes the standard path, which accepts what json accepts and words
    # the report.
    fast_loads, fast_error = orjson.loads, orjson.JSONDecodeError
    for number, raw in enumerate(stream, start=first):
        try:
            obj = fast_loads(raw)
        except fast_error:
            obj = _parse_line(raw, number, report)
            if obj is _SKIP:
                continue
        text, problem = extractor.extract(obj)
        if text is None:
            report(number, problem)
        else:
            yield Document(text, source, number)


_SKIP = object()


def _parse_line(raw: bytes, number: int, report: _MalformedReporter) -> object:
    """One JSON line the slow way: the value, or _SKIP for a blank line or a reported bad one."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        report(number, f"invalid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)")
        return _SKIP
    if number == 1:
        line = line.removeprefix("\ufeff")
    if not line.strip():
        return _SKIP
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        report(number, f"invalid JSON ({err.msg} at column {err.colno})")
        return _SKIP


# --- JSON lists --------------------------------------------------------------------------------


def _read_json_list(
    stream: BinaryIO, source: str, extractor: _TextExtractor, report: _MalformedReporter
) -> Iterator[Document]:
    parser = _JsonListParser(stream)
    try:
        for index, line, obj, raw in parser.items():
            where = f"item {index} (line {line})"
            if _ESCAPED_BYTES.search(raw):
                report(index, f"{where}: invalid UTF-8")
                continue
            text, problem = extractor.extract(obj)
            if text is None:
                report(index, f"{where}: {problem}")
            else:
                yield Document(text, source, index)
    except _JsonListError as err:
        report(err.index, f"{err}; the rest of the file is skipped (use --format jsonl for JSON lines)")


class _JsonListError(ValueError):
    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class _JsonListParser:
    """Decodes `[item, item, ...]` one item at a time from a byte stream.

    Text is decoded with errors="surrogateescape" so one item with bad bytes is reported on its
    own instead of ending the file. The buffer holds the unread text only; when an item does not
    decode yet, more is read (doubling, so a long item costs linear time) and it is retried.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self._decoder_json = json.JSONDecoder()
        self._buf = ""
        self._pos = 0
        self._line = 1
        self._eof = False
        self._started = False

    def items(self) -> Iterator[tuple[int, int, object, str]]:
        """(1-based index, line where it starts, value, its raw text)."""
        first = self._next_char()
        if first == "":
            return  # an empty file: no documents, nothing malformed
        if first != "[":
            raise _JsonListError(0, f"line {self._line}: expected a JSON list `[...]`, found {first!r}")
        self._advance(self._pos + 1)
        index = 0
        while self._next_char() not in ("]", ""):
            index += 1
            line, start = self._line, self._pos
            value, end = self._decode_item(index)
            raw = self._buf[start:end]
            self._advance(end)
            yield index, line, value, raw
            separator = self._next_char()
            if separator == ",":
                self._advance(self._pos + 1)
            elif separator != "]":
                raise _JsonListError(index, f"line {self._line}: expected ',' or ']' after item {index}")
        if self._next_char() == "":
            raise _JsonListError(index, "the file ends before the closing ']'")
        self._advance(self._pos + 1)
        if self._next_char() != "":
            raise _JsonListError(index, f"line {self._line}: unexpected data after the closing ']'")

    def _decode_item(self, index: int) -> tuple[object, int]:
        while True:
            try:
                value, end = self._decoder_json.raw_decode(self._buf, self._pos)
                # A number cut by the buffer's end decodes too early: read on and decode again.
                if end < len(self._buf) or self._eof:
                    return value, end
                self._fill(_JSON_CHUNK_BYTES)
            except json.JSONDecodeError as err:
                pending = len(self._buf) - self._pos
                if self._eof or pending > _MAX_JSON_ITEM_CHARS:
                    raise _JsonListError(
                        index, f"item {index} (line {self._line}): invalid JSON ({err.msg})"
                    ) from None
                self._fill(max(_JSON_CHUNK_BYTES, pending))

    def _next_char(self) -> str:
        """Skip whitespace and return the next character without consuming it ("" at the end)."""
        while True:
            self._advance(_WHITESPACE.match(self._buf, self._pos).end())
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if self._eof:
                return ""
            self._fill(_JSON_CHUNK_BYTES)

    def _advance(self, pos: int) -> None:
        self._line += self._buf.count("\n", self._pos, pos)
        self._pos = pos

    def _fill(self, size: int) -> None:
        self._buf = self._buf[self._pos :]
        self._pos = 0
        chunk = self._stream.read(size)
        self._eof = not chunk
        self._buf += self._decoder.decode(chunk, final=self._eof)
        if not self._started and self._buf:
            self._started = True
            self._pos = 1 if self._buf.startswith("\ufeff") else 0  # skip a UTF-8 byte order mark


# --- Parquet -------------------------------------------------------------------------------------


def _read_parquet(path: str, extractor: _TextExtractor, report: _MalformedReporter) -> Iterator[Document]:
    """The documents of every row group of a Parquet file, in order, numbered by row from 1."""
    field = _parquet_field(extractor, path)
    try:
        footer = read_footer(path, field)
    except BadParquet as err:
        report(0, f"{err}; the file is skipped")
        return
    for group in footer.row_groups:
        for _, docs in _row_group_batches(footer, group, field, path, report, group.first_row + 1):
            yield from docs


def _parquet_field(extractor: _TextExtractor, path: str) -> str:
    """The text column of a Parquet file: where a preset or another kind of record is asked for
    instead (`read_json_records`), one line saying so."""
    if not isinstance(extractor, _TextExtractor):
        raise ConvertError(f"{path} is Parquet; this command reads JSON records (or CSV): convert it first")
    if extractor.preset is not None:
        raise ConvertError(
            f"{path} is Parquet, and --preset {extractor.preset.name} reads JSON records; "
            "name its text column with --field"
        )
    return extractor.text_field


def _row_group_batches(
    footer: Footer, group: RowGroup, field: str, source: str, report: _MalformedReporter,
    first: int | None,
) -> Iterator[tuple[int, list[Document]]]:  # fmt: skip
    """(rows, documents) of each record batch of one row group, the rows numbered on from `first`
    (None: each batch from 1). Nulls and bad UTF-8 are reported; corrupt data ends the row group
    with a report and a last batch of the rows left."""
    done = 0  # rows of the row group read
    try:
        for values in row_group_batches(footer, group):
            row = first + done if first is not None else 1
            docs = []
            for value in values:
                if type(value) is str:
                    docs.append(Document(value, source, row))
                elif value is None:
                    report(row, f"text field {field!r} is null")
                else:
                    report(row, _invalid_utf8(value))
                row += 1
            done += len(values)
            yield len(values), docs
    except BadParquet as err:
        report(first + done if first is not None else 1,
               f"{err} in row group {group.index}; the rest of the row group is skipped")  # fmt: skip
        yield group.rows - done, []


def _invalid_utf8(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the text)"
    return "invalid UTF-8"


@functools.lru_cache(maxsize=4)
def _worker_footer(path: str, size: int, field: str) -> Footer:
    """A worker's open Parquet file: its footer is read once for all the row groups it gets."""
    return read_footer(path, field, size)


def read_row_group(
    path: str, size: int, index: int, *, text_field: str | None
) -> Iterator[tuple[int, list[Document], ReadStats]]:
    """The documents of row group `index` of a Parquet file of `size` bytes, read as
    `read_documents` reads them (never strict), a record batch at a time: (rows, documents
    numbered by row from 1 in each batch, the batch's counts)."""
    field = text_field or DEFAULT_TEXT_FIELD
    report = _MalformedReporter(ReadStats(), False, path)
    try:
        footer = _worker_footer(path, size, field)
    except BadParquet as err:  # `row_groups` read it before: it changed since
        report(0, f"{err}; the row group is skipped")
        yield 0, [], report.stats
        return
    for rows, docs in _row_group_batches(footer, footer.row_groups[index], field, path, report, None):
        stats, report.stats = report.stats, ReadStats()  # the next batch reports into its own
        stats.documents += len(docs)
        yield rows, docs, stats


def row_groups(
    path: str, text_field: str | None, stats: ReadStats, size: int | None = None
) -> list[RowGroup]:
    """The row groups of a Parquet file of `size` bytes (its footer checked: the text column there
    and text); an unreadable file is counted as malformed in `stats` and gives none."""
    try:
        return list(read_footer(path, text_field or DEFAULT_TEXT_FIELD, size).row_groups)
    except BadParquet as err:
        stats.record_malformed(path, 0, f"{err}; the file is skipped")
        return []


_READERS = {"txt": _read_txt, "txt-blank": _read_txt_blank, "jsonl": _read_jsonl, "json": _read_json_list}


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _empty_corpus_error(paths: list[str], fmt: str, stats: ReadStats) -> ConvertError:
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    message = f"no documents found in {shown} (format {fmt})"
    if stats.malformed_examples:
        source, line, reason = stats.malformed_examples[0]
        message += f"; {stats.malformed} malformed, first at {source}:{line}: {reason}"
    return ConvertError(message + "; check the files, --format and --text-field/--preset")


# --- byte ranges: a line file cut at line ends (`byte_ranges`), each range read on its own ------
# (`read_range`) by the worker it goes to (convert/run/ranges.py)

RANGE_FORMATS = ("txt", "jsonl")  # a document never spans a line: any line boundary is a cut
_PROBE_BYTES = 1 << 16


def range_format(path: str, fmt: str, preset: str | None) -> str | None:
    """The format of `path` when workers can read it in pieces: byte ranges of a local,
    uncompressed file of one document or record per line, or the row groups of a Parquet file
    (local or S3); else None (read whole, in order, by one process)."""
    if is_parquet(path, fmt):
        return "parquet"
    if is_s3(path) or compression_of(path):
        return None
    preset_obj = get_preset(preset) if preset else None
    with open_binary(path) as stream:
        resolved = _resolve_format(path, fmt, preset_obj, stream)
    return resolved if resolved in RANGE_FORMATS else None


def byte_ranges(path: str, size: int, target: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte ranges of ~`target` bytes covering the file, each ending after a newline
    (or at the end of the file)."""
    with open(path, "rb") as f:
        start = 0
        while start < size:
            end = start + target
            if end >= size:
                yield start, size
                return
            f.seek(end - 1)  # a newline at end - 1 ends the range at `end`
            while True:
                piece = f.read(_PROBE_BYTES)
                if not piece:
                    end = size
                    break
                found = piece.find(b"\n")
                if found >= 0:
                    end = f.tell() - len(piece) + found + 1
                    break
            yield start, end
            start = end


def read_range(
    data: bytes, fmt: str, source: str, *, at_start: bool, text_field: str | None, preset: str | None,
    stats: ReadStats,
) -> Iterator[Document]:  # fmt: skip
    """The documents of `data`, whole lines of a `fmt` file, read as `read_documents` reads them
    (never strict). Line numbers count from 1 when `at_start` (the file's first byte), else
    from 2 (only a file's first line may start with a byte order mark): the caller shifts them."""
    extractor = _extractor(text_field, preset)
    report = _MalformedReporter(stats, False, source)
    for doc in _READERS[fmt](io.BytesIO(data), source, extractor, report, 1 if at_start else 2):
        stats.documents += 1
        yield doc


@functools.cache
def _extractor(text_field: str | None, preset: str | None) -> _TextExtractor:
    return _TextExtractor(get_preset(preset) if preset else None, text_field or DEFAULT_TEXT_FIELD)


def check_inputs(paths: list[str], fmt: str, text_field: str | None, preset: str | None = None) -> None:
    """Before anything is read or written: a ConvertError naming the extra when a file needs
    pyarrow (Parquet, zstd) and it is not installed, for Parquet with a preset, and for a text
    column that the first Parquet file lacks or holds as something else than text (`--field` is
    wrong, most likely)."""
    for path in paths:
        if compression(path).name == "zstd":
            pyarrow(f"reading zstd-compressed files ({path})")
    parquet_files = [path for path in paths if is_parquet(path, fmt)]
    if parquet_files:
        _parquet_field(_extractor(text_field, preset), parquet_files[0])
        try:
            read_footer(parquet_files[0], text_field or DEFAULT_TEXT_FIELD)
        except BadParquet:
            pass  # counted when it is read, as any unreadable file


def check_read(fmt: str, text_field: str | None, preset: str | None) -> None:
    """The checks of `read_documents`' options, on their own."""
    _check_options(fmt, text_field, get_preset(preset) if preset else None)


def empty_corpus_error(paths: list[str], fmt: str, stats: ReadStats) -> ConvertError:
    return _empty_corpus_error(paths, fmt, stats)
