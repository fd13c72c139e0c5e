"""Every read and write of files the project keeps: local folders and S3-compatible buckets.

`llm` (checkpoints, shard metadata, weights) and `convert` (corpus inputs, shards, tokenizers)
both come here, so there is one S3 client configuration, one retry policy, one atomic-write rule
and one error type. To change how S3 retries or times out, open `storage/s3.py`; to change how a
local file is replaced safely, `storage/local.py`; the folder-like interface both share is
`storage/store.py`. The numbers these layers read from environment variables (`LLM_S3_*`, and
llm's `LLM_RUN_LOCK_*`, `LLM_CKPT_VERIFY_MAX_BYTES`) are parsed by one rule, `storage/env_numbers.py`.
"""

from storage.errors import StorageError
from storage.local import atomic_open, atomic_path, atomic_write_bytes, atomic_write_text
from storage.s3 import RetryPolicy, is_remote, s3_client, split_s3_url
from storage.store import LocalStore, S3Store, Store, download_url, join, open_store, read_url

__all__ = [
    "LocalStore",
    "RetryPolicy",
    "S3Store",
    "StorageError",
    "Store",
    "atomic_open",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "download_url",
    "is_remote",
    "join",
    "open_store",
    "read_url",
    "s3_client",
    "split_s3_url",
]
