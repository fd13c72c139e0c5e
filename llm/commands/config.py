"""`llm config [PREFIX] [--out FILE]`: the recipe reference, every key of the schema.

Prints docs/config.md as `llm.config_reference.render` writes it from the schema (type, default,
range, the comment beside each field in llm/config.py, what a resume does with a changed value);
PREFIX keeps the keys that start with it (`llm config optimizer`). `--out docs/config.md`
regenerates the page after a change to the schema.
"""

from __future__ import annotations

import argparse

from llm.config_reference import render
from llm.errors import ConfigError
from storage.local import atomic_write_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prefix", nargs="?", default="", help="only the keys starting with it, e.g. optimizer"
    )
    parser.add_argument(
        "--out", help="write the reference to this file (docs/config.md) instead of printing it"
    )


def run(args: argparse.Namespace) -> int:
    text = render(only=args.prefix)
    if args.prefix and "\n| `" not in text:
        raise ConfigError(f"no recipe key starts with {args.prefix!r}; `llm config` lists them all")
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
