"""Where checkpoints live: a local folder or an `s3://bucket/prefix`, behind one small interface.

Every path given to a store is relative to its root (the recipe's `checkpoint.save_folder`).
The S3 store talks to AWS, MinIO or a moto server alike: it reads `S3_ENDPOINT_URL` and the usual
`AWS_*` variables, retries each request (`LLM_CKPT_S3_MAX_ATTEMPTS`, default 5) and gives up
with a `CheckpointStoreError` that names the bucket and the operation.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class CheckpointStoreError(RuntimeError):
    """The checkpoint location could not be read or written (after retries)."""


def open_store(uri: str) -> LocalStore | S3Store:
    """A store for a local folder or an s3:// URI."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise CheckpointStoreError(f"{uri!r} names no bucket; use s3://bucket/prefix")
        return S3Store(bucket, prefix.strip("/"))
    if "://" in uri:
        raise CheckpointStoreError(f"checkpoint folder {uri!r}: only local folders and s3:// are supported")
    return LocalStore(uri)


class LocalStore:
    """A folder on this machine (or a shared file system)."""

    is_remote = False

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(self.root)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def uri_of(self, rel: str) -> str:
        return str(self.path(rel))

    def list(self, prefix: str = "") -> dict[str, int]:
        """Relative path -> size of every file under `prefix`."""
        base = self.path(prefix) if prefix else self.root
        if not base.is_dir():
            return {}
        return {
            str(p.relative_to(self.root)): p.stat().st_size
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(".tmp")
        }

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        target = self.path(rel)
        if Path(local).resolve() == target.resolve():
            return  # Composer wrote it in place already
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)

    def download(self, rel: str, local: str | os.PathLike) -> None:
        shutil.copyfile(self.path(rel), local)

    def write_text(self, rel: str, text: str) -> None:
        """Write atomically (temp file, fsync, rename): a reader sees the old or the new text."""
        target = self.path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(target)

    def read_text(self, rel: str) -> str:
        return self.path(rel).read_text(encoding="utf-8")

    def delete(self, rels: list[str]) -> None:
        for rel in rels:
            self.path(rel).unlink(missing_ok=True)


class S3Store:
    """A prefix in an S3 bucket."""

    is_remote = True

    def __init__(self, bucket: str, prefix: str):
        self.bucket = bucket
        self.prefix = prefix
        self.uri = f"s3://{bucket}/{prefix}".rstrip("/")
        self._client = None

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            attempts = int(os.environ.get("LLM_CKPT_S3_MAX_ATTEMPTS", "5"))
            config = Config(
                connect_timeout=5, read_timeout=60, retries={"max_attempts": attempts, "mode": "standard"}
            )
            endpoint = os.environ.get("S3_ENDPOINT_URL") or None
            self._client = boto3.client("s3", endpoint_url=endpoint, config=config)
        return self._client

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def uri_of(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self.key(rel)}"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # botocore raises many unrelated types; all mean the same here
            raise CheckpointStoreError(
                f"{what} failed on s3://{self.bucket} (endpoint {os.environ.get('S3_ENDPOINT_URL') or 'AWS'}) "
                f"after retries: {err}"
            ) from err

    def list(self, prefix: str = "") -> dict[str, int]:
        start = self.key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call(
            f"listing {start!r}", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=start))
        )
        cut = len(self.prefix) + 1 if self.prefix else 0
        return {obj["Key"][cut:]: obj["Size"] for page in pages for obj in page.get("Contents", [])}

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        self._call(f"uploading {rel}", self.client.upload_file, str(local), self.bucket, self.key(rel))

    def download(self, rel: str, local: str | os.PathLike) -> None:
        self._call(f"downloading {rel}", self.client.download_file, self.bucket, self.key(rel), str(local))

    def write_text(self, rel: str, text: str) -> None:
        # A single PUT is atomic in S3: readers see the old or the new object, never a mix.
        body = text.encode("utf-8")
        self._call(f"writing {rel}", self.client.put_object, Bucket=self.bucket, Key=self.key(rel), Body=body)

    def read_text(self, rel: str) -> str:
        obj = self._call(f"reading {rel}", self.client.get_object, Bucket=self.bucket, Key=self.key(rel))
        return obj["Body"].read().decode("utf-8")

    def delete(self, rels: list[str]) -> None:
        for start in range(0, len(rels), 1000):
            chunk = [{"Key": self.key(r)} for r in rels[start : start + 1000]]
            self._call(
                "deleting old checkpoints",
                self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": chunk, "Quiet": True},
            )
