"""`llm export CHECKPOINT --out FOLDER [--tokenizer T] [--recipe R] [--dtype D]`.

Writes the model in the Hugging Face Llama layout (`llm.weights.hf_export.export_hf`). CHECKPOINT is a
checkpoint file, a run's checkpoint folder (its newest verified checkpoint), an `llm import`
output or an exported folder, local or s3://. It is read without running code from it (see
`llm generate --help`); --trust lifts that for a file you trust.
"""

from __future__ import annotations

import argparse

import torch

from llm.commands import add_trust_argument
from llm.weights.build import model_from_weights
from llm.weights.hf_export import export_hf
from llm.weights.read import read_weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint file or run folder (local or s3://), or `llm import` output"
    )
    parser.add_argument("--recipe", help="the recipe the model was trained with (its model: section)")
    parser.add_argument(
        "--tokenizer",
        help="the tokenizer to ship with the export: a SentencePiece .model, a Hugging Face "
        "tokenizer.json or a folder holding one",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    add_trust_argument(parser)


def run(args: argparse.Namespace) -> int:
    weights = read_weights(args.checkpoint, trust=args.trust)
    model = model_from_weights(weights, args.checkpoint, args.recipe)
    out = export_hf(model, args.out, args.tokenizer, getattr(torch, args.dtype), weights.chat_template)
    print(f"exported {model.num_params():,} parameters to {out} (Hugging Face Llama layout)")
    return 0
