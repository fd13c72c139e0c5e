"""Locate and open input files, on local disk or in S3-compatible object storage.

An input argument is one of:
  * a file;
  * a folder: every file under it, recursively, sorted (hidden files, `.name`, are skipped);
  * a glob: `corpus/*.jsonl`, `corpus/**/*.json` (`**` crosses folders);
  * the same under `s3://bucket/...`: an object key, a prefix (every object under `prefix/`, or
    failing that every key starting with `prefix`), or a glob matched against whole keys with
    fnmatch (there `*` also crosses `/`).

A corpus (`expand_corpus`: the `shards` and `tokenizer` commands) takes from a folder, prefix or
glob only the files of a corpus format (convert/reading/formats.py), in the same sorted order:
markers and metadata (`_SUCCESS`, `.crc`, README.md, dataset_info.json, anything under `_name/`
or `.name/`) are skipped and counted, and a folder that mixes formats (Parquet beside JSON lines)
is refused unless `--format` says which to take. So a Hugging Face Hub snapshot
(`data/train-00000-of-00042.parquet`, configs as subfolders) or a Spark output folder
(`part-*.parquet` beside `_SUCCESS`) is named as it is. A file named on its own is always taken.

S3 goes through the project's storage layer (`storage.s3`: `S3_ENDPOINT_URL`, timeouts, one retry
policy); its errors become one ConvertError here. `open_ranged` reads an object as a seekable
file, one ranged GET per read (Parquet's footer and column chunks).
"""

from __future__ import annotations

import fnmatch
import glob
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import storage
from convert.errors import ConvertError
from convert.reading.formats import AUTO, COMPRESSION_SUFFIXES, KINDS, format_from_name, is_marker
from storage import StorageError

S3_SCHEME = "s3://"
# Big enough that a socket read is amortised over many lines, small enough to stay bounded.
_S3_READ_BUFFER = 1 << 20
_GLOB_CHARS = frozenset("*?[")


is_s3 = storage.is_remote


def expand_inputs(inputs: list[str]) -> list[str]:
    """Expand files, folders, globs and S3 prefixes into a de-duplicated list of paths/URLs.

    Each argument's matches are sorted; arguments keep the order they were given in, and a path
    matched twice is kept at its first place. An argument that matches nothing raises.
    """
    if not inputs:
        raise ConvertError("no input given: name at least one file, folder, glob or s3:// prefix")
    out: list[str] = []
    seen: set[str] = set()
    for pattern in inputs:
        listed = _listed_s3(pattern) if is_s3(pattern) else _listed_local(pattern, hidden=False)
        for path, _ in listed:
            if path not in seen:
                seen.add(path)
                out.append(path)
    return out


@dataclass(frozen=True)
class CorpusFiles:
    paths: list[str]
    notes: list[str]  # per input that skipped files: a line that counts and names them


def expand_corpus(inputs: list[str], fmt: str) -> CorpusFiles:
    """The corpus files of `inputs` read as `fmt` (a format or "auto"), as `expand_inputs` orders
    them, with a folder's, prefix's or glob's markers and files of other formats skipped (see the
    module docstring). Raises a ConvertError for an input that mixes formats `fmt` does not choose
    between, or that leaves nothing to read."""
    if not inputs:
        raise ConvertError("no input given: name at least one file, folder, glob or s3:// prefix")
    out: list[str] = []
    seen: set[str] = set()
    notes: list[str] = []
    for pattern in inputs:
        listed = _listed_s3(pattern) if is_s3(pattern) else _listed_local(pattern, hidden=True)
        taken, note = _corpus_files(pattern, listed, fmt)
        notes += [note] if note else []
        for path in taken:
            if path not in seen:
                seen.add(path)
                out.append(path)
    return CorpusFiles(paths=out, notes=notes)


def _corpus_files(pattern: str, listed: list[tuple[str, str | None]], fmt: str) -> tuple[list[str], str]:
    """The files to read of one input's listing ((path, path under the input, None for a file
    named on its own)), and a line about those skipped ("" if none)."""
    markers = [path for path, rel in listed if rel is not None and is_marker(rel)]
    rest = [path for path, rel in listed if rel is None or not is_marker(rel)]
    if len(rest) == 1 and listed == [(rest[0], None)]:
        return rest, ""
    kinds: dict[str, list[str]] = {}
    for path in rest:
        named = format_from_name(path)
        if named is not None:
            kinds.setdefault(KINDS[named], []).append(path)
    wanted = KINDS.get(fmt)
    if len(kinds) > 1 and wanted not in kinds:
        counts = ", ".join(f"{len(paths)} {kind}" for kind, paths in kinds.items())
        choices = " or ".join(f"--format {_FORMAT_OF_KIND[kind]}" for kind in kinds)
        raise ConvertError(
            f"input {pattern} mixes formats ({counts} files); pass {choices} to take one of them"
        )
    if fmt != AUTO and len(kinds) <= 1:
        taken = rest  # one format (or none known) and --format given: every file, read as that format
    else:
        taken = kinds.get(wanted if fmt != AUTO else next(iter(kinds), ""), [])
    chosen = set(taken)
    others = [path for path in rest if path not in chosen]
    if not taken:
        raise ConvertError(
            f"input {pattern} holds nothing readable: {_skipped(markers, others) or 'no files'}; corpus "
            f"files end in {', '.join(_CORPUS_SUFFIXES)} (compressed too: {', '.join(COMPRESSION_SUFFIXES)}), "
            "or pass --format to read every file as one format"
        )
    skipped = _skipped(markers, others)
    return taken, f"input {pattern}: {len(taken)} file(s) to read, {skipped}" if skipped else ""


_FORMAT_OF_KIND = {"text": "txt", "JSON": "jsonl", "Parquet": "parquet"}
_CORPUS_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def _skipped(markers: list[str], others: list[str]) -> str:
    """ "N skipped: M marker or metadata file(s) (names), K of no format read here (names)"."""
    groups = [(markers, "marker or metadata file(s)"), (others, "of another or unknown format")]
    parts = [f"{len(paths)} {what} ({_names(paths)})" for paths, what in groups if paths]
    return f"{len(markers) + len(others)} skipped: " + ", ".join(parts) if parts else ""


def _names(paths: list[str], shown: int = 3) -> str:
    names = [path.rstrip("/").rsplit("/", 1)[-1] for path in paths[:shown]]
    return ", ".join(names) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


# Files a conversion writes under --out (shards/FORMAT.md), for `refuse_output_among_inputs`.
_OUTPUT_SAMPLES = (
    "summary.json",
    "train/index.json",
    "train/meta.json",
    "train/part-00000/index.json",
    "train/part-00000/shard.00000.mds.zstd",
    "val/index.json",
    "val/meta.json",
)


def refuse_output_among_inputs(inputs: list[str], out: str) -> None:
    """ConvertError if an input (a folder, an S3 prefix or a glob) takes in what is written to `out`:
    run again, the conversion would read its own shards' index.json and meta.json as corpus text.
    Decided from the names alone, before anything is listed or read."""
    for pattern in inputs:
        if _takes_in(pattern, out):
            raise ConvertError(
                f"--out {out} lies inside the input {pattern}: a conversion of that input would read "
                "the shards' own index.json and meta.json as text; choose an --out outside the inputs"
            )


def _takes_in(pattern: str, out: str) -> bool:
    if is_s3(pattern) != is_s3(out):
        return False
    if is_s3(pattern):
        (bucket, key), (out_bucket, out_key) = split_s3_url(pattern), split_s3_url(out)
        outputs = [f"{out_key.strip('/')}/{rel}".lstrip("/") for rel in _OUTPUT_SAMPLES]
        if bucket != out_bucket:
            return False
        if _has_glob(key):
            return any(fnmatch.fnmatchcase(k, key) for k in outputs)
        folder = key if not key or key.endswith("/") else key + "/"
        return any(k.startswith(folder) for k in outputs)
    if not _has_glob(pattern):
        return os.path.isdir(pattern) and Path(out).resolve().is_relative_to(Path(pattern).resolve())
    # A glob takes in the files it matches and everything under a folder it matches.
    regex = _glob_regex(os.path.abspath(pattern))
    written = [Path(os.path.abspath(out), rel) for rel in _OUTPUT_SAMPLES]
    return any(regex.fullmatch(str(p)) for path in written for p in (path, *path.parents))


def _glob_regex(pattern: str) -> re.Pattern:
    """`glob.glob(pattern, recursive=True)`'s matching as a regex (`*` stays within a folder)."""
    parts, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] in "*?":
            parts.append("[^/]*" if pattern[i] == "*" else "[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            parts.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts))


def input_sizes(paths: list[str]) -> list[int]:
    """The size in bytes of each expanded input (a stat locally, a HEAD request on S3)."""
    sizes = []
    for path in paths:
        if not is_s3(path):
            try:
                sizes.append(os.path.getsize(path))
            except OSError as err:
                raise ConvertError(f"cannot read the size of input {path}: {err.strerror}") from err
            continue
        bucket, key = split_s3_url(path)
        head = _s3_call(lambda client, b=bucket, k=key: client.head_object(Bucket=b, Key=k), bucket, key)
        sizes.append(int(head["ContentLength"]))
    return sizes


def open_binary(path: str) -> BinaryIO:
    """Open a local file or stream an S3 object (read in 1 MiB buffers, never whole)."""
    if not is_s3(path):
        try:
            return open(path, "rb")
        except OSError as err:
            raise ConvertError(f"cannot open input {path}: {err.strerror}") from err
    bucket, key = split_s3_url(path)
    response = _s3_call(lambda client: client.get_object(Bucket=bucket, Key=key), bucket, key)
    return io.BufferedReader(_StreamingBodyReader(response["Body"]), buffer_size=_S3_READ_BUFFER)


def open_ranged(path: str, size: int | None = None) -> BinaryIO:
    """An S3 object as a seekable file whose every read is one ranged GET (`size`: its length,
    if known; else one HEAD request asks)."""
    bucket, key = split_s3_url(path)
    if size is None:
        size = input_sizes([path])[0]
    return _RangedObject(bucket, key, size)


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> (`bucket`, `some/key`)."""
    try:
        return storage.split_s3_url(url)
    except StorageError:
        raise ConvertError(f"{url}: an S3 input needs a bucket, e.g. s3://my-bucket/corpus/") from None


# --- local -------------------------------------------------------------------------------------


def _has_glob(pattern: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in pattern)


def _listed_local(pattern: str, hidden: bool) -> list[tuple[str, str | None]]:
    """The files of a local input, sorted, each with its path under the folder (or the glob's
    folder) it was found in; None for an input that is that file. `hidden`: files under `.name`
    too (a corpus counts them as markers)."""
    if _has_glob(pattern):
        base = os.path.dirname(pattern[: min(pattern.index(ch) for ch in _GLOB_CHARS if ch in pattern)])
        found = []
        for match in sorted(glob.glob(pattern, recursive=True)):
            for path in _files_under(match, hidden) if os.path.isdir(match) else [match]:
                found.append((path, os.path.relpath(path, base or ".")))
        if not found:
            raise ConvertError(f"input pattern {pattern!r} matched no files; check the path and quoting")
        return found
    if os.path.isdir(pattern):
        found = [(path, os.path.relpath(path, pattern)) for path in _files_under(pattern, hidden)]
        if not found:
            raise ConvertError(f"input folder {pattern} contains no files")
        return found
    if os.path.isfile(pattern):
        return [(pattern, None)]
    raise ConvertError(f"input {pattern} does not exist (not a file, folder, glob or s3:// URL)")


def _files_under(folder: str, hidden: bool) -> list[str]:
    """Every file below `folder` (`hidden`: also those with a `.name` on their way), sorted by path."""
    files = []
    for path in Path(folder).rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and (hidden or not any(part.startswith(".") for part in relative.parts)):
            files.append(str(path))
    return sorted(files)


# --- S3 ----------------------------------------------------------------------------------------


def _listed_s3(pattern: str) -> list[tuple[str, str | None]]:
    """The objects of an S3 input, sorted by key, each with its key under the prefix (or the glob's
    folder); None for an input that is that object."""
    bucket, key = split_s3_url(pattern)
    if _has_glob(key):
        # List only the literal part before the first wildcard, then match whole keys.
        literal = key[: min(key.index(ch) for ch in _GLOB_CHARS if ch in key)]
        base = literal[: literal.rfind("/") + 1]
        keys = [k for k in _list_keys(bucket, literal) if fnmatch.fnmatchcase(k, key)]
    elif key and not key.endswith("/") and _object_exists(bucket, key):
        return [(f"{S3_SCHEME}{bucket}/{key}", None)]
    else:
        base = key if not key or key.endswith("/") else key + "/"
        keys = _list_keys(bucket, base)
        if not keys and base != key:  # every key starting with the prefix
            base = key[: key.rfind("/") + 1]
            keys = _list_keys(bucket, key)
    if not keys:
        raise ConvertError(
            f"input {pattern!r} matched no objects in bucket {bucket!r} at {storage.s3.endpoint_name()}; "
            "check the prefix or glob"
        )
    return [(f"{S3_SCHEME}{bucket}/{k}", k[len(base) :]) for k in sorted(keys)]


def _list_keys(bucket: str, prefix: str) -> list[str]:
    def list_all(client) -> list[str]:
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            # Keys ending in "/" are folder markers some tools create, not files.
            keys.extend(obj["Key"] for obj in page.get("Contents", []) if not obj["Key"].endswith("/"))
        return keys

    return _s3_call(list_all, bucket, prefix)


def _object_exists(bucket: str, key: str) -> bool:
    url = f"{S3_SCHEME}{bucket}/{key}"
    try:
        storage.s3.call("reading", url, lambda client: client.head_object(Bucket=bucket, Key=key))
    except StorageError as err:
        if err.missing:
            return False
        # A HEAD on a missing bucket also answers 404 on some servers; let the listing decide.
        raise ConvertError(str(err)) from err
    return True


def _s3_call(fn, bucket: str, key: str):
    """Run `fn(client)` through the storage layer, its failure as one ConvertError."""
    try:
        return storage.s3.call("reading", f"{S3_SCHEME}{bucket}/{key}", fn)
    except StorageError as err:
        raise ConvertError(str(err)) from err


class _StreamingBodyReader(io.RawIOBase):
    """Adapts botocore's StreamingBody to a raw stream so io.BufferedReader can wrap it."""

    def __init__(self, body) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self._body.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class _RangedObject(io.RawIOBase):
    """An S3 object as a seekable raw file: each `read` is one ranged GET through the storage layer."""

    def __init__(self, bucket: str, key: str, size: int) -> None:
        self._bucket, self._key, self._size, self._pos = bucket, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        request = {"Bucket": self._bucket, "Key": self._key, "Range": f"bytes={self._pos}-{end - 1}"}
        data = _s3_call(lambda client: client.get_object(**request)["Body"].read(), self._bucket, self._key)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
