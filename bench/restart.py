"""Restart-to-first-training-step time on the demo recipe: SIGTERM, restart, repeat.

    python -m bench.restart [--restarts 3] [--save-every 5] [--workdir DIR] [key=value ...]

Trains recipes/demo.yaml (the demo shards and tokenizer from `make demo`) in its own temp folder
and run name, with a checkpoint every `--save-every` batches: the first process runs until a
periodic checkpoint is stored, then gets SIGTERM (it stores a checkpoint at the interrupted batch
and exits 143). The same command is then restarted `--restarts` times; each restart is stopped
with SIGTERM as soon as it has trained its first new step. Printed per restart and as medians,
the phases of the run's own `[restart]` line (llm/checkpoint/restart.py): process and imports
(process start to the trainer's process group: interpreter, imports, recipe, data checks),
process group, checkpoint fetch (run lock, manifests scanned, files verified), data and model,
Trainer (Composer's init up to the load), checkpoint load, data position (streaming's resume to
the first batch), first step; then start->step (the sum) and the seconds from each SIGTERM to the
stored checkpoint. Each process is a real `train.py` (through scenarios/resume_driver.py), as in `python -m bench.soak_resume`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from llm.checkpoint import restart
from scenarios import resume as rs

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "recipes" / "demo.yaml"
DEMO_INPUTS = [REPO / "data/demo/shards/train/index.json", REPO / "data/demo/tokenizer.model"]
RUN_NAME = "bench-restart"
PHASES = list(restart.LABELS)
SHORT = {"process and imports": "imports", "checkpoint fetch": "fetch", "checkpoint load": "load"}


def restart_phases(output: str) -> dict[str, float] | None:
    """The phases of a run's `[restart]` line (llm/checkpoint/restart.py), or None without one."""
    phases = restart.parse(output)
    return None if phases is None else {k: v for k, v in phases.items() if k in PHASES}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint interval in batches")
    parser.add_argument("--workdir", default=None, help="default: a new temp folder, deleted at the end")
    parser.add_argument(
        "overrides", nargs="*", help="more recipe overrides, e.g. callbacks.generate.enabled=false"
    )
    args = parser.parse_args(argv)
    if args.restarts < 1 or args.save_every < 1:
        parser.error("--restarts and --save-every must each be at least 1")
    return args


def overrides(work: Path, save_every: int, extra: list[str]) -> list[str]:
    return [
        f"run_name={RUN_NAME}",
        f"run_dir={work / 'run'}",
        f"checkpoint.save_folder={work / 'checkpoints'}",
        f"checkpoint.save_interval={save_every}ba",
        f"data.cache_root={work / 'cache'}",
        "loggers.progress_bar=false",  # plain console lines in the logs
        *extra,
    ]


def run_once(args, work: Path, tag: str, until_batch: int | None) -> tuple[rs.Run, str | None]:
    """One process, SIGTERM once batch `until_batch` (None: its first new batch) is recorded."""
    proc, record, weights = rs.start(
        RECIPE,
        tag,
        cwd=REPO,
        overrides=overrides(work, args.save_every, args.overrides),
        folder=work,
    )
    try:
        rs.wait_for_batch(record, until_batch or 0, proc, timeout=300)
        os.killpg(proc.pid, signal.SIGTERM)  # stores a checkpoint at the batch it is in, exits 143
        result = rs.finish(proc, record, weights, 0.0, timeout=120)
    finally:
        rs.kill_group(proc)
    resumed = re.search(r"from the checkpoint at batch (\d+)", result.output)
    return result, resumed.group(1) if resumed else None


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [str(p.relative_to(REPO)) for p in DEMO_INPUTS if not p.exists()]
    if missing:
        print(
            f"missing {', '.join(missing)}: run `make demo` first, or only its inputs: "
            "`make data/demo/shards/train/index.json`",
            file=sys.stderr,
        )
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-restart-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    status = _bench(args, work)
    if status == 0 and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return status


def _bench(args, work: Path) -> int:
    print(
        f"restart benchmark: {RECIPE.relative_to(REPO)}, checkpoint every {args.save_every} batches, in {work}"
    )
    columns = [*PHASES, "start->step"]
    print(f"{'':28s}" + "".join(f"{SHORT.get(c, c):>16s}" for c in columns) + "   (seconds)")
    rows: list[dict[str, float]] = []
    saves: list[float] = []
    # The first process trains past its first periodic checkpoint, then is stopped.
    for i in range(args.restarts + 1):
        tag = "first" if i == 0 else f"restart{i}"
        run, resumed = run_once(args, work, tag, args.save_every + 1 if i == 0 else None)
        phases = restart_phases(run.output)
        if run.returncode != 128 + signal.SIGTERM or not run.batches() or (i > 0 and phases is None):
            print(
                f"{tag}: exit {run.returncode}, resumed at {resumed}; its log, {work / (tag + '.log')}, ends:"
            )
            print(run.output[-4000:])
            return 1
        save = re.search(r"stored ([0-9.]+) s after the signal", run.output)
        if save:
            saves.append(float(save.group(1)))
        if i == 0:
            continue
        first = run.batches()[0]
        phases["start->step"] = first["time"] - first["process_started"]
        rows.append(phases)
        label = f"restart {i} (from batch {resumed})"
        print(f"{label:28s}" + "".join(f"{phases.get(c, float('nan')):>16.2f}" for c in columns), flush=True)
    medians = {c: statistics.median(r.get(c, float("nan")) for r in rows) for c in columns}
    print(f"{'median of the restarts':28s}" + "".join(f"{medians[c]:>16.2f}" for c in columns))
    after = medians["start->step"] - medians["process and imports"]
    print(
        f"\nrestart to first new training step: median {medians['start->step']:.1f} s, {after:.1f} s after "
        "imports (target: under 10 s after imports)"
    )
    if saves:
        print(
            f"SIGTERM to stored checkpoint: median {statistics.median(saves):.2f} s, max {max(saves):.2f} s "
            f"({len(saves)} stops)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
