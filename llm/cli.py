"""The `llm` command: inspect a recipe, generate text, export and import checkpoints.

Each sub-command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their sub-command runs, so `llm --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
COMMANDS = {
    "inspect": ("llm.inspect", "dry run: parameters, FLOPs, tokens per step, memory plan per GPU"),
    "generate": ("llm.generate_cli", "continue prompts from a checkpoint (Composer or exported)"),
    "export": ("llm.hf_export", "write a checkpoint in the Hugging Face Llama layout"),
    "import": ("llm.import_weights", "convert baby-llama2-chinese or Baichuan-7B weights for training"),
}


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


def main(argv: list[str] | None = None) -> int:
    from llm.errors import ConfigError

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
