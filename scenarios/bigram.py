"""A smoothed bigram model of the same shards: the baseline a trained model's eval loss should beat.

    python -m scenarios.bigram --shards data/demo/shards [--metrics runs/demo/metrics.jsonl] [--recipe recipes/demo.yaml]

Counts next-token pairs within each train sample and scores every pair of each val sample, the
targets a language model's eval loss averages over (each token given the ones before it; the bigram
sees only the one before). Smoothing: Witten-Bell, interpolating each token's followers with an
add-one unigram, so no pair scores zero and nothing needs tuning. With `--metrics` (a run's
metrics.jsonl) it prints the run's last eval loss beside the baseline: what `make demo` ends with,
so a user sees how much the model learned beyond which token tends to follow which. With
`--recipe`, the val samples scored are the ones that run's eval loss covers (its first
`eval_subset_num_batches` batches of `device_microbatch_size`; the eval split is not shuffled).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Baseline:
    loss: float  # mean negative log-likelihood (nats) per val target token
    train_pairs: int
    val_pairs: int


def read_samples(split: str | Path) -> list[np.ndarray]:
    """The token arrays of a local MDS split, in order (streaming's reader)."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(split), shuffle=False, batch_size=1)
    return [np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in range(dataset.num_samples)]


def pairs(samples: list[np.ndarray], vocab: int) -> np.ndarray:
    """Every (previous, next) pair within a sample, as previous * vocab + next."""
    return np.concatenate([s[:-1] * vocab + s[1:] for s in samples if len(s) > 1])


def bigram_loss(train: list[np.ndarray], val: list[np.ndarray], vocab: int) -> Baseline:
    train_keys, val_keys = pairs(train, vocab), pairs(val, vocab)
    keys, counts = np.unique(train_keys, return_counts=True)
    unigram = np.bincount(np.concatenate(train), minlength=vocab).astype(np.float64)
    p_uni = (unigram + 1) / (unigram.sum() + vocab)
    previous = keys // vocab
    context = np.bincount(previous, weights=counts, minlength=vocab)  # c(a): pairs starting with a
    types = np.bincount(previous, minlength=vocab).astype(np.float64)  # T(a): distinct followers

    a, b = val_keys // vocab, val_keys % vocab
    where = np.clip(np.searchsorted(keys, val_keys), 0, len(keys) - 1)
    pair = np.where(keys[where] == val_keys, counts[where], 0).astype(np.float64)
    denominator = context[a] + types[a]
    p = np.where(denominator > 0, (pair + types[a] * p_uni[b]) / np.maximum(denominator, 1), p_uni[b])
    return Baseline(float(-np.log(p).mean()), len(train_keys), len(val_keys))


def last_eval_loss(metrics: str | Path) -> float | None:
    loss = None
    for line in Path(metrics).read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if isinstance(record.get("eval_loss"), (int, float)):
            loss = float(record["eval_loss"])
    return loss


def eval_samples(recipe: str) -> int | None:
    """How many val samples (from the start) a run of `recipe` evaluates on one device; None: all."""
    from llm.config import load_config
    from llm.trainer import resolve_microbatch

    cfg = resolve_microbatch(load_config(recipe), "cpu", 1, announce=False)  # 0: the plan's, as a CPU run
    if cfg.training.eval_subset_num_batches < 0:
        return None
    return cfg.training.eval_subset_num_batches * cfg.training.device_microbatch_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="a conversion's output: train/ and val/ splits")
    parser.add_argument("--metrics", help="a run's metrics.jsonl: print its last eval loss beside")
    parser.add_argument("--recipe", help="score only the val samples this recipe's eval loss covers")
    args = parser.parse_args(argv)
    shards = Path(args.shards)
    vocab = json.loads((shards / "train" / "meta.json").read_text())["vocab_size"]
    val = read_samples(shards / "val")
    if args.recipe:
        val = val[: eval_samples(args.recipe) or len(val)]
    found = bigram_loss(read_samples(shards / "train"), val, vocab)
    line = (
        f"bigram baseline (Witten-Bell, {found.train_pairs:,} train pairs, {len(val)} val samples): "
        f"eval loss {found.loss:.4f}"
    )
    model = last_eval_loss(args.metrics) if args.metrics and Path(args.metrics).exists() else None
    if model is not None:
        gap = found.loss - model
        verdict = f"{gap:.2f} nats better" if gap > 0 else f"{-gap:.2f} nats WORSE"
        line += f" | the model: {model:.4f} ({verdict} than the bigram, perplexity {math.exp(model):.0f})"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
