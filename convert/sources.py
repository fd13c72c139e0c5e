"""Locate and open input files, on local disk or in S3-compatible object storage.

An input argument is one of:
  * a file;
  * a folder: every file under it, recursively, sorted (hidden files, `.name`, are skipped);
  * a glob: `corpus/*.jsonl`, `corpus/**/*.json` (`**` crosses folders);
  * the same under `s3://bucket/...`: an object key, a prefix (every object under `prefix/`, or
    failing that every key starting with `prefix`), or a glob matched against whole keys with
    fnmatch (there `*` also crosses `/`).

S3 goes through boto3 with `endpoint_url=$S3_ENDPOINT_URL` (unset: AWS itself), so MinIO, moto
or any S3-compatible server stands in for AWS.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import io
import os
from pathlib import Path
from typing import BinaryIO

from convert.errors import ConvertError

S3_SCHEME = "s3://"
# Big enough that a socket read is amortised over many lines, small enough to stay bounded.
_S3_READ_BUFFER = 1 << 20
_GLOB_CHARS = frozenset("*?[")


def is_s3(path: str) -> bool:
    return path.startswith(S3_SCHEME)


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
        matches = _expand_s3(pattern) if is_s3(pattern) else _expand_local(pattern)
        for path in matches:
            if path not in seen:
                seen.add(path)
                out.append(path)
    return out


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


def file_size(path: str) -> int:
    """Size in bytes of a local file or S3 object (for progress bars)."""
    if not is_s3(path):
        try:
            return os.path.getsize(path)
        except OSError as err:
            raise ConvertError(f"cannot read the size of input {path}: {err.strerror}") from err
    bucket, key = split_s3_url(path)
    response = _s3_call(lambda client: client.head_object(Bucket=bucket, Key=key), bucket, key)
    return int(response["ContentLength"])


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> (`bucket`, `some/key`)."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise ConvertError(f"{url}: an S3 input needs a bucket, e.g. s3://my-bucket/corpus/")
    return bucket, key


# --- local -------------------------------------------------------------------------------------


def _has_glob(pattern: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in pattern)


def _expand_local(pattern: str) -> list[str]:
    if _has_glob(pattern):
        found: list[str] = []
        for match in sorted(glob.glob(pattern, recursive=True)):
            found.extend(_files_under(match) if os.path.isdir(match) else [match])
        if not found:
            raise ConvertError(f"input pattern {pattern!r} matched no files; check the path and quoting")
        return found
    if os.path.isdir(pattern):
        found = _files_under(pattern)
        if not found:
            raise ConvertError(f"input folder {pattern} contains no files")
        return found
    if os.path.isfile(pattern):
        return [pattern]
    raise ConvertError(f"input {pattern} does not exist (not a file, folder, glob or s3:// URL)")


def _files_under(folder: str) -> list[str]:
    """Every non-hidden file below `folder`, sorted by path."""
    files = []
    for path in Path(folder).rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files.append(str(path))
    return sorted(files)


# --- S3 ----------------------------------------------------------------------------------------


def _expand_s3(pattern: str) -> list[str]:
    bucket, key = split_s3_url(pattern)
    if _has_glob(key):
        # List only the literal part before the first wildcard, then match whole keys.
        literal = key[: min(key.index(ch) for ch in _GLOB_CHARS if ch in key)]
        keys = [k for k in _list_keys(bucket, literal) if fnmatch.fnmatchcase(k, key)]
    elif key and not key.endswith("/") and _object_exists(bucket, key):
        keys = [key]
    else:
        folder = key if not key or key.endswith("/") else key + "/"
        keys = _list_keys(bucket, folder) or (_list_keys(bucket, key) if folder != key else [])
    if not keys:
        raise ConvertError(
            f"input {pattern!r} matched no objects in bucket {bucket!r} at {_endpoint_name()}; "
            "check the prefix or glob"
        )
    return [f"{S3_SCHEME}{bucket}/{k}" for k in sorted(keys)]


def _list_keys(bucket: str, prefix: str) -> list[str]:
    def list_all(client) -> list[str]:
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            # Keys ending in "/" are folder markers some tools create, not files.
            keys.extend(obj["Key"] for obj in page.get("Contents", []) if not obj["Key"].endswith("/"))
        return keys

    return _s3_call(list_all, bucket, prefix)


def _object_exists(bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        _s3_call(lambda client: client.head_object(Bucket=bucket, Key=key), bucket, key, raw=True)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchKey", "NotFound"):
            return False
        # A HEAD on a missing bucket also answers 404 on some servers; let the listing decide.
        raise _s3_error(err, bucket, key) from err
    return True


def _endpoint_name() -> str:
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    return f"endpoint {endpoint} (S3_ENDPOINT_URL)" if endpoint else "the AWS default endpoint"


@functools.lru_cache(maxsize=8)
def _client(endpoint: str | None, pid: int):
    """One boto3 client per endpoint and process (clients must not cross a fork)."""
    import boto3
    from botocore.config import Config

    # Few retries and short timeouts: a wrong endpoint should fail in seconds, not minutes.
    config = Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=60)
    return boto3.client("s3", endpoint_url=endpoint, config=config)


def s3_client():
    return _client(os.environ.get("S3_ENDPOINT_URL"), os.getpid())


def _s3_call(fn, bucket: str, key: str, *, raw: bool = False):
    """Run `fn(client)`, turning S3 failures into one ConvertError (unless raw ClientError wanted)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(s3_client())
    except ClientError as err:
        if raw:
            raise
        raise _s3_error(err, bucket, key) from err
    except BotoCoreError as err:
        raise _s3_error(err, bucket, key) from err


def _s3_error(err: Exception, bucket: str, key: str) -> ConvertError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    where = f"s3://{bucket}/{key} at {_endpoint_name()}"
    if isinstance(err, NoCredentialsError):
        return ConvertError(f"{where}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(err, EndpointConnectionError):
        return ConvertError(f"cannot reach {_endpoint_name()} for bucket {bucket!r}; check S3_ENDPOINT_URL")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return ConvertError(
                f"bucket {bucket!r} does not exist at {_endpoint_name()}; create it or fix the URL"
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return ConvertError(f"{where}: no such object")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return ConvertError(f"{where}: access denied ({code}); check the AWS credentials")
        return ConvertError(f"{where}: S3 error {code}: {err}")
    return ConvertError(f"{where}: {err}")


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
