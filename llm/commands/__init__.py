"""The `llm` command: inspect a recipe, list its keys, generate text, chat, evaluate, export and import weights.

Each sub-command is a module here, named like the command, with `add_arguments(parser)` and
`run(args) -> int`; it parses and prints, and calls library functions with typed arguments.
A module is imported only when its sub-command runs, so `llm --help` stays fast (no torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llm.errors import ConfigError
from shards.errors import ShardsError
from shards.tokenizer import tokenizer_in
from storage import StorageError, is_remote

# Where a command's output goes when no --out is given: the folder of run folders (a recipe's run_dir
# is runs/${run_name}), which git ignores; never the working folder itself.
RUNS = "runs"

# sub-command -> (module, one-line help)
COMMANDS = {
    "inspect": (
        "llm.commands.inspect_recipe",
        "dry run: parameters, FLOPs, tokens per step, memory plan per GPU",
    ),
    "config": (
        "llm.commands.config",
        "every recipe key: type, default, range, meaning, resume (docs/config.md)",
    ),
    "generate": ("llm.commands.generate", "continue prompts from a checkpoint (Composer or exported)"),
    "chat": (
        "llm.commands.chat",
        "ask a fine-tuned (SFT) model, in its chat template, interactively or once",
    ),
    "export": ("llm.commands.export", "write a checkpoint in the Hugging Face Llama layout"),
    "import": (
        "llm.commands.import_",
        "convert Hugging Face Llama / Mistral / Qwen2, baby-llama2-chinese or Baichuan-7B weights for training",
    ),
    "eval": ("llm.commands.eval", "multiple-choice accuracy (C-Eval / CMMLU layout) of a checkpoint"),
    "plot": ("llm.commands.plot", "compare runs: loss vs tokens of several runs in one figure, and a table"),
}


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    """`--trust`, for the sub-commands that read checkpoints (generate, chat, export, import)."""
    parser.add_argument(
        "--trust",
        action="store_true",
        help="the checkpoint is trusted: unpickle it in full, which can run code from it, and skip "
        "the manifest check of a file inside a run folder (like checkpoint.allow_untrusted_load_path "
        "in training). Without it, checkpoints are read as weights only and one that needs more is "
        "refused",
    )


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    """`--tokenizer`, for the sub-commands that turn text into the model's ids (generate, chat, eval)."""
    parser.add_argument(
        "--tokenizer",
        help="the tokenizer the model was trained with: a SentencePiece .model, a Hugging Face "
        "tokenizer.json or a folder holding one (default: the one an exported folder holds, else the "
        "--recipe's tokenizer.path)",
    )


def tokenizer_path(checkpoint: str, given: str | None, recipe: str | None) -> str:
    """--tokenizer, else the tokenizer an export ships (its tokenizer.json or tokenizer.model), else
    the recipe's tokenizer.path; ConfigError when there is none."""
    if given:
        return given
    if is_remote(checkpoint) or not checkpoint.endswith((".pt", ".pth")):
        shipped = tokenizer_in(checkpoint)
        if shipped is not None:
            return shipped
    if recipe:
        from llm.config import load_config

        return load_config(recipe).tokenizer.path
    raise ConfigError(
        f"{checkpoint} ships no tokenizer (tokenizer.json or tokenizer.model): pass --tokenizer (the "
        "tokenizer the model was trained with) or --recipe"
    )


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module that will run
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, where a command that takes `key=value` overrides (`train.py`,
    `llm inspect`) takes them on either side of its flags: `RECIPE --dry-run k=v` as `RECIPE k=v
    --dry-run`. argparse fills a list positional from one run of positionals only, and its
    `parse_intermixed_args` refuses parsers with sub-commands; what is left over is handed to the
    overrides in order, and anything else is refused as argparse refuses it."""
    args, rest = parser.parse_known_args(argv)
    stray = [a for a in rest if a.startswith("-")] if hasattr(args, "overrides") else rest
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; a user's mistake or a storage failure is one line on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parse_command_line(parser, argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ConfigError, ShardsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StorageError as err:  # missing: the user's path; else S3 or the disk failed after retries
        print(f"error: {err}", file=sys.stderr)
        return 2 if err.missing else 1


if __name__ == "__main__":
    sys.exit(main())
