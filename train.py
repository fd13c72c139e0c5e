"""Train a model from a YAML recipe: `composer train.py recipes/demo.yaml [key=value ...]`.

Also `python train.py ...` (one process) and `train.py RECIPE --dry-run [--gpus N]` (sizes and
memory plan, no data, nothing allocated); overrides may stand before or after the flags.
`--print-config` prints the resolved recipe in full (by default one line names its config.yaml). Everything lives in the `llm` package; this file only
parses the command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    # The dry run is `llm inspect`: the same arguments, defaults and output.
    from llm.commands.inspect_recipe import add_arguments

    parser = argparse.ArgumentParser(
        prog="train.py",
        description=__doc__.splitlines()[0],
        epilog="Every recipe key (type, default, range, meaning, what a resume does with it): `llm config` "
        "or docs/config.md. A recipe for your own corpus and tokenizer: recipes/template.yaml.",
    )
    add_arguments(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print sizes and the memory plan (as `llm inspect`), do not train",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved recipe in full at the start (by default one line names the run's "
        "config.yaml, which holds it)",
    )
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; `key=value` overrides may come before or after the flags."""
    from llm.commands import parse_command_line

    return parse_command_line(build_parser(), list(argv))


def main(
    argv: Sequence[str] | None = None, extra_callbacks: Sequence = (), *, owns_process: bool = False
) -> int:
    """The command; `owns_process`: this call is the whole process (`__main__`), so a SIGTERM may
    end the process within what it leaves (llm/checkpoint/preemption.py), not only the call."""
    if owns_process:  # before the heavy imports: the collector waits for the first step (llm/startup.py)
        from llm import startup

        startup.begin()
    from llm.checkpoint.resume import RunAlreadyComplete
    from llm.errors import ConfigError, SpikeStop
    from shards.errors import ShardsError
    from storage import StorageError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.dry_run:
            from llm.commands import inspect_recipe

            return inspect_recipe.run(args)
        from llm.config import load_config

        cfg = load_config(args.recipe, args.overrides)
        from llm.trainer import train

        if owns_process:
            from llm.checkpoint.preemption import own_the_process

            own_the_process()

        train(cfg, extra_callbacks, print_config=args.print_config)
    except (ConfigError, ShardsError) as err:  # a problem with the recipe or the data: say which
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunAlreadyComplete as done:  # a restarted job whose run already finished: success
        print(f"[resume] {done}", file=sys.stderr, flush=True)
        return 0
    except StorageError as err:  # storage failed after retries; resumable from the last save
        print(f"error: {err}", file=sys.stderr)
        return 1
    except SpikeStop as stop:  # the guard's limit (docs/guard.md): a person looks before resuming
        print(str(stop), file=sys.stderr, flush=True)
        return SpikeStop.EXIT_CODE
    except Exception as err:
        from llm.checkpoint.preemption import exit_request

        stop = exit_request(err)  # a second signal cut a save short: exit as it asked, no traceback
        if stop is None:
            raise
        return stop.code if isinstance(stop.code, int) else 1
    return 0


# Composer's checkpoint uploader starts processes with spawn, which re-import __main__.
if __name__ == "__main__":
    sys.exit(main(owns_process=True))
