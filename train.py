"""Train a model from a YAML recipe: `composer train.py recipes/demo.yaml [key=value ...]`.

Also `python train.py ...` (one process) and `train.py RECIPE --dry-run [--gpus N]` (sizes and
memory plan, no data, nothing allocated). Everything lives in the `llm` package; this file only
parses the command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optimizer.lr=1e-4")
    parser.add_argument(
        "--dry-run", action="store_true", help="print sizes and the memory plan, do not train"
    )
    parser.add_argument("--gpus", type=int, default=8, help="GPU count for the dry run's memory plan")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None, extra_callbacks: Sequence = ()) -> int:
    from llm.checkpoint_store import CheckpointStoreError
    from llm.errors import ConfigError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.dry_run:
            from llm import inspect

            return inspect.run(args)
        from llm.config import load_config

        cfg = load_config(args.recipe, args.overrides)
        from llm.trainer import train

        train(cfg, extra_callbacks)
    except ConfigError as err:  # a problem with the recipe or the data: say which, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointStoreError as err:  # storage failed after retries; resumable from the last save
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


# Composer's checkpoint uploader starts processes with spawn, which re-import __main__.
if __name__ == "__main__":
    sys.exit(main())
