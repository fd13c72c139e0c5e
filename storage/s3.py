"""The S3 client every module uses: one endpoint rule, timeouts always set, one retry policy.

The endpoint is `S3_ENDPOINT_URL` (unset: AWS itself), so MinIO, moto or any S3-compatible
server stands in for AWS; credentials come from the usual `AWS_*` variables. The policy is read
from the environment each time a client is made:

  LLM_S3_MAX_ATTEMPTS     attempts per request, the first included (default 5)
  LLM_S3_CONNECT_TIMEOUT  seconds to open a connection (default 5)
  LLM_S3_READ_TIMEOUT     seconds to wait for any byte of an answer (default 60)

so a request gives up after at most about attempts x (connect or read timeout) plus botocore's
backoff (at most 20 s between attempts): under 6 minutes with the defaults, seconds in the tests.
A server that accepts connections and never answers (a frozen endpoint) therefore ends in a
`StorageError`, never a hang.

Why not a library's client: Composer's `S3ObjectStore` lives behind `import composer` (about 12 s,
too slow for the converter's processes and `--help`) and has no delete, no listing with sizes and
no atomic local counterpart; streaming's one-shot download builds a new client per call with
no connect timeout. botocore's own "standard" retry mode does the retrying here; this module
only fixes its settings in one place and turns its many exception types into one message.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from storage.errors import StorageError

S3_SCHEME = "s3://"
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_DENIED_CODES = frozenset({"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5
    connect_timeout: float = 5.0
    read_timeout: float = 60.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        def number(name: str, default: float, kind=float):
            raw = os.environ.get(name)
            if raw in (None, ""):
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise StorageError(
                    f"{name}={raw!r} is not a number; unset it or give e.g. {default}"
                ) from None
            if value <= 0:
                raise StorageError(f"{name}={raw!r} must be positive")
            return value

        return cls(
            max_attempts=number("LLM_S3_MAX_ATTEMPTS", cls.max_attempts, int),
            connect_timeout=number("LLM_S3_CONNECT_TIMEOUT", cls.connect_timeout),
            read_timeout=number("LLM_S3_READ_TIMEOUT", cls.read_timeout),
        )

    def describe(self) -> str:
        return (
            f"{self.max_attempts} attempts, {self.connect_timeout:g}s connect / {self.read_timeout:g}s read "
            "timeout (LLM_S3_MAX_ATTEMPTS, LLM_S3_CONNECT_TIMEOUT, LLM_S3_READ_TIMEOUT)"
        )


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> (`bucket`, `some/key`)."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket; use s3://bucket/prefix")
    return bucket, key


def endpoint_name() -> str:
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    return f"endpoint {endpoint}" if endpoint else "the AWS default endpoint (S3_ENDPOINT_URL unset)"


def s3_client():
    """A boto3 S3 client for this process, endpoint and policy (clients never cross a fork)."""
    return _client(os.environ.get("S3_ENDPOINT_URL") or None, RetryPolicy.from_env(), os.getpid())


@functools.lru_cache(maxsize=8)
def _client(endpoint: str | None, policy: RetryPolicy, pid: int):
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=policy.connect_timeout,
        read_timeout=policy.read_timeout,
        retries={"total_max_attempts": policy.max_attempts, "mode": "standard"},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def error_code(err: BaseException) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def is_missing(err: BaseException) -> bool:
    return error_code(err) in _MISSING_CODES


def storage_error(err: BaseException, url: str, operation: str) -> StorageError:
    """One line for any botocore/boto3 failure: what, where, and what to check."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = f"{operation} {url} at {endpoint_name()}"
    policy = RetryPolicy.from_env()
    if isinstance(err, NoCredentialsError):
        return StorageError(f"{where}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(err, (EndpointConnectionError, ConnectTimeoutError)):
        bucket = split_s3_url(url)[0] if is_remote(url) else url
        return StorageError(
            f"cannot reach {endpoint_name()} for bucket {bucket!r} ({operation} {url}) after "
            f"{policy.describe()}; check S3_ENDPOINT_URL"
        )
    if isinstance(err, ReadTimeoutError):
        return StorageError(f"{where}: the server stopped answering ({policy.describe()})")
    if isinstance(err, ClientError):
        code = error_code(err)
        if code == "NoSuchBucket":
            bucket = split_s3_url(url)[0] if is_remote(url) else url
            return StorageError(f"{where}: bucket {bucket!r} does not exist; create it or fix the URL")
        if code in _MISSING_CODES:
            return StorageError(f"{where}: no such object", missing=True)
        if code in _DENIED_CODES:
            return StorageError(f"{where}: access denied ({code}); check the AWS credentials")
        return StorageError(f"{where}: S3 error {code or err} after {policy.describe()}")
    return StorageError(f"{where}: {type(err).__name__}: {err} (after {policy.describe()})")


def call(operation: str, url: str, fn):
    """Run `fn(client)`; any S3 failure (retries spent) becomes one `StorageError`."""
    try:
        return fn(s3_client())
    except StorageError:
        raise
    except Exception as err:  # botocore, boto3 and s3transfer raise many unrelated types
        raise storage_error(err, url, operation) from err
