"""The training data path: token shards (shards/FORMAT.md) -> StreamingDataset -> DataLoader.

Two jobs, in the order the trainer needs them:
1. `check_streams(cfg)`: read each stream's `meta.json` (local or s3://) and refuse data that
   contradicts the recipe (vocabulary, sequence length, tokenizer, pretraining vs SFT shards),
   before any model is built. The format's own checks (meta.json's schema, index.json, the
   hashes, the kind) are `shards/`'s; here is what the recipe adds.
2. `build_dataloader(cfg, split, batch_size)`: a StreamingDataset over one or more streams
   (mixed by proportion), shuffled deterministically, yielding `{"input_ids": LongTensor[B, L]}`;
   for SFT shards (`data.kind: sft`) also `loss_mask` (bool: the tokens to learn) and `segments`
   (the example each token belongs to, 0 = padding), see shards/FORMAT.md.

`batch_size` is the per-device batch: streaming partitions samples per rank with it, and Composer
saves the dataset's `state_dict` in checkpoints so a resumed run continues mid-epoch without
replaying batches.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from composer.core import DataSpec
from streaming import Stream, StreamingDataset
from torch.utils.data import DataLoader

from llm.config import parse_bytes
from llm.errors import ConfigError
from llm.run_dir import RunDir
from shards.chat_template import ChatTemplate
from shards.errors import ShardsError
from shards.index import check_index, read_index
from shards.meta import SplitMeta, check_kind, read_meta
from storage import RetryPolicy, StorageError, download_url, is_remote, join, read_url

if TYPE_CHECKING:
    from llm.config import StreamConfig, TrainConfig

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")  # the recipe's data.train and data.eval
DEFAULT_REFETCHES = 2  # data.download_retry=null: a shard failing its hash is fetched twice more


# --- metadata checks --------------------------------------------------------------------------


def check_streams(cfg: TrainConfig) -> dict[str, list[SplitMeta]]:
    """Check every stream's metadata against the recipe; return the metadata per split."""
    tokenizer_sha = None
    if cfg.data.check_tokenizer_hash:
        tokenizer_sha = file_sha256(cfg.tokenizer.path)
    found: dict[str, list[SplitMeta]] = {}
    for split in SPLITS:
        found[split] = []
        for i, stream in enumerate(_streams(cfg, split)):
            where = f"data.{split}.{i} ({stream.remote})"
            try:  # the format's own checks raise ShardsError: to the recipe, a ConfigError like the rest
                meta = read_meta(stream.remote)
                check_kind(meta, cfg.data.kind, where)
                check_meta(meta, cfg, where, tokenizer_sha)
                check_index(stream.remote, cfg.data.validate_hash, where)
            except ShardsError as err:
                raise ConfigError(str(err)) from None
            found[split].append(meta)
    if cfg.data.kind == "sft":
        _check_same_template(found)
    if any(is_remote(s.remote) and not s.local for split in SPLITS for s in _streams(cfg, split)):
        check_cache_root(cfg.data.cache_root)
    return found


def _check_same_template(found: dict[str, list[SplitMeta]]) -> None:
    """ConfigError unless every SFT stream was rendered with the same chat template."""
    seen: dict[str, str] = {}
    for split in SPLITS:
        for i, meta in enumerate(found[split]):
            seen.setdefault(json.dumps(meta.chat_template, sort_keys=True), f"data.{split}.{i}")
    if len(seen) > 1:
        first, second = list(seen.values())[:2]
        raise ConfigError(
            f"{first} and {second} were converted with different chat templates (meta.json "
            "chat_template); convert every stream with the same `python -m convert sft --template`"
        )


def chat_template_of(cfg: TrainConfig) -> ChatTemplate | None:
    """The chat template of an SFT recipe's shards (from the first train stream's meta.json; the
    streams agree, see `check_streams`); None for pretraining."""
    if cfg.data.kind != "sft":
        return None
    remote = cfg.data.train[0].remote
    return ChatTemplate.from_dict(read_meta(remote).chat_template, f"{join(remote, 'meta.json')}")


def check_cache_root(cache_root: str) -> None:
    """ConfigError unless remote shards can be cached under `cache_root`."""
    try:
        Path(cache_root).mkdir(parents=True, exist_ok=True)
        probe = Path(cache_root) / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"data.cache_root={cache_root} is not a writable folder ({err.strerror or err}); set "
            "data.cache_root or LLM_CACHE_ROOT to a folder on a local disk with room for the cache"
        ) from None


def check_meta(meta: SplitMeta, cfg: TrainConfig, where: str, tokenizer_sha: str | None) -> None:
    """ConfigError naming the stream, both values and the fix when `meta` contradicts `cfg`."""
    vocab, model_vocab = meta.vocab_size, cfg.model.vocab_size
    if vocab > model_vocab:
        raise ConfigError(
            f"{where}: the shards' tokenizer has vocab_size={vocab} but model.vocab_size={model_vocab} "
            f"is smaller, so some token ids have no embedding; set model.vocab_size >= {vocab} "
            f"or convert with the recipe's tokenizer"
        )
    seq_len = meta.seq_len
    if seq_len != cfg.model.max_seq_len:
        raise ConfigError(
            f"{where}: the shards hold samples of seq_len={seq_len} tokens but model.max_seq_len="
            f"{cfg.model.max_seq_len}; set model.max_seq_len={seq_len} or re-convert with "
            f"--seq-len {cfg.model.max_seq_len}"
        )
    if tokenizer_sha is not None and meta.tokenizer_sha256 != tokenizer_sha:
        raise ConfigError(
            f"{where}: the shards were tokenized with a tokenizer of sha256 "
            f"{meta.tokenizer_sha256} but tokenizer.path={cfg.tokenizer.path} has sha256 "
            f"{tokenizer_sha}; point tokenizer.path at the tokenizer used for conversion, re-convert, "
            f"or set data.check_tokenizer_hash=false if you are sure they are equivalent"
        )


def file_sha256(path: str) -> str:
    """SHA-256 of a local or s3:// file's bytes (the tokenizer identity written by convert)."""
    try:
        return hashlib.sha256(_read_bytes(path)).hexdigest()
    except FileNotFoundError:
        raise ConfigError(
            f"tokenizer.path={path} does not exist; train one with `python -m convert tokenizer` "
            f"or fix the path"
        ) from None


def _read_bytes(path: str) -> bytes:
    """Through the storage layer (its retries and timeouts); an absent file is FileNotFoundError."""
    try:
        return read_url(path)
    except StorageError as err:
        if err.missing:
            raise FileNotFoundError(path) from None
        raise


# --- datasets and loaders ---------------------------------------------------------------------


def _streams(cfg: TrainConfig, split: str) -> list[StreamConfig]:
    return cfg.data.train if split == "train" else cfg.data.eval


def stream_local(
    cfg: TrainConfig, split: str, index: int, stream: StreamConfig, index_digest: str = ""
) -> str:
    """The folder streaming reads a stream from.

    - `local` given in the recipe: that folder.
    - a local split folder: the folder itself, read in place (nothing copied; compressed shards
      are decompressed beside themselves once, on first read, and kept for later runs).
    - a remote split: a cache folder unique per run, split, stream position, remote and the
      content of the remote's index.json (`index_digest`), so that two live datasets never share
      one (streaming refuses that) and re-converted or repaired data is never served from an old
      cache: a changed index.json gets a new folder, and the old one is removed.
    """
    if stream.local:
        return stream.local
    if not is_remote(stream.remote):
        return str(Path(stream.remote).resolve())
    digest = hashlib.sha256(stream.remote.encode()).hexdigest()[:10]
    name = f"{index}-{digest}-{index_digest}" if index_digest else f"{index}-{digest}"
    return str(Path(cfg.data.cache_root) / str(cfg.run_name) / split / name)


def index_digest(index: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()[:10]


def largest_shard_bytes(index: dict[str, Any]) -> int:
    """Cache space one shard takes while it is decompressed: raw plus compressed bytes."""
    return max(s["raw_data"]["bytes"] + (s.get("zip_data") or {}).get("bytes", 0) for s in index["shards"])


def _drop_stale_caches(local: str) -> None:
    """Remove this stream's cache folders made for an earlier index.json of the same remote."""
    folder = Path(local)
    stem = folder.name.rsplit("-", 1)[0] + "-"
    if not folder.parent.is_dir():
        return
    for old in folder.parent.iterdir():
        if old.name.startswith(stem) and old.name != folder.name and old.is_dir():
            log.info("removing the stream cache %s: its remote's index.json has changed", old)
            shutil.rmtree(old, ignore_errors=True)


SHM_DIR = Path("/dev/shm")
_LOCALS_SHM = re.compile(r"^(\d{6})_locals$")


def clean_stale_shared_memory(local_dirs: Iterable[str]) -> list[int]:
    """Unlink streaming's shared memory still registered for our cache folders; return the prefixes.

    Streaming registers each live dataset's local folders in shared memory, and a run killed with
    its whole process group (container OOM, node preemption) never unregisters them. With a fresh
    /tmp but the same /dev/shm (e.g. `docker --ipc=host`, per-job TMPDIR), the next start then
    fails with "Reused local directory". Call once, before the first dataset, on one rank per node.

    Unlike `streaming.base.util.clean_stale_shared_memory()`, this frees only registrations of
    *our* folders: that function unlinks every dataset's memory on the machine (also those of other
    live jobs) and stops at the first unused prefix, so it can miss the stale one.
    """
    from streaming.base.constant import SHM_TO_CLEAN

    wanted = {os.path.abspath(d) for d in local_dirs}
    freed: list[int] = []
    if not SHM_DIR.is_dir():  # not Linux: nothing we can inspect safely
        return freed
    for entry in sorted(SHM_DIR.iterdir()):
        match = _LOCALS_SHM.match(entry.name)
        if not match or wanted.isdisjoint(_registered_locals(entry)):
            continue
        prefix = match.group(1)
        for name in SHM_TO_CLEAN:
            (SHM_DIR / f"{prefix}_{name}").unlink(missing_ok=True)
        freed.append(int(prefix))
    return freed


def _registered_locals(path: Path) -> list[str]:
    """The folders a streaming `*_locals` segment lists (int32 size, then NUL-separated paths)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    if len(data) < 4:
        return []
    size = int(np.frombuffer(data[:4], np.int32)[0])
    return data[4:size].decode("utf-8", "replace").split("\0")[:-1]


def all_stream_locals(cfg: TrainConfig) -> list[str]:
    """Every folder this run's datasets will register."""
    return [
        stream_local(cfg, split, i, s, index_digest(read_index(s.remote)) if is_remote(s.remote) else "")
        for split in SPLITS
        for i, s in enumerate(_streams(cfg, split))
    ]


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


class TokenDataset(StreamingDataset):
    """A StreamingDataset whose samples are LongTensors of token ids."""

    error_log: str | None = None  # where the download threads' tracebacks go (the run folder)
    _failure: BaseException | None = None  # the first error of a download thread

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = super().__getitem__(index)
        # Decoded arrays are read-only views into the shard: copy while widening to int64.
        return torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64))

    def __iter__(self):
        # When a download thread fails, streaming sets its event and ends the epoch early, without
        # an error (the next epoch's start would raise "Background thread failed"): say so here.
        try:
            yield from super().__iter__()
        except RuntimeError as err:
            if "Background thread failed" not in str(err):
                raise
            raise self._download_failed() from None
        event = getattr(self, "_event", None)
        if event is not None and event.is_set():
            raise self._download_failed()

    # streaming 0.13 ends an epoch by waiting until its two background threads (download ahead,
    # wait for shards) have each counted their exit, but a thread that raises never counts it: when
    # both fail on a dead remote (each downloads shards), the main thread waits forever (seen in
    # CI). A failing thread counts its exit here, so the epoch ends and the error above is raised.
    # Its error is kept for that message and its traceback goes to the run folder's log, not to
    # the console (streaming's future callback would print it there, once per thread).
    def _prepare_thread(self, it) -> None:
        try:
            super()._prepare_thread(it)
        except BaseException as err:
            self._thread_failed(it, err)

    def _ready_thread(self, it) -> None:
        try:
            super()._ready_thread(it)
        except BaseException as err:
            self._thread_failed(it, err)

    def _thread_failed(self, it, err: BaseException) -> None:
        import threading
        import traceback

        if self._failure is None:
            self._failure = err
        it.on_exit()
        if self.error_log:
            try:
                Path(self.error_log).parent.mkdir(parents=True, exist_ok=True)
                with open(self.error_log, "a") as f:
                    f.write(f"--- {threading.current_thread().name}, pid {os.getpid()}\n")
                    f.write("".join(traceback.format_exception(err)))
            except OSError:
                pass
        self._event.set()  # the other thread and the main loop stop

    def _download_failed(self) -> StorageError:
        failure = self._failure
        details = f" (traceback in {self.error_log})" if self.error_log else ""
        if isinstance(failure, CorruptShard):
            return CorruptShard(f"reading the training data failed: {failure}{details}")
        if isinstance(failure, StorageError):
            cause = str(failure)
        elif failure is not None:
            cause = f"{type(failure).__name__}: {' '.join(str(failure).split())}"
        else:
            cause = f"a shard could not be fetched or did not verify ({RetryPolicy.from_env().describe()})"
        return StorageError(
            f"reading the training data failed: {cause}{details}. The last stored checkpoint is "
            "intact: fix the storage and re-run the same command to resume"
        )


class SftDataset(TokenDataset):
    """SFT samples: token ids, the loss mask and the segment of every position, as tensors."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = StreamingDataset.__getitem__(self, index)
        return {
            "input_ids": torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64)),
            "loss_mask": torch.from_numpy(np.asarray(sample["loss_mask"]).astype(np.bool_)),
            "segments": torch.from_numpy(np.asarray(sample["segments"]).astype(np.int32)),
        }


_SHM_RACE_ATTEMPTS = 8


def _with_shm_race_retry(make):
    """`make()`, again after a short random pause if another process took the same shared-memory
    prefix at the same moment.

    streaming 0.13 picks the first free prefix (`/000123_locals`) and then creates it: two
    processes on one machine that build datasets at the same instant (two jobs started together,
    a test suite's workers) can pick the same one, and the second fails with FileExistsError.
    Only retried in a world of one rank (Composer sets up a process group even for one process):
    with several ranks the prefix is agreed between barriers, which a retry on one rank would put
    out of step."""
    import random
    import time

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return make()
    for attempt in range(_SHM_RACE_ATTEMPTS):
        try:
            return make()
        except FileExistsError as err:
            if attempt == _SHM_RACE_ATTEMPTS - 1 or not re.search(r"/\d+_\w+", str(err.filename or err)):
                raise
            time.sleep(random.uniform(0.05, 0.3))
    raise AssertionError("unreachable")


def build_dataset(cfg: TrainConfig, split: str, batch_size: int, stream: int | None = None) -> TokenDataset:
    """A (mixed, shuffled) StreamingDataset over the streams of `split` ("train" or "eval"), or over
    its stream number `stream` alone (evaluation reports each eval stream on its own)."""
    data = cfg.data
    # Shard downloads are streaming's own (its client, with botocore's retries inside each try);
    # by default they take the storage policy's read timeout and number of tries.
    policy = RetryPolicy.from_env()
    retry = data.download_retry
    if retry is None:  # re-fetches of a file that failed its hash (outages are LLM_S3_OUTAGE_S's)
        retry = policy.max_attempts - 1 if policy.max_attempts else DEFAULT_REFETCHES
    streams, largest, cached = [], 0, []
    for i, s in enumerate(_streams(cfg, split)):
        if stream is not None and i != stream:
            continue
        digest = ""
        if is_remote(s.remote):
            index = read_index(s.remote)
            digest, largest = index_digest(index), max(largest, largest_shard_bytes(index))
        local = stream_local(cfg, split, i, s, digest)
        if digest and not s.local:
            _drop_stale_caches(local)
        if digest or s.local:
            cached.append(local)
        streams.append(
            VerifiedStream(
                remote=str(Path(s.remote).resolve())
                if s.local and not digest
                else (s.remote if digest else None),
                local=local,
                proportion=s.proportion if stream is None else None,  # alone: all of its samples
                validate_hash=data.validate_hash,
                # streaming 0.13 uses this as the number of attempts (its retry(num_attempts=...)),
                # not the re-attempts its docstring says; ours counts extra tries, 0 allowed.
                download_retry=retry + 1,
                download_timeout=data.download_timeout or policy.read_timeout,
                keep_zip=data.keep_zip,
            )
        )
    dataset_class = SftDataset if data.kind == "sft" else TokenDataset
    dataset = _with_shm_race_retry(
        lambda: dataset_class(
            streams=copy.deepcopy(streams),  # streaming fills in each Stream: a retry needs fresh ones
            batch_size=batch_size,
            shuffle=data.shuffle and split == "train",
            shuffle_algo="py1e",
            shuffle_seed=data.shuffle_seed,
            shuffle_block_size=data.shuffle_block_size,
            num_canonical_nodes=data.num_canonical_nodes,
            predownload=data.predownload,
            cache_limit=cache_limit(cfg, split, largest, cached, len(streams)),
        )
    )
    dataset.error_log = str(RunDir(cfg.run_dir).storage_log)
    return dataset


def cache_limit(cfg: TrainConfig, split: str, largest: int, cached: list[str], n_streams: int) -> int | None:
    """The byte limit of a dataset's cache, or None; ConfigError when it cannot hold 4 shards.

    Only datasets whose streams are all copied into a cache get one: streaming evicts by deleting
    a shard's files, which for a split read in place would be the data itself.
    """
    wanted = cfg.data.cache_limit
    if wanted is None or not cached:
        return None
    if len(cached) < n_streams:
        if wanted == "auto":
            return None  # local streams read in place: no eviction (it would delete their files)
        raise ConfigError(
            f"data.cache_limit={wanted}: data.{split} mixes local and remote streams, and a limited "
            "cache would evict (delete) the local ones' files; give each local stream a `local:` "
            "cache folder, or set data.cache_limit=null"
        )
    largest = largest or max(largest_shard_bytes(read_index(s.remote)) for s in _streams(cfg, split))
    if wanted == "auto":
        root = _existing_parent(Path(cfg.data.cache_root))
        usage = sum(_folder_bytes(Path(local)) for local in cached)
        datasets = 1 + len(cfg.data.eval)  # train and each eval stream's dataset share the disk
        limit = int(0.8 * (shutil.disk_usage(root).free + usage) / datasets)
        where = f"data.cache_root={cfg.data.cache_root} (80% of its disk's free space: {limit:,} bytes)"
    else:
        limit = parse_bytes(wanted, "data.cache_limit")
        where = f"data.cache_limit={wanted}"
    if limit < 4 * largest:
        raise ConfigError(
            f"{where} cannot hold the 4 shards streaming needs at once: the largest takes {largest:,} "
            f"bytes decompressed plus compressed; raise data.cache_limit to at least {4 * largest:,} "
            "bytes or point data.cache_root (LLM_CACHE_ROOT) at a disk with room"
        )
    return limit


def _existing_parent(path: Path) -> Path:
    return next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def collate_tokens(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack(samples)}


def collate_sft(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def sft_token_counts(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tokens of an SFT batch: all of them, and those the loss scores (`loss_generating`)."""
    return {"total": batch["input_ids"].numel(), "loss_generating": int(batch["loss_mask"][:, 1:].sum())}


def train_data_spec(cfg: TrainConfig, loader: DataLoader):
    """What the Trainer gets as training data: the loader, or for SFT a DataSpec counting the answer
    tokens, so that with `accumulate_train_batch_on_tokens` Composer weights each micro-batch by
    its answer tokens and the step's loss is the mean over all answer tokens of the global batch
    (not a mean of per-micro-batch means)."""
    if cfg.data.kind != "sft":
        return loader
    return DataSpec(loader, get_num_tokens_in_batch=sft_token_counts)


def build_dataloader(cfg: TrainConfig, split: str, batch_size: int, stream: int | None = None) -> DataLoader:
    """DataLoader yielding `{"input_ids": LongTensor[batch_size, seq_len]}` for one rank (over one
    stream of the split when `stream` is given)."""
    dataset = build_dataset(cfg, split, batch_size, stream)
    workers = cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate_sft if cfg.data.kind == "sft" else collate_tokens,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=split == "train",
        persistent_workers=workers > 0,
    )
