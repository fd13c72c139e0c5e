"""`llm plot RUN [RUN ...] [--out runs/compare.png]`: the loss-vs-tokens curves of several runs in one figure.

    llm plot runs/demo runs/demo-lr1e-3                     # -> runs/compare.png
    llm plot s3://bkt/ckpt/b7-001 s3://bkt/ckpt/b7-002 --out runs/b7-lr.png --title "7B: lr sweep"

Each RUN is a run_dir (holds metrics.jsonl) or a checkpoint save folder whose records are stored
beside the checkpoints (records/metrics.jsonl, llm/run_dir.py), local or s3://. The
figure has each run's smoothed train loss (a line) and eval loss (markers) in its own colour with a
legend, and the learning rates below; the command prints one row per run: steps, tokens, final
train and eval loss, median tokens/s. Runs whose losses count different tokens (pretraining: all
tokens; SFT: answer tokens only) are labelled with what each counts; runs trained with different
tokenizers with each one's, and a note says that their losses per token do not compare.
"""

from __future__ import annotations

import argparse

from llm.commands import RUNS
from llm.plots import TOKENIZER_NOTE, different_tokenizers, label_runs, load_run, plot_compare, summary_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="run_dir or checkpoint save folder (local or s3://)"
    )
    out = f"{RUNS}/compare.png"
    parser.add_argument("--out", default=out, help=f"the PNG to write (default {out})")
    parser.add_argument("--title", default="loss vs tokens", help="the figure's title")


def run(args: argparse.Namespace) -> int:
    runs = [load_run(source) for source in args.runs]  # a folder that is not a run: one line, exit 2
    label_runs(runs)  # distinct, and saying what each loss counts when that differs
    out = plot_compare(runs, args.out, args.title)
    print(summary_table(runs))
    if different_tokenizers(runs):
        print(TOKENIZER_NOTE)
    print(f"wrote {out}")
    return 0
