"""`llm plot RUN [RUN ...] --out compare.png`: the loss-vs-tokens curves of several runs in one figure.

    llm plot runs/demo runs/demo-lr1e-3 --out compare.png
    llm plot s3://bkt/ckpt/b7-001 s3://bkt/ckpt/b7-002 --out compare.png --title "7B: lr sweep"

Each RUN is a run_dir (holds metrics.jsonl) or a checkpoint save folder whose records are stored
beside the checkpoints (records/metrics.jsonl, llm/run_dir.py), local or s3://. The
figure has each run's smoothed train loss (a line) and eval loss (markers) in its own colour with a
legend, and the learning rates below; the command prints one row per run: steps, tokens, final
train and eval loss, median tokens/s.
"""

from __future__ import annotations

import argparse

from llm.plots import load_run, plot_compare, summary_table, unique_labels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="run_dir or checkpoint save folder (local or s3://)"
    )
    parser.add_argument("--out", default="compare.png", help="the PNG to write (default compare.png)")
    parser.add_argument("--title", default="loss vs tokens", help="the figure's title")


def run(args: argparse.Namespace) -> int:
    runs = [load_run(source) for source in args.runs]  # a folder that is not a run: one line, exit 2
    unique_labels(runs)
    out = plot_compare(runs, args.out, args.title)
    print(summary_table(runs))
    print(f"wrote {out}")
    return 0
