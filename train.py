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
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU in GB for the dry run")
    parser.add_argument("--gpu-type", default="H100", help="GPU model for the dry run's cost (H100, A100...)")
    parser.add_argument("--mfu", type=float, help="measured MFU for the cost (default: 40%% and 50%%)")
    parser.add_argument(
        "--upload-bandwidth", default="1.25GB/s", help="a node's checkpoint upload rate (default 1.25GB/s)"
    )
    parser.add_argument(
        "--disk-bandwidth", default="2GB/s", help="a node's local write rate for a save (default 2GB/s)"
    )
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None, extra_callbacks: Sequence = ()) -> int:
    from llm.checkpoint.resume import RunAlreadyComplete
    from llm.errors import ConfigError
    from shards.errors import ShardsError
    from storage import StorageError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from llm.config import load_config

        cfg = load_config(args.recipe, args.overrides)
        if args.dry_run:
            from llm.memory_plan import describe_run

            print(
                describe_run(
                    cfg,
                    args.gpus,
                    args.gpu_gb,
                    gpu_type=args.gpu_type,
                    mfu=args.mfu,
                    upload_bandwidth=args.upload_bandwidth,
                    disk_bandwidth=args.disk_bandwidth,
                )  # fmt: skip
            )
            return 0
        from llm.trainer import train

        train(cfg, extra_callbacks)
    except (ConfigError, ShardsError) as err:  # a problem with the recipe or the data: say which
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunAlreadyComplete as done:  # a restarted job whose run already finished: success
        print(f"[resume] {done}", file=sys.stderr, flush=True)
        return 0
    except StorageError as err:  # storage failed after retries; resumable from the last save
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        from llm.checkpoint.preemption import exit_request

        stop = exit_request(err)  # a second signal cut a save short: exit as it asked, no traceback
        if stop is None:
            raise
        return stop.code if isinstance(stop.code, int) else 1
    return 0


# Composer's checkpoint uploader starts processes with spawn, which re-import __main__.
if __name__ == "__main__":
    sys.exit(main())
