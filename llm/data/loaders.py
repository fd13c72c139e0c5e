"""The loaders the trainer fits on: a StreamingDataset over a split's streams, in a DataLoader.

`build_dataloader(cfg, split, batch_size)`: a StreamingDataset over one or more streams (mixed by
proportion), shuffled deterministically, yielding `{"input_ids": LongTensor[B, L]}`; for SFT
shards (`data.kind: sft`) also `loss_mask` and `segments` (llm/data/datasets.py).

`batch_size` is the per-device batch: streaming partitions samples per rank with it, and Composer
saves the dataset's `state_dict` in checkpoints so a resumed run continues mid-epoch without
replaying batches. The training loader is a `SkippingLoader` (llm/data/skip.py): it drops the
batches of `data.skip`'s windows and of those the guard adds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from composer.core import DataSpec
from torch.utils.data import DataLoader

from llm.config import TrainConfig
from llm.data.cache import cache_limit, drop_stale_caches, index_digest, largest_shard_bytes, stream_local
from llm.data.datasets import SftDataset, TokenDataset
from llm.data.shared_memory import with_shm_race_retry
from llm.data.skip import SkippingLoader, SkipWindows
from llm.data.verified_stream import VerifiedStream
from llm.run_dir import RunDir
from shards.index import read_index
from storage import RetryPolicy, is_remote

DEFAULT_REFETCHES = 2  # data.download_retry=null: a shard failing its hash is fetched twice more


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
    for i, s in enumerate(data.streams(split)):
        if stream is not None and i != stream:
            continue
        digest = ""
        if is_remote(s.remote):
            index = read_index(s.remote)
            digest, largest = index_digest(index), max(largest, largest_shard_bytes(index))
        local = stream_local(cfg, split, i, s, digest)
        if digest and not s.local:
            drop_stale_caches(local)
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
    dataset = with_shm_race_retry(
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
    options = dict(
        batch_size=batch_size,
        collate_fn=collate_sft if cfg.data.kind == "sft" else collate_tokens,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=split == "train",
        persistent_workers=workers > 0,
    )
    if split == "train":  # the batches of data.skip are read and dropped (llm/data/skip.py)
        return SkippingLoader(dataset, windows=SkipWindows(cfg.data.skip), **options)
    return DataLoader(dataset, **options)
