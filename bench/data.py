"""Data loader throughput against what the GPUs consume: `python -m bench.data` (`make bench-data`).

For the two real recipes' sample shapes (tiny: 512 tokens, 7b: 4,096 tokens; uint16 token ids in
zstd MDS shards written by the project's own writer), the training loader (`llm.data`, the
trainer's exact code path: StreamingDataset, collate, DataLoader) delivers batches of the recipe's
micro-batch size, one process (one rank), and this prints samples/s and tokens/s:

- from local shards read in place (warm: decompressed once, as every run after the first), and
  from S3 on loopback (moto) through a cold cache (as every epoch of a dataset larger than the
  cache: each shard downloaded, hash-checked, decompressed);
- with 0, 1 and 2 DataLoader workers, and with and without the xxh64 hash check;
- next to what the GPU consumes per rank: the tiny recipe at 600,000 tokens/s on one H200, the 7B
  recipe at 4,000 tokens/s per GPU (llm-foundry's MPT-7B figures are in this range); target: the
  loader delivers >= 5x that with the recipe's settings (0 workers) on one CPU core.

Then the start-up cost of a large index: a split of 10,000 shards (local), its index.json size and
the time from building the loader to the first batch. Figures, not a pass/fail test; the machine
is shared, so each configuration is measured in turns and the best of `--rounds` counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shards.meta import SplitMeta, now, write_meta
from shards.writer import ShardWriter, index_json, prefixed_entries
from storage import open_store

GPU_NEEDS = {"tiny": 600_000, "7b": 4_000}  # tokens/s one GPU consumes (see the docstring)
TARGET_MARGIN = 5.0


@dataclass(frozen=True)
class Shape:
    name: str
    seq_len: int
    micro_batch: int
    samples: int  # in the benchmark split


SHAPES = [Shape("tiny", 512, 32, 12_000), Shape("7b", 4096, 2, 600)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="turns per configuration (best counts)")
    parser.add_argument("--batches", type=int, default=60, help="timed batches per measurement")
    parser.add_argument("--index-shards", type=int, default=10_000, help="shards of the start-up split")
    parser.add_argument("--workdir", default=None, help="default: a new temp folder")
    return parser.parse_args(argv)


def write_split(folder: Path, seq_len: int, samples: int, shard_bytes: int, seed: int = 0) -> Path:
    """A train split of random token ids (the loader's cost does not depend on their values)."""
    rng = np.random.default_rng(seed)
    store = open_store(folder)
    writer = ShardWriter(store, "part-00000", seq_len=seq_len, dtype="uint16", size_limit=shard_bytes)
    for start in range(0, samples, 1024):
        rows = rng.integers(0, 64_000, size=(min(1024, samples - start), seq_len), dtype=np.uint16)
        writer.write(rows)
    store.write_json("index.json", index_json(prefixed_entries(writer.finish(), "part-00000")))
    meta = SplitMeta(
        split="train", seq_len=seq_len, dtype="uint16", vocab_size=64_000, eos_id=2, bos_id=1, add_bos=False,
        tokenizer_sha256="none", num_samples=samples, num_tokens=samples * seq_len, num_documents=samples,
        dropped={}, created_at=now(), command="python -m bench.data",
    )  # fmt: skip
    write_meta(store, meta, folder="")
    return folder


def config(work: Path, remote: str, shape: Shape, *, workers: int, validate: bool, tag: str):
    from llm.config import load_config

    recipe = work / f"{tag}.yaml"
    recipe.write_text(
        f"run_name: {tag}\nrun_dir: {work / 'runs' / tag}\n"
        f"model: {{vocab_size: 64000, dim: 64, n_layers: 1, n_heads: 1, max_seq_len: {shape.seq_len}}}\n"
        f"tokenizer: {{path: {work / 'none.model'}}}\n"
        f"data: {{train: [{{remote: {remote}}}], check_tokenizer_hash: false, num_workers: {workers}}}\n"
    )
    cache = tempfile.mkdtemp(prefix="cache-", dir=work)  # cold for a remote split
    overrides = [f"data.cache_root={cache}", f"data.validate_hash={'xxh64' if validate else 'null'}"]
    return load_config(str(recipe), overrides)


def measure(cfg, shape: Shape, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, samples/s over the next `batches` batches)."""
    from llm.data import build_dataloader

    start = time.perf_counter()
    loader = build_dataloader(cfg, "train", shape.micro_batch)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    start = time.perf_counter()
    done = 0
    for batch in it:
        done += batch["input_ids"].shape[0]
        if done >= batches * shape.micro_batch:
            break
    rate = done / (time.perf_counter() - start)
    del it, loader
    gc.collect()
    return first, rate


def warm_up(cfg, shape: Shape) -> None:
    """Read every sample once: a local split's shards are then decompressed in place, as after a run."""
    from llm.data import build_dataset

    dataset = build_dataset(cfg, "train", shape.micro_batch)
    for i in range(dataset.num_samples):
        dataset[i]
    del dataset
    gc.collect()


def start_s3() -> tuple[object, str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    return server, endpoint


def upload(split: Path, prefix: str) -> str:
    store = open_store(f"s3://bench/{prefix}")
    for path in sorted(split.rglob("*")):
        if path.is_file():
            store.upload(path, path.relative_to(split).as_posix())
    return store.root


def throughput(args, work: Path) -> list[str]:
    lines = []
    for shape in SHAPES:
        local = write_split(work / f"{shape.name}-local", shape.seq_len, shape.samples, 8 << 20)
        remote = upload(local, f"{shape.name}/train")
        warm_up(config(work, str(local), shape, workers=0, validate=True, tag="warm"), shape)
        need = GPU_NEEDS[shape.name] / shape.seq_len  # samples/s one GPU consumes
        lines.append(
            f"\n{shape.name}: {shape.seq_len} tokens a sample, micro-batch {shape.micro_batch}; one GPU "
            f"consumes {GPU_NEEDS[shape.name]:,} tokens/s = {need:,.1f} samples/s; "
            f"target {TARGET_MARGIN:g}x = {TARGET_MARGIN * need:,.1f} samples/s"
        )
        lines.append(
            f"  {'source':<14}{'workers':>8}{'hash':>7}{'samples/s':>12}{'tokens/s':>14}{'x need':>9}"
            f"{'first batch':>13}"
        )
        for source, where in (("local (warm)", str(local)), ("S3 (cold)", remote)):
            for workers in (0, 1, 2):
                for validate in (True, False):
                    best_rate, best_first = 0.0, float("inf")
                    for _ in range(args.rounds):
                        cfg = config(work, where, shape, workers=workers, validate=validate, tag="run")
                        first, rate = measure(cfg, shape, args.batches)
                        best_rate, best_first = max(best_rate, rate), min(best_first, first)
                    lines.append(
                        f"  {source:<14}{workers:>8}{'xxh64' if validate else 'off':>7}{best_rate:>12,.0f}"
                        f"{best_rate * shape.seq_len:>14,.0f}{best_rate / need:>8.0f}x{best_first:>12.2f}s"
                    )
                    print(lines[-1], flush=True)
    return lines


def startup(args, work: Path) -> list[str]:
    shape = Shape("index", 512, 32, args.index_shards)
    split = work / "many-shards"
    start = time.perf_counter()
    sample_bytes = shape.seq_len * 2 + 16
    write_split(split, shape.seq_len, args.index_shards, shard_bytes=sample_bytes + 600)  # 1 sample a shard
    made = time.perf_counter() - start
    index_bytes = (split / "index.json").stat().st_size
    shards = len(json.loads((split / "index.json").read_text())["shards"])
    first, _ = measure(config(work, str(split), shape, workers=0, validate=True, tag="index"), shape, 1)
    return [
        f"\nstart-up: {shards:,} shards (local, read in place), index.json {index_bytes / 2**20:.1f} MiB "
        f"(written in {made:.0f} s): {first:.2f} s from building the loader to the first batch"
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)  # one CPU core's worth of loader work in the main process
    work = Path(args.workdir or tempfile.mkdtemp(prefix="llm-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    server, endpoint = start_s3()
    try:
        print(f"bench-data: one rank, loader as the trainer builds it; S3 = moto on {endpoint}", flush=True)
        lines = throughput(args, work)
        lines += startup(args, work)
    finally:
        server.stop()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
