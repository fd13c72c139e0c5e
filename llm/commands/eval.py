"""`llm eval CHECKPOINT --tasks PATH... [--shots 5] [--out results.json]`: multiple-choice accuracy.

    llm eval runs/demo/checkpoints --tokenizer data/demo/tokenizer.model --tasks data/demo/tasks/zh-demo
    llm eval runs/demo/export --tasks data/ceval data/cmmlu --shots 5     # an `llm export` folder
    llm eval s3://bkt/ckpt/ep0-ba2000-rank0.pt --tokenizer tok.model --tasks s3://bkt/ceval

CHECKPOINT is whatever `llm generate` takes: a checkpoint file, a run's checkpoint folder (its
newest verified checkpoint), an `llm import` output or an exported Hugging Face folder, local or
s3://. Each PATH is a task folder in C-Eval's / CMMLU's CSV layout (llm/eval/tasks.py). Prints a
table (accuracy per subject and per task, and the prompt protocol: by default lm-eval 0.4.13's stock
ceval-valid / cmmlu prompts, comparable with published figures; `--protocol compact` is the earlier
format) and writes JSON with every question's id and option log-likelihoods (`--prompts`: also the
prompt text and the continuations scored, to line up with another tool's samples): by default
into the run folder under `runs/` that CHECKPOINT lies in (runs/demo/checkpoints ->
runs/demo/eval_results.json), else `runs/eval/<CHECKPOINT's name>.json`; never the working folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llm.commands import RUNS, add_tokenizer_argument, tokenizer_path
from llm.eval import harness
from llm.eval.tasks import PROTOCOLS
from llm.weights.read import load_model
from shards.tokenizer import Tokenizer
from storage import is_remote, open_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint file or run folder (local or s3://), or exported folder"
    )
    parser.add_argument(
        "--tasks", nargs="+", required=True, metavar="PATH", help="task folders (local or s3://)"
    )
    parser.add_argument(
        "--shots", type=int, default=0, help="few-shot examples from each dev split (C-Eval: 5)"
    )
    parser.add_argument(
        "--split", default=None, help="split to evaluate (default: val if present, else test)"
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default=None,
        help="prompt format of letter tasks (default: task.json's, else lm-eval's stock ceval-valid, "
        "or cmmlu for CSVs with CMMLU's Question/Answer header)",
    )
    parser.add_argument(
        "--prompts", action="store_true", help="write each question's prompt and continuations to the JSON"
    )
    parser.add_argument("--max-questions", type=int, default=None, help="only the first N of each subject")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    parser.add_argument(
        "--no-shared-prompt",
        dest="shared",
        action="store_false",
        help="one row per option (lm-eval's way) instead of one row per question",
    )
    add_tokenizer_argument(parser)
    parser.add_argument("--recipe", help="recipe whose model: section gives the shape")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--out",
        help="JSON results (local or s3://); default: runs/<run>/eval_results.json for a checkpoint in "
        "the run folder runs/<run>, else runs/eval/<checkpoint's name>.json",
    )


def run(args: argparse.Namespace) -> int:
    # a bad CSV fails before the model loads
    tasks = harness.load_tasks(args.tasks, args.split, args.max_questions, args.protocol)
    tokenizer = Tokenizer(tokenizer_path(args.checkpoint, args.tokenizer, args.recipe))
    prepared = harness.prepare(tasks, tokenizer, args.shots, tokenizer.start_id)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_model(args.checkpoint, args.recipe, device=device).to(getattr(torch, args.dtype))
    tokenizer.check_fits(model.cfg.vocab_size)
    report = harness.run(model, prepared, batch_size=args.batch_size, shared=args.shared)
    print(report.table())
    if report.truncated:
        print(
            f"warning: {report.truncated} of {report.num_questions} prompts were longer than the model's "
            f"context of {model.cfg.max_seq_len} tokens and were cut from the left"
            + (" (fewer --shots shortens them)" if args.shots else "")
        )
    if report.merged:
        print(
            f"note: in {report.merged} of {report.num_questions} questions an option tokenizes together "
            f"with the prompt's last token ({report.emptied} of them would have no token of their own); "
            "their options were scored from the last token the prompt and all options share"
        )
    rate = report.num_questions / report.seconds if report.seconds else 0.0
    print(f"{report.num_questions} questions in {report.seconds:.1f} s ({rate:.1f} questions/s)")
    result = {
        "checkpoint": args.checkpoint,
        "shots": args.shots,
        "shared_prompt": args.shared,
        "dtype": args.dtype,
        **report.to_json(prompts=args.prompts),
    }
    out = args.out or default_out(args.checkpoint)
    write_json(out, result)
    print(f"results: {out}")
    return 0


def default_out(checkpoint: str) -> str:
    """Where results go without --out: `eval_results.json` in the run folder under `runs/` that
    `checkpoint` lies in, else `runs/eval/<its name>.json` (runs/ is git-ignored)."""
    runs, path = Path(RUNS).absolute(), Path(checkpoint).absolute()
    if not is_remote(checkpoint) and path.is_relative_to(runs) and path != runs:
        return f"{RUNS}/{path.relative_to(runs).parts[0]}/eval_results.json"
    name = checkpoint.rstrip("/").rsplit("/", 1)[-1].removesuffix(".pt") or "checkpoint"
    return f"{RUNS}/eval/{name}.json"


def write_json(out: str, data: dict) -> None:
    parent, _, name = out.rstrip("/").rpartition("/")
    open_store(parent or ".").write_text(name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
