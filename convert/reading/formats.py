"""What a corpus file's name says: its format, its compression, and whether it is a marker.

Formats (`--format`; `auto` guesses per file from the name, under any compression suffix):
  txt        .txt .text                  one document per non-empty line
  txt-blank  (never guessed)             documents separated by blank lines
  json       .json starting with `[`     a JSON list of records
  jsonl      .jsonl .ndjson .json-lines  one JSON record per line (and .json files that do not
                                          start with `[`: many corpora are JSON lines named .json)
  parquet    .parquet .pq                Parquet, its text column read alone

Compression is a property of the file, not of its format: a trailing .gz, .zst/.zstd, .bz2 or
.xz is decompressed on the fly (convert/reading/compression.py) and ignored when guessing.
Parquet compresses inside (its pages), so a compression suffix on a Parquet file is refused.

Markers are the files that tools leave beside a data set: Spark's `_SUCCESS` and `.crc` files,
`_metadata`, Hugging Face's README.md and dataset_info.json, locks and licences. A folder or
prefix expanded as a corpus skips them (convert/reading/sources.py), and a path under a folder
whose name starts with `_` or `.` (`_temporary/`, `_delta_log/`, `.cache/`) is a marker too.
"""

from __future__ import annotations

import re

FORMATS = ("txt", "txt-blank", "json", "jsonl", "parquet")
AUTO = "auto"
# Compression suffix -> the name used in messages (convert/reading/compression.py opens them).
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}
_EXTENSION_FORMATS = {
    ".txt": "txt",
    ".text": "txt",
    ".jsonl": "jsonl",
    ".json-lines": "jsonl",
    ".jsonlines": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",  # a list or lines: the first character decides (`guess_format`)
    ".parquet": "parquet",
    ".pq": "parquet",
}
# What a folder may mix: the formats of one kind read the same records (a .json beside a .jsonl).
KINDS = {"txt": "text", "txt-blank": "text", "json": "JSON", "jsonl": "JSON", "parquet": "Parquet"}
_MARKER_NAMES = re.compile(
    r"(readme|license|licence|notice|citation)(\.\w+)?|.*\.(crc|md|lock|py|sha256|md5)"
    r"|dataset_infos?\.json|dataset_dict\.json|state\.json|croissant\.json",
    re.IGNORECASE,
)


def compression_of(path: str) -> str | None:
    """The compression suffix of `path` (".gz", ".zst", ...), or None."""
    lowered = path.lower()
    return next((suffix for suffix in COMPRESSION_SUFFIXES if lowered.endswith(suffix)), None)


def without_compression(path: str) -> str:
    suffix = compression_of(path)
    return path[: -len(suffix)] if suffix else path


def format_from_name(path: str) -> str | None:
    """The format the name of `path` says (".json" says "json", a list or lines), or None."""
    name = without_compression(path).rsplit("/", 1)[-1]
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    return _EXTENSION_FORMATS.get(suffix)


def guess_format(path: str, head: bytes = b"") -> str | None:
    """The format "auto" picks for `path` whose first (decompressed) bytes are `head`; None if unknown."""
    fmt = format_from_name(path)
    if fmt == "json":
        return "json" if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[") else "jsonl"
    return fmt


def is_parquet(path: str, fmt: str) -> bool:
    """Whether `path` is read as Parquet under `--format fmt`."""
    guessed = fmt == AUTO and format_from_name(path) == "parquet" and compression_of(path) is None
    return fmt == "parquet" or guessed


def is_marker(relative: str) -> bool:
    """Whether a file at `relative` (its path under the folder or prefix given) is a marker."""
    parts = relative.strip("/").split("/")
    if any(part.startswith((".", "_")) for part in parts):
        return True
    return bool(_MARKER_NAMES.fullmatch(parts[-1]))
