"""`VerifiedStream`: a streaming `Stream` whose shard files come through the storage layer and are
verified in the cache; `CorruptShard`, the one line when a remote's own copy fails its hash.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from streaming import Stream

from storage import StorageError, download_url, is_remote

log = logging.getLogger(__name__)


class CorruptShard(StorageError):
    """A shard's file failed its hash on every download: the remote's copy itself is corrupt."""


def _file_hash(algo: str, path: str) -> str:
    from streaming.base.hashing import get_hash

    with open(path, "rb") as f:
        return get_hash(algo, f.read())


class VerifiedStream(Stream):
    """A Stream whose remote files come through the storage layer and are verified in the cache.

    What streaming 0.13 lacks (stream.py, `_download_file` and `_prepare_shard_part`): its own
    download client retries per request, not within the project's outage budget; a file that fails
    its hash stays in the cache, so every later run fails on it again even after the remote was
    repaired; and a decompressed file already in the cache is used without any check. Here:

    - remote files are fetched with `storage.download_url` (LLM_S3_OUTAGE_S: an outage is waited
      out, the download-ahead thread waits while training goes on from the shards in the cache);
    - a file that fails its hash (`data.validate_hash`) is deleted and fetched again, up to
      `download_retry` times; only a remote whose copy fails every time ends the run, with one
      line naming the file, the expected and the actual hash (`CorruptShard`);
    - at start, each decompressed shard already in the cache is checked against the raw hash that
      index.json records before it counts as present; one that differs is deleted (and rebuilt
      from its verified compressed file, or downloaded again).
    """

    def _remote_url(self, basename: str) -> str:
        parts = [self.remote.rstrip("/"), self.split, basename]
        return "/".join(p for p in parts if p)

    def _download_file(self, from_basename: str, to_basename: str | None = None) -> str:
        if self.remote is None or not is_remote(self.remote):
            return super()._download_file(from_basename, to_basename)
        local = os.path.join(self.local, self.split, to_basename or from_basename)
        download_url(self._remote_url(from_basename), local, read_timeout=self.download_timeout)
        return local

    def _verifies(self) -> bool:
        return bool(self.validate_hash) and self.remote not in (None, self.local)

    def set_up_local(self, shards, cache_usage_per_shard) -> None:
        if self._verifies():
            for shard in shards:
                for raw_info, _ in shard.file_pairs:
                    self._drop_if_corrupt(raw_info)
        super().set_up_local(shards, cache_usage_per_shard)

    def _drop_if_corrupt(self, info, quiet: bool = False) -> str | None:
        """Delete the cached file of `info` if it does not match its recorded hash; its hash then."""
        path = os.path.join(self.local, self.split, info.basename)
        want = info.hashes.get(self.validate_hash)
        if want is None or not os.path.isfile(path):
            return None
        got = _file_hash(self.validate_hash, path)
        if got == want:
            return None
        if not quiet:
            log.warning(
                "[data] %s in the cache does not match its %s hash: deleted", path, self.validate_hash
            )
        Path(path).unlink(missing_ok=True)
        return got

    def _prepare_shard_part(self, raw_info, zip_info=None, compression=None) -> int:
        if not self._verifies():
            return super()._prepare_shard_part(raw_info, zip_info, compression)
        fetched = zip_info or raw_info  # the file that comes from the remote
        attempts = max(1, self.download_retry)
        for attempt in range(1, attempts + 1):
            try:
                return super()._prepare_shard_part(raw_info, zip_info, compression)
            except ValueError as err:
                if "Checksum failure" not in str(err):
                    raise
            got = self._drop_if_corrupt(fetched, quiet=True) or "?"
            want = fetched.hashes.get(self.validate_hash)
            if attempt < attempts:
                log.warning(
                    "[data] %s failed its %s hash after download (expected %s, got %s): fetching it "
                    "again (%d of %d)",
                    self._remote_url(fetched.basename), self.validate_hash, want, got, attempt + 1, attempts,
                )  # fmt: skip
        raise CorruptShard(
            f"shard {self._remote_url(fetched.basename)} is corrupt in the remote itself: "
            f"{self.validate_hash} expected {want}, got {got} on each of {attempts} downloads; "
            "restore the file (or re-convert the split) and re-run the same command to resume"
        )
