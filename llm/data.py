"""The training data path: token shards (convert/FORMAT.md) -> StreamingDataset -> DataLoader.

Two jobs, in the order the trainer needs them:
1. `check_streams(cfg)`: read each stream's `meta.json` (local or s3://) and refuse data that
   contradicts the recipe (vocabulary, sequence length, tokenizer), before any model is built.
2. `build_dataloader(cfg, split, batch_size)`: a StreamingDataset over one or more streams
   (mixed by proportion), shuffled deterministically, yielding `{"input_ids": LongTensor[B, L]}`.

`batch_size` is the per-device batch: streaming partitions samples per rank with it, and Composer
saves the dataset's `state_dict` in checkpoints so a resumed run continues mid-epoch without
replaying batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from streaming import Stream, StreamingDataset
from torch.utils.data import DataLoader

from llm.errors import ConfigError

if TYPE_CHECKING:
    from llm.config import StreamConfig, TrainConfig

META_FORMAT = "llm-pretrain-tokens"
SPLITS = ("train", "eval")


# --- metadata checks --------------------------------------------------------------------------


def read_meta(remote: str) -> dict[str, Any]:
    """The `meta.json` of one split folder (local path or s3://bucket/prefix)."""
    try:
        text = _read_text(_join(remote, "meta.json"))
    except FileNotFoundError:
        raise ConfigError(
            f"stream {remote} has no meta.json: it was not produced by `python -m convert shards`; "
            f"convert the corpus with `python -m convert shards ... --out <folder>` and point the "
            f"stream at <folder>/train or <folder>/val"
        ) from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"stream {remote}: meta.json is not valid JSON ({err}); re-run the conversion"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(
            f"stream {remote}: meta.json is not a {META_FORMAT!r} file; re-run `python -m convert shards`"
        )
    return meta


def check_streams(cfg: TrainConfig) -> dict[str, list[dict[str, Any]]]:
    """Check every stream's metadata against the recipe; return the metadata per split."""
    tokenizer_sha = None
    if cfg.data.check_tokenizer_hash:
        tokenizer_sha = file_sha256(cfg.tokenizer.path)
    found: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        found[split] = []
        for i, stream in enumerate(_streams(cfg, split)):
            meta = read_meta(stream.remote)
            check_meta(meta, cfg, f"data.{split}.{i} ({stream.remote})", tokenizer_sha)
            found[split].append(meta)
    return found


def check_meta(meta: dict[str, Any], cfg: TrainConfig, where: str, tokenizer_sha: str | None) -> None:
    """ConfigError naming the stream, both values and the fix when `meta` contradicts `cfg`."""
    vocab, model_vocab = meta.get("vocab_size"), cfg.model.vocab_size
    if not isinstance(vocab, int) or vocab > model_vocab:
        raise ConfigError(
            f"{where}: the shards' tokenizer has vocab_size={vocab} but model.vocab_size={model_vocab} "
            f"is smaller, so some token ids have no embedding; set model.vocab_size >= {vocab} "
            f"or convert with the recipe's tokenizer"
        )
    seq_len = meta.get("seq_len")
    if seq_len != cfg.model.max_seq_len:
        raise ConfigError(
            f"{where}: the shards hold samples of seq_len={seq_len} tokens but model.max_seq_len="
            f"{cfg.model.max_seq_len}; set model.max_seq_len={seq_len} or re-convert with "
            f"--seq-len {cfg.model.max_seq_len}"
        )
    if tokenizer_sha is not None and meta.get("tokenizer_sha256") != tokenizer_sha:
        raise ConfigError(
            f"{where}: the shards were tokenized with a tokenizer of sha256 "
            f"{meta.get('tokenizer_sha256')} but tokenizer.path={cfg.tokenizer.path} has sha256 "
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


def _read_text(path: str) -> str:
    return _read_bytes(path).decode("utf-8")


def _read_bytes(path: str) -> bytes:
    if not path.startswith("s3://"):
        return Path(path).read_bytes()
    import boto3
    from botocore.exceptions import ClientError

    bucket, _, key = path[len("s3://") :].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NoSuchBucket"):
            raise FileNotFoundError(path) from None
        raise ConfigError(f"cannot read {path}: {err}; check the bucket name and credentials") from None


def _join(remote: str, name: str) -> str:
    return f"{remote.rstrip('/')}/{name}" if remote.startswith("s3://") else str(Path(remote) / name)


# --- datasets and loaders ---------------------------------------------------------------------


def _streams(cfg: TrainConfig, split: str) -> list[StreamConfig]:
    return cfg.data.train if split == "train" else cfg.data.eval


def stream_local(cfg: TrainConfig, split: str, index: int, stream: StreamConfig) -> str:
    """The local cache folder of a stream: given, or unique per run, split and remote.

    Two live datasets sharing a cache folder make streaming fail ("Reused local directory"), so the
    default folder includes the split, the stream's position and a hash of its remote.
    """
    if stream.local:
        return stream.local
    digest = hashlib.sha256(stream.remote.encode()).hexdigest()[:10]
    return str(Path(cfg.data.cache_root) / str(cfg.run_name) / split / f"{index}-{digest}")


def clean_stale_shared_memory() -> None:
    """Remove shared memory left by a crashed run, so the next start does not fail.

    Streaming registers each live dataset's local folders in shared memory; a SIGKILLed run never
    unregisters them and a restart then sees its own folders as "Reused local directory". Call once
    per process, before the first dataset (on several ranks, local rank 0 cleans, the others wait).
    """
    from streaming.base.util import clean_stale_shared_memory as clean

    clean()


class TokenDataset(StreamingDataset):
    """A StreamingDataset whose samples are LongTensors of token ids."""

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = super().__getitem__(index)
        # Decoded arrays are read-only views into the shard: copy while widening to int64.
        return torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64))


def build_dataset(cfg: TrainConfig, split: str, batch_size: int):
    """A (mixed, shuffled) StreamingDataset over the streams of `split` ("train" or "eval")."""
    streams = [
        Stream(remote=_remote_arg(s.remote), local=stream_local(cfg, split, i, s), proportion=s.proportion)
        for i, s in enumerate(_streams(cfg, split))
    ]
    train = split == "train"
    return TokenDataset(
        streams=streams,
        batch_size=batch_size,
        shuffle=cfg.data.shuffle and train,
        shuffle_algo="py1e",
        shuffle_seed=cfg.data.shuffle_seed,
    )


def _remote_arg(remote: str) -> str:
    # Streaming copies a local "remote" into the cache like a download; an absolute path keeps
    # that working whatever the current directory of each rank.
    return remote if "://" in remote else str(Path(remote).resolve())


def collate_tokens(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack(samples)}


def build_dataloader(cfg: TrainConfig, split: str, batch_size: int) -> DataLoader:
    """DataLoader yielding `{"input_ids": LongTensor[batch_size, seq_len]}` for one rank."""
    dataset = build_dataset(cfg, split, batch_size)
    workers = cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate_tokens,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=split == "train",
        persistent_workers=workers > 0,
    )
