"""The S3 client every module uses: one endpoint rule, timeouts always set, one retry policy.

The endpoint is `S3_ENDPOINT_URL` (unset: AWS itself), so MinIO, SeaweedFS or any S3-compatible
server stands in for AWS (the suite runs against SeaweedFS: scenarios/local_s3.py); credentials come from the usual `AWS_*` variables. The policy is read
from the environment each time a request starts:

  LLM_S3_OUTAGE_S         how long an unreachable or failing endpoint is retried (default 300)
  LLM_S3_BACKOFF_MAX_S    the longest pause between two attempts (default 15)
  LLM_S3_CONNECT_TIMEOUT  seconds to open a connection (default 5)
  LLM_S3_READ_TIMEOUT     seconds to wait for any byte of an answer (default 60)
  LLM_S3_MAX_ATTEMPTS     optional cap on the attempts of one request (unset: the budget decides)

The outage budget: a request that fails for a reason that can pass (no connection, a timeout, a
5xx or throttling answer) is tried again after a capped exponential backoff (0.5 s, 1 s, 2 s ...
up to LLM_S3_BACKOFF_MAX_S, jittered) until the endpoint has been failing for LLM_S3_OUTAGE_S.
There are two clocks per endpoint and process, one for reads (downloads, reads, listings) and
one for writes (uploads, writes, deletes), each shared by every request and thread of its kind:
a clock starts at the first failure of its kind and is reset only by an answer to that kind. So
writes that keep failing while reads succeed (a bucket refusing PUTs, a full quota) spend their
budget as a dead remote does, instead of being reset by every shard download. And one request
never retries for longer than the budget after its own first failure, whatever other requests of
its kind answer meanwhile: checkpoint uploads refused while the records and the run lock's
heartbeat are written end within the budget too. Once a clock has
run out its kind is given up for the rest of the process: every later request of that kind (the
clean-up after the failure: records, lock release) fails at once with the same line instead of
waiting its own bound. So a remote that never comes back ends a request, and the run, within
LLM_S3_OUTAGE_S plus one request timeout; a remote that comes back within the budget costs only
the wait. Answers that will not change (no such object, access denied, no bucket, no
credentials) fail at once. `OUTAGES.close(reason)` gives every request up at once and quietly
(a run whose end has stopped waiting for the storage: nothing is printed after its last line).

Why not a library's client: Composer's `S3ObjectStore` lives behind `import composer` (about 12 s,
too slow for the converter's processes and `--help`) and has no delete, no listing with sizes and
no atomic local counterpart; streaming's one-shot download builds a new client per call with
no connect timeout. botocore's "standard" retry mode counts attempts per request, not time per
endpoint, and each request would wait its full bound in turn: botocore makes one attempt here
and this module does the retrying, with one deadline.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import re
import threading
import time
from dataclasses import dataclass

from storage.env_numbers import EnvNumberError, env_number
from storage.errors import StorageError

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_DENIED_CODES = frozenset({"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"})
# Answers that say "later" rather than "no": retried within the outage budget.
_PASSING_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
     "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}
)  # fmt: skip
FIRST_BACKOFF_S = 0.5


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int | None = None  # None: no cap, the outage budget decides
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    outage_s: float = 300.0
    backoff_max_s: float = 15.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        try:
            return cls(
                max_attempts=env_number("LLM_S3_MAX_ATTEMPTS", cls.max_attempts, int),
                connect_timeout=env_number("LLM_S3_CONNECT_TIMEOUT", cls.connect_timeout),
                read_timeout=env_number("LLM_S3_READ_TIMEOUT", cls.read_timeout),
                outage_s=env_number("LLM_S3_OUTAGE_S", cls.outage_s),
                backoff_max_s=env_number("LLM_S3_BACKOFF_MAX_S", cls.backoff_max_s),
            )
        except EnvNumberError as err:
            raise StorageError(str(err)) from None

    @property
    def request_timeout(self) -> float:
        """The longest one attempt can wait without an answer."""
        return max(self.connect_timeout, self.read_timeout)

    @property
    def deadline_s(self) -> float:
        """The most a dead endpoint can cost: the outage budget plus one request timeout."""
        return self.outage_s + self.request_timeout

    def backoff(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1, 2, ...): doubling, capped, jittered."""
        return min(self.backoff_max_s, FIRST_BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def describe(self) -> str:
        cap = f", at most {self.max_attempts} attempts (LLM_S3_MAX_ATTEMPTS)" if self.max_attempts else ""
        return (
            f"retried for up to {self.outage_s:g}s (LLM_S3_OUTAGE_S){cap}, "
            f"{self.connect_timeout:g}s connect / {self.read_timeout:g}s read timeout "
            "(LLM_S3_CONNECT_TIMEOUT, LLM_S3_READ_TIMEOUT)"
        )


# The operations (the verbs `storage.store` names its requests with) that change the remote;
# every other one reads. Each kind has its own outage clock (module docstring).
WRITE_OPERATIONS = frozenset({"writing", "uploading to", "deleting", "deleting under"})


def request_kind(operation: str) -> str:
    """Which outage clock a request of `operation` runs on: "writes" or "reads"."""
    return "writes" if operation in WRITE_OPERATIONS else "reads"


class Outages:
    """When each endpoint began failing reads and writes (a clock per endpoint and kind, shared by
    all threads), which kinds were given up because they failed for the whole budget, and whether
    the process closed its storage."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since: dict[tuple[str, str], float] = {}
        self._given_up: dict[tuple[str, str], str] = {}
        self._announced: set[tuple[str, str]] = set()
        self._answered_at: dict[tuple[str, str], float] = {}
        self._closed: str | None = None

    def failed(self, endpoint: str, now: float, kind: str = "reads") -> float:
        """Record a failure; return when the current outage of this kind began."""
        with self._lock:
            return self._since.setdefault((endpoint, kind), now)

    def answered(self, endpoint: str, now: float, kind: str = "reads") -> None:
        with self._lock:
            self._answered_at[(endpoint, kind)] = now
            since = self._since.pop((endpoint, kind), None)
            announced = (endpoint, kind) in self._announced
            self._announced.discard((endpoint, kind))
            quiet = self._closed is not None
        if since is not None and announced and not quiet:
            log.warning(
                "[storage] %s answers again after %.0f s (%s)",
                _describe_endpoint(endpoint),
                now - since,
                kind,
            )

    def announce(self, endpoint: str, message: str, kind: str = "reads") -> None:
        """Say once per outage that it began (the retries go on quietly)."""
        with self._lock:
            if (endpoint, kind) in self._announced or self._closed is not None:
                return
            self._announced.add((endpoint, kind))
        log.warning("[storage] %s", message)

    def give_up(self, endpoint: str, message: str, kind: str = "reads", since: float | None = None) -> None:
        """Give `kind` up for the process; the other kind too unless it has answered since this
        outage began (`since`): a dead remote ends every request at once, a remote that refuses
        only writes still serves reads."""
        with self._lock:
            self._given_up.setdefault((endpoint, kind), message)
            other = "reads" if kind == "writes" else "writes"
            if since is None or self._answered_at.get((endpoint, other), float("-inf")) < since:
                self._given_up.setdefault((endpoint, other), message)

    def given_up(self, endpoint: str, kind: str = "reads") -> str | None:
        with self._lock:
            return self._closed or self._given_up.get((endpoint, kind))

    @property
    def closed(self) -> str | None:
        """Why the process closed its storage (`close`), or None."""
        return self._closed

    def close(self, reason: str) -> None:
        """Give every later request of this process up at once, and say nothing more about
        outages: the run has stopped waiting for its storage and its last line is printed."""
        with self._lock:
            self._closed = self._closed or reason

    def reset(self) -> None:
        """Forget every outage (tests; a process that knows the endpoint is back)."""
        with self._lock:
            self._since.clear()
            self._given_up.clear()
            self._announced.clear()
            self._answered_at.clear()
            self._closed = None


OUTAGES = Outages()


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> (`bucket`, `some/key`)."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket; use s3://bucket/prefix")
    return bucket, key


def endpoint_name() -> str:
    return _describe_endpoint(os.environ.get("S3_ENDPOINT_URL") or "")


def _describe_endpoint(endpoint: str) -> str:
    return f"endpoint {endpoint}" if endpoint else "the AWS default endpoint (S3_ENDPOINT_URL unset)"


def s3_client(policy: RetryPolicy | None = None):
    """A boto3 S3 client for this process, endpoint and policy (clients never cross a fork)."""
    policy = policy or RetryPolicy.from_env()
    return _client(os.environ.get("S3_ENDPOINT_URL") or None, policy, os.getpid())


@functools.lru_cache(maxsize=8)
def _client(endpoint: str | None, policy: RetryPolicy, pid: int):
    import boto3
    from botocore.config import Config

    # One attempt per call: `call` retries, against the endpoint's outage clock.
    config = Config(
        connect_timeout=policy.connect_timeout,
        read_timeout=policy.read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def transfer_config():
    """s3transfer's settings for `upload_file`/`download_file`: no retries of its own inside one
    attempt (it re-reads a broken download 5 times by default, each up to the read timeout)."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(num_download_attempts=1)


def error_code(err: BaseException) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def is_missing(err: BaseException) -> bool:
    return error_code(err) in _MISSING_CODES


def _causes(err: BaseException) -> list[BaseException]:
    """`err` and what it wraps (boto3's S3UploadFailedError keeps the real failure as its context)."""
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen) and len(seen) < 8:
        seen.append(err)
        err = getattr(err, "last_exception", None) or err.__cause__ or err.__context__
    return seen


def is_passing(err: BaseException) -> bool:
    """Whether `err` says the endpoint could not be reached or asked to wait (worth retrying),
    as opposed to an answer that will not change (missing, denied, no bucket, bad request)."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    for cause in _causes(err):
        if isinstance(cause, ClientError):
            status = (cause.response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return error_code(cause) in _PASSING_CODES or int(status) >= 500
        if isinstance(cause, (BotoConnectionError, HTTPClientError, IncompleteReadError)):
            return True
        if isinstance(cause, (ConnectionError, TimeoutError)):  # socket-level, seen under s3transfer
            return True
        if type(cause).__module__.startswith("urllib3") and "Error" in type(cause).__name__:
            return True
    return False


def storage_error(
    err: BaseException, url: str, operation: str, attempts: int | None = None, seconds: float | None = None
) -> StorageError:
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
    tried = (
        f"after {attempts} attempts in {seconds:.0f}s; {policy.describe()}" if attempts else policy.describe()
    )
    causes = _causes(err)
    kinds = {type(c) for c in causes}
    if any(issubclass(k, NoCredentialsError) for k in kinds):
        return StorageError(f"{where}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if any(issubclass(k, (EndpointConnectionError, ConnectTimeoutError)) for k in kinds):
        bucket = split_s3_url(url)[0] if is_remote(url) else url
        return StorageError(
            f"cannot reach {endpoint_name()} for bucket {bucket!r} ({operation} {url}) {tried}; "
            "check S3_ENDPOINT_URL"
        )
    if any(issubclass(k, ReadTimeoutError) for k in kinds):
        return StorageError(f"{where}: the server stopped answering ({tried})")
    client_error = next((c for c in causes if isinstance(c, ClientError)), None)
    if client_error is not None:
        code = error_code(client_error)
        bucket = split_s3_url(url)[0] if is_remote(url) else url
        if code == "NoSuchBucket":
            return no_bucket_error(where, bucket)
        if code == "InvalidBucketName":
            return StorageError(
                f"{where}: {bucket!r} is not a valid bucket name ({BUCKET_RULE}); use another bucket"
            )
        if code in _MISSING_CODES:
            return StorageError(f"{where}: no such object", missing=True)
        if code in _DENIED_CODES:
            token = (
                " (AWS_SESSION_TOKEN is set: a server that issued no session token refuses the keys with it)"
                if os.environ.get("AWS_SESSION_TOKEN")
                else ""
            )
            return StorageError(f"{where}: access denied ({code}); check the AWS credentials{token}")
        return StorageError(f"{where}: S3 error {code or client_error} ({tried})")
    text = " ".join(str(err).split())  # one line, whatever the library put in it
    return StorageError(f"{where}: {type(err).__name__}: {text} ({tried})")


# S3's rule for new bucket names (AWS and SeaweedFS refuse others; moto took any). Only
# named in messages, never checked before a request: AWS still serves older buckets named otherwise.
BUCKET_RULE = "3-63 characters: lowercase letters, digits, dots and hyphens, a letter or digit at each end"
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def no_bucket_error(where: str, bucket: str) -> StorageError:
    """The one line for a bucket that is not there (and, if so, that S3 would not take its name)."""
    refused = "" if _BUCKET_NAME.fullmatch(bucket) else f"; S3 refuses that name too ({BUCKET_RULE})"
    return StorageError(f"{where}: bucket {bucket!r} does not exist; create it or fix the URL{refused}")


def call(operation: str, url: str, fn, *, read_timeout: float | None = None):
    """Run `fn(client)` under the outage budget; a failure that outlasts it (or one that will not
    pass) becomes one `StorageError`. See the module docstring for the policy. `read_timeout`
    replaces LLM_S3_READ_TIMEOUT for this request (the recipe's `data.download_timeout`)."""
    policy = RetryPolicy.from_env()
    if read_timeout is not None:
        policy = dataclasses.replace(policy, read_timeout=float(read_timeout))
    endpoint = os.environ.get("S3_ENDPOINT_URL") or ""
    kind = request_kind(operation)
    attempts = 0
    first_failure: float | None = None
    while True:
        gone = OUTAGES.given_up(endpoint, kind)
        if gone is not None:
            raise StorageError(f"{operation} {url}: not tried, {gone}")
        attempts += 1
        began = time.monotonic()
        try:
            result = fn(s3_client(policy))
        except StorageError:
            raise
        except Exception as err:  # botocore, boto3 and s3transfer raise many unrelated types
            now = time.monotonic()
            if not is_passing(err):
                if any(getattr(c, "response", None) for c in _causes(err)):
                    OUTAGES.answered(endpoint, now, kind)  # the endpoint answered (4xx): it is there
                raise storage_error(err, url, operation) from err
            gone = OUTAGES.given_up(endpoint, kind)  # given up while this attempt waited
            if gone is not None:
                raise StorageError(f"{operation} {url}: not tried again, {gone}") from err
            # The outage began when this attempt did; for this request, at its own first failure at
            # the latest, whatever other requests of its kind answered since (the clock they reset).
            first_failure = began if first_failure is None else first_failure
            since = min(OUTAGES.failed(endpoint, began, kind), first_failure)
            left = since + policy.outage_s - now
            capped = policy.max_attempts is not None and attempts >= policy.max_attempts
            if left <= 0 or capped:
                # Given up for the process: the clean-up after this failure does not wait again.
                why = f"{attempts} attempts (LLM_S3_MAX_ATTEMPTS)" if capped and left > 0 else (
                    f"over {policy.outage_s:g}s (LLM_S3_OUTAGE_S)"
                )  # fmt: skip
                OUTAGES.give_up(endpoint, f"{endpoint_name()} has failed for {why} on {kind}", kind, since)
                raise storage_error(err, url, operation, attempts, now - since) from err
            OUTAGES.announce(
                endpoint,
                f"{endpoint_name()} is failing ({operation} {url}: {type(err).__name__}); retrying for "
                f"up to {policy.outage_s:g}s (LLM_S3_OUTAGE_S)",
                kind,
            )
            # The last attempt starts at the deadline at the latest: it ends within one timeout.
            time.sleep(min(policy.backoff(attempts), left))
            continue
        OUTAGES.answered(endpoint, time.monotonic(), kind)
        return result
