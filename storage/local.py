"""Atomic writes to the local file system: a reader sees the old file or the new one, never half.

The new bytes go to a temporary file in the same folder (named for this process plus a random
part, so two writers never share it, not even two hosts with the same pid on a shared file
system), are flushed to disk, and replace the target with one `os.replace`; if the writer fails,
the temporary file is removed and the target is untouched. Python's standard library has no such
call (`pathlib.Path.write_bytes` truncates in place), and neither Composer nor streaming exposes
one.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TMP_MARK = ".tmp-"  # in the name of every temporary file written here (listings skip them)
_WRITER = re.compile(rf"^\..+{re.escape(TMP_MARK)}(\d+)-[0-9a-f]+$")


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *, fsync: bool = True) -> Iterator[IO]:
    """`with atomic_open(path, "w") as f:` writes `path` whole when the block ends, or not at all."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(temporary_name(target.name))
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as stream:
            yield stream
            if fsync:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    with atomic_open(path, "wb", fsync=fsync) as stream:
        stream.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_path(path) as tmp:` for a library that writes a file by name (safetensors'
    `save_file`): `tmp` is moved onto `path` when the block ends, or removed if it fails. The file
    gets the mode any new file gets here (0666 less the umask): safetensors 0.8 writes through a
    temporary file of its own, created 0600, which a serving container or another user cannot read."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(temporary_name(target.name))
    try:
        yield tmp
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def new_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the process's umask."""
    try:  # Linux says it; os.umask can only be read by setting it, which races other threads
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def temporary_name(name: str) -> str:
    """A hidden name beside `name` that no other writer uses (listings skip it)."""
    return f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    """A name written by `atomic_open` (or the older `.tmp` suffix) that is not a real file."""
    return TMP_MARK in name or name.endswith(".tmp")


def temporary_writer(name: str) -> int | None:
    """The pid of the process that named the temporary file `name` (`temporary_name`), else None."""
    match = _WRITER.match(name)
    return int(match.group(1)) if match else None
