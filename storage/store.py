"""A folder of files, on this machine or under `s3://bucket/prefix`, behind one interface.

Paths given to a store are relative to its root, with `/` separators. Writes are atomic on both
sides (a local temporary file renamed into place; a single S3 PUT), so a reader sees the old
bytes or the new ones; one small file can also be replaced compare-and-swap (`write_if`: an S3
conditional PUT, locally a write under `flock`), which the run lock (`llm.checkpoint.lock`) needs.
Reads of an absent file return None; every other failure raises
`StorageError`. Used for checkpoints (`llm.checkpoint`), shards and summaries (`convert`) and
the one-shot reads of shard metadata and weights (`read_url`, `download_url`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import storage.s3 as s3
from storage.errors import StorageError
from storage.local import TMP_MARK, atomic_write_bytes, is_temporary, temporary_name, temporary_writer
from storage.scratch import pid_alive

GUARD_WAIT_S = 30.0  # how long a compare-and-swap on a local folder waits for another's to end


def guard_file(target: Path) -> Path:
    """The hidden side file whose `flock` serialises compare-and-swaps on `target`; it exists only
    while a swap runs (the holder removes it before letting go)."""
    return target.with_name(f".{target.name}{TMP_MARK}guard")


def _lock_guard(target: Path, side: Path):
    """`side` opened and exclusively locked, and still the file at that path (see LocalStore._guard)."""
    deadline = time.monotonic() + GUARD_WAIT_S
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle = open(side, "a")
        except OSError as err:
            raise StorageError(f"writing {target}: {err.strerror or err}") from err
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if time.monotonic() > deadline:
                raise StorageError(
                    f"writing {target}: {side} has been locked by another process for over "
                    f"{GUARD_WAIT_S:.0f} s (one stopped or frozen mid-write); end that process"
                ) from None
            time.sleep(0.01)
            continue
        held = os.fstat(handle.fileno())
        try:
            current = os.stat(side)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_ino, current.st_dev) == (held.st_ino, held.st_dev):
            return handle
        handle.close()  # the previous holder removed it after we opened it: lock the new one


def open_store(root: str | os.PathLike) -> Store:
    """A store for a local folder or an `s3://bucket/prefix`."""
    root = str(root)
    if s3.is_remote(root):
        bucket, prefix = s3.split_s3_url(root)
        return S3Store(bucket, prefix.strip("/"))
    if "://" in root:
        raise StorageError(f"{root!r}: only local folders and s3://bucket/prefix are supported")
    return LocalStore(root)


def join(root: str, name: str) -> str:
    """`root/name` for a local folder or an S3 prefix."""
    return f"{root.rstrip('/')}/{name}" if s3.is_remote(root) else str(Path(root) / name)


def read_url(url: str) -> bytes:
    """The bytes of one local file or S3 object; StorageError (`missing=True`) if it is absent."""
    parent, _, name = str(url).rstrip("/").rpartition("/")
    data = open_store(parent or ".").read_bytes(name)
    if data is None:
        raise StorageError(f"{url} does not exist", missing=True)
    return data


def download_url(url: str, local: str | os.PathLike, *, read_timeout: float | None = None) -> Path:
    """Copy one S3 object to `local` (a local path is returned as it is, nothing copied);
    `read_timeout` replaces LLM_S3_READ_TIMEOUT for it."""
    if not s3.is_remote(url):
        if not os.path.isfile(url):
            raise StorageError(f"{url} does not exist", missing=True)
        return Path(url)
    parent, _, name = url.rpartition("/")
    bucket, prefix = s3.split_s3_url(parent)
    S3Store(bucket, prefix).download(name, local, read_timeout=read_timeout)
    return Path(local)


class Store:
    """Files under one root, addressed by relative path."""

    root: str
    is_remote: bool

    def url(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root

    # Implemented by both stores.
    def check_writable(self) -> None: ...
    def size(self, rel: str) -> int | None: ...
    def read_bytes(self, rel: str) -> bytes | None: ...
    def read_range(self, rel: str, start: int, end: int) -> bytes | None:
        """Bytes `start` to `end` (exclusive) of a file (`end` within it), None if it is absent."""

    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def upload(self, local: str | os.PathLike, rel: str) -> None: ...
    def download(self, rel: str, local: str | os.PathLike, *, read_timeout: float | None = None) -> None: ...
    def list(self, prefix: str = "") -> dict[str, int]: ...
    def list_dirs(self, rel: str = "") -> list[str]:
        """The sub-folders of `rel`. On SeaweedFS a folder whose files were all deleted is still
        named (AWS and moto drop it): read a folder's marker file before taking it as written."""

    def delete(self, rels: list[str]) -> None: ...
    def delete_tree(self, rel: str) -> None: ...
    def remove_stale_temporaries(self, rel: str = "") -> list[str]:
        """Remove the temporary files of killed writers directly in folder `rel`; returns them."""
        return []  # S3: a PUT is stored whole or not at all, nothing is left behind

    # Compare-and-swap on one small file (the run lock): a version is an opaque string (an S3
    # ETag; a local file's SHA-256) that changes with every write.
    def read_versioned(self, rel: str) -> tuple[bytes, str] | None: ...
    def write_if(self, rel: str, data: bytes, expected: str | None) -> str | None:
        """Write `data` only if the file is at version `expected` (None: only if it is absent).

        Returns the new version, or None when another writer changed the file first (or removed
        it). Creating (`expected=None`) is exclusive on every store: of writers racing, one wins.
        Replacing is exclusive locally and on AWS, but SeaweedFS 4.48 and moto check `If-Match`
        and write in two steps, so two writers replacing one version can both get a version: a
        caller that needs one winner claims the version first by creating a file named for it
        (the run lock's takeover, `llm/checkpoint/lock.py`).
        """

    def delete_if(self, rel: str, expected: str) -> bool:
        """Delete the file only if it is still at version `expected`; False if it changed."""

    def exists(self, rel: str) -> bool:
        return self.size(rel) is not None

    def read_text(self, rel: str) -> str | None:
        data = self.read_bytes(rel)
        return None if data is None else data.decode("utf-8")

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def read_json(self, rel: str) -> Any:
        """The parsed file, or None when it is absent or not JSON (a torn or foreign file)."""
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


class LocalStore(Store):
    """A folder on this machine (or a shared file system)."""

    is_remote = False

    def __init__(self, root: str | os.PathLike):
        self.root = str(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def path(self, rel: str = "") -> Path:
        return Path(self.root) / rel if rel else Path(self.root)

    def check_writable(self) -> None:
        root = self.path()
        if root.exists() and not root.is_dir():
            raise StorageError(f"{root} is a file; give a folder")
        existing = next(p for p in [root.absolute(), *root.absolute().parents] if p.exists())
        if not existing.is_dir():
            raise StorageError(f"{root}: {existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StorageError(f"{root}: folder {existing} is not writable by this user")

    def size(self, rel: str) -> int | None:
        try:
            return self.path(rel).stat().st_size
        except OSError:
            return None

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.path(rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            raise StorageError(f"reading {self.path(rel)}: {err.strerror or err}") from err

    def read_range(self, rel: str, start: int, end: int) -> bytes | None:
        try:
            with open(self.path(rel), "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            raise StorageError(f"reading {self.path(rel)}: {err.strerror or err}") from err

    def write_bytes(self, rel: str, data: bytes) -> None:
        try:
            atomic_write_bytes(self.path(rel), data)
        except OSError as err:
            raise StorageError(f"writing {self.path(rel)}: {err.strerror or err}") from err

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        target = self.path(rel)
        if Path(local).resolve() == target.resolve():
            return  # already in place
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(temporary_name(target.name))
            try:
                shutil.copyfile(local, tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as err:
            raise StorageError(f"copying {local} to {target}: {err.strerror or err}") from err

    def download(self, rel: str, local: str | os.PathLike, *, read_timeout: float | None = None) -> None:
        try:
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path(rel), local)
        except FileNotFoundError as err:
            raise StorageError(f"{self.path(rel)} does not exist", missing=True) from err
        except OSError as err:
            raise StorageError(f"copying {self.path(rel)} to {local}: {err.strerror or err}") from err

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        data = self.read_bytes(rel)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def write_if(self, rel: str, data: bytes, expected: str | None) -> str | None:
        with self._guard(rel):
            current = self.read_versioned(rel)
            if (current[1] if current else None) != expected:
                return None
            self.write_bytes(rel, data)
        return hashlib.sha256(data).hexdigest()

    def delete_if(self, rel: str, expected: str) -> bool:
        with self._guard(rel):
            current = self.read_versioned(rel)
            if current is None or current[1] != expected:
                return False
            self.delete([rel])
        return True

    @contextlib.contextmanager
    def _guard(self, rel: str):
        """An exclusive `flock` on a hidden side file: one compare-and-swap at a time, across
        processes (and hosts, on a file system whose locks cross them, e.g. NFSv4).

        A swap holds it for milliseconds; a process stopped or frozen inside one would hold it for
        good, so after GUARD_WAIT_S the caller gets a StorageError naming the file, not a hang."""
        target = self.path(rel)
        side = guard_file(target)
        handle = _lock_guard(target, side)
        try:
            yield
        finally:
            # Removed while still held: nothing stays behind in the folder. A process that opened
            # it meanwhile finds the file at `side` is no longer the one it locked, and starts over.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(side)
            handle.close()

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.path(prefix)
        if not base.is_dir():
            return {}
        return {
            p.relative_to(self.root).as_posix(): p.stat().st_size
            for p in base.rglob("*")
            if p.is_file() and not is_temporary(p.name)
        }

    def list_dirs(self, rel: str = "") -> list[str]:
        path = self.path(rel)
        if not path.is_dir():
            return []
        return sorted(p.name for p in path.iterdir() if p.is_dir())

    def delete(self, rels: list[str]) -> None:
        for rel in rels:
            self.path(rel).unlink(missing_ok=True)

    def delete_tree(self, rel: str) -> None:
        path = self.path(rel)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def remove_stale_temporaries(self, rel: str = "") -> list[str]:
        """A writer killed mid-write (SIGKILL, a lost machine) leaves its temporary file behind
        (`atomic_open` removes it in every other case), as large as the file it was writing. Those
        whose writer no longer runs here go; a live writer's stay. A writer on another host of a
        shared file system looks dead here: no two processes write one folder from two hosts."""
        folder, removed = self.path(rel), []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(folder):
                pid = temporary_writer(entry.name)
                if pid is not None and entry.is_file(follow_symlinks=False) and not pid_alive(pid):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    removed.append(entry.path)
        return removed


class S3Store(Store):
    """A prefix in an S3 bucket, through the one client of `storage.s3`."""

    is_remote = True

    def __init__(self, bucket: str, prefix: str = ""):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.root = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    def __repr__(self) -> str:
        return f"S3Store({self.root!r})"

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _call(self, operation: str, rel: str, fn):
        return s3.call(operation, self.url(rel), fn)

    def check_writable(self) -> None:
        """Fail before any work when the bucket is missing or the endpoint does not answer."""
        try:
            self._call("checking the bucket of", "", lambda c: c.head_bucket(Bucket=self.bucket))
        except StorageError as err:
            if err.missing:  # HEAD has no body: a missing bucket answers a bare 404
                where = f"checking the bucket of {self.root} at {s3.endpoint_name()}"
                raise s3.no_bucket_error(where, self.bucket) from None
            raise

    def size(self, rel: str) -> int | None:
        try:
            head = self._call(
                "reading the size of", rel, lambda c: c.head_object(Bucket=self.bucket, Key=self.key(rel))
            )
        except StorageError as err:
            if err.missing:
                return None
            raise
        return int(head["ContentLength"])

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self._call(
                "reading", rel, lambda c: c.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read()
            )
        except StorageError as err:
            if err.missing:
                return None
            raise

    def read_range(self, rel: str, start: int, end: int) -> bytes | None:
        if end <= start:
            return b"" if self.size(rel) is not None else None
        request = {"Bucket": self.bucket, "Key": self.key(rel), "Range": f"bytes={start}-{end - 1}"}
        try:
            return self._call("reading", rel, lambda c: c.get_object(**request)["Body"].read())
        except StorageError as err:
            if err.missing:
                return None
            raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._call("writing", rel, lambda c: c.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data))

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        self._call(
            "uploading to",
            rel,
            lambda c: c.upload_file(str(local), self.bucket, self.key(rel), Config=s3.transfer_config()),
        )

    def download(self, rel: str, local: str | os.PathLike, *, read_timeout: float | None = None) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        s3.call(
            "downloading",
            self.url(rel),
            lambda c: c.download_file(self.bucket, self.key(rel), str(local), Config=s3.transfer_config()),
            read_timeout=read_timeout,
        )

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        def get(client):
            answer = client.get_object(Bucket=self.bucket, Key=self.key(rel))
            return answer["Body"].read(), answer["ETag"]

        try:
            return self._call("reading", rel, get)
        except StorageError as err:
            if err.missing:
                return None
            raise

    def write_if(self, rel: str, data: bytes, expected: str | None) -> str | None:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        return self._conditional(
            "writing",
            rel,
            lambda c: c.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data, **condition)["ETag"],
        )

    def delete_if(self, rel: str, expected: str) -> bool:
        def delete(client):
            client.delete_object(Bucket=self.bucket, Key=self.key(rel), IfMatch=expected)
            return True

        return bool(self._conditional("deleting", rel, delete))

    def _conditional(self, operation: str, rel: str, fn):
        """`fn(client)`, or None when S3 answers that the condition failed: 412, 409 for a
        concurrent conditional write, or 404 for an `If-Match` on a file that is gone (AWS and
        moto answer NoSuchKey there, SeaweedFS 412)."""

        def attempt(client):
            try:
                return fn(client)
            except Exception as err:
                if s3.error_code(err) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                    return None
                if s3.is_missing(err):
                    return None
                raise

        return self._call(operation, rel, attempt)

    def _objects(self, prefix: str, delimiter: str | None = None):
        def pages(client):
            kwargs = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            return list(client.get_paginator("list_objects_v2").paginate(**kwargs))

        return s3.call("listing", f"s3://{self.bucket}/{prefix}", pages)

    def list(self, prefix: str = "") -> dict[str, int]:
        start = self.key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        cut = len(self.prefix) + 1 if self.prefix else 0
        return {
            obj["Key"][cut:]: obj["Size"]
            for page in self._objects(start)
            for obj in page.get("Contents", [])
            if not obj["Key"].endswith("/")
        }

    def list_dirs(self, rel: str = "") -> list[str]:
        prefix = self.key(rel).rstrip("/") + "/" if (rel or self.prefix) else ""
        names = {
            p["Prefix"][len(prefix) :].rstrip("/")
            for page in self._objects(prefix, delimiter="/")
            for p in page.get("CommonPrefixes", [])
        }
        return sorted(names)

    def delete(self, rels: list[str]) -> None:
        for start in range(0, len(rels), 1000):
            chunk = [{"Key": self.key(r)} for r in rels[start : start + 1000]]
            self._call(
                "deleting under",
                "",
                lambda c, chunk=chunk: c.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True}
                ),
            )

    def delete_tree(self, rel: str) -> None:
        keys = [rel] if rel and self.exists(rel) else []
        keys += self.list(rel.rstrip("/") + "/" if rel else "")  # names relative to the root
        self.delete(sorted(set(keys)))
