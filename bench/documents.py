"""Documents apart or not: each run's final model scored on a whole val split, both ways.

    python -m bench.documents RUN_CHECKPOINTS... [--shards data/demo/shards/val] [--batch 16]

For each run (a checkpoint folder: its newest verified checkpoint, as `llm generate` reads it) the
mean loss per target token over every sample of the split, computed twice by the same wrapper
(`llm.composer_model.LanguageModel`): causal over each sample (what `model.attention=causal`
trains and evaluates) and with documents apart, positions restarting (`model.attention=document`,
`model.positions=document`: each document scored as if it were alone, the context a prompt has).
The demo's own eval loss covers its first 32 val samples only; this covers the split. Figures,
not a test: docs/benchmarks.md keeps them.
"""

from __future__ import annotations

import argparse
import sys

import torch

from llm.composer_model import Documents, LanguageModel
from llm.weights.read import load_model
from scenarios.bigram import read_samples
from shards.meta import read_meta


def split_loss(model: LanguageModel, samples: list[torch.Tensor], batch: int) -> float:
    """Mean cross-entropy per target token over `samples`."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), batch):
            ids = torch.stack(samples[start : start + batch])
            logits = model({"input_ids": ids})
            targets = ids[:, 1:]
            total += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            )
            count += targets.numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.documents", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="checkpoint folders (or files) of the runs to compare")
    parser.add_argument("--shards", default="data/demo/shards/val", help="a local split folder")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    eos = read_meta(args.shards).eos_id
    samples = [torch.from_numpy(s) for s in read_samples(args.shards)]
    apart_per_sample = sum(int((s[:-1] == eos).any()) for s in samples)
    print(
        f"bench-documents: {len(samples)} samples of {args.shards} ({apart_per_sample} hold more than one "
        f"document; EOS id {eos}), mean loss per target token"
    )
    print(f"  {'run':<48} {'causal':>8} {'documents apart':>16}")
    for run in args.runs:
        model = load_model(run).eval()
        causal = split_loss(LanguageModel(model), samples, args.batch)
        apart = split_loss(
            LanguageModel(model, documents=Documents(eos, restart_positions=True)), samples, args.batch
        )
        print(f"  {run:<48} {causal:>8.4f} {apart:>16.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
