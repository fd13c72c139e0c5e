"""Soak test for autoresume: many random SIGKILL/SIGTERM interruptions of one tiny CPU run.

    python -m bench.soak_resume [--interruptions 20] [--seed 0] [--workdir DIR]

One uninterrupted reference run, then the same recipe started again and again: each attempt is
interrupted at a random batch (and a random moment inside it) with SIGKILL or SIGTERM, until the
requested number of interruptions is reached; a last attempt runs to the end. Printed:
- per attempt: the signal, where it resumed, whether its batches (sample hashes and losses) equal
  the reference run's, time from restart to the first new training step (with and without the
  imports), and for SIGTERM the time from the signal to the stored checkpoint;
- how many attempts continued identically, and whether the final weights equal the reference.

Each attempt is a real `train.py` process (scenarios/resume_driver.py adds a recorder), so a run of
20 interruptions takes several minutes, mostly Python imports.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scenarios import resume as rs

SAVE_EVERY = 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interruptions", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="default: a new temp folder")
    return parser.parse_args(argv)


def write_recipe(folder: Path, shards: Path, max_batches: int) -> Path:
    recipe = rs.write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    text = recipe.read_text().replace(f"max_duration: {rs.MAX_BATCHES}ba", f"max_duration: {max_batches}ba")
    recipe.write_text(text.replace(f"save_interval: {rs.SAVE_EVERY}ba", f"save_interval: {SAVE_EVERY}ba"))
    return recipe


def attempt(recipe: Path, tag: str, rng: random.Random, target: int | None) -> tuple[rs.Run, int | None]:
    """One process, interrupted once batch `target` is recorded (None: it runs to the end)."""
    if target is None:
        return rs.run(recipe, tag, cwd=recipe.parent), None
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    proc, record, weights = rs.start(recipe, tag, cwd=recipe.parent, sleep=0.1)
    started = time.monotonic()
    try:
        rs.wait_for_batch(record, target, proc)
    except AssertionError:
        pass  # finished or failed early: reported below
    time.sleep(rng.uniform(0, 0.15))  # sometimes mid-batch, sometimes mid-save
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    return rs.finish(proc, record, weights, started), sig


def _last_batch(ckpt: Path) -> int:
    names = sorted((ckpt / "manifests").glob("ba*-rank00000.json")) if ckpt.exists() else []
    return int(names[-1].name[2:12]) if names else 0


def same_as_reference(run: rs.Run, reference: list[dict]) -> bool:
    rows = run.batches()
    by_batch = {r["batch"]: r for r in reference}
    return bool(rows) and all(
        r["ids"] == by_batch[r["batch"]]["ids"] and r["loss"] == by_batch[r["batch"]]["loss"] for r in rows
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="soak-resume-"))
    shards = rs.write_shards(work / "shards")
    ref_dir, soak_dir = work / "reference", work / "soak"
    ref_dir.mkdir(parents=True, exist_ok=True)
    soak_dir.mkdir(parents=True, exist_ok=True)
    # Long enough that the interruptions, a few batches apart, do not reach the end.
    max_batches = 3 * args.interruptions + 12
    print(
        f"soak: {args.interruptions} interruptions of a {max_batches}-batch run, checkpoint every {SAVE_EVERY}"
    )
    reference = rs.run(write_recipe(ref_dir, shards, max_batches), "reference", cwd=ref_dir)
    if reference.returncode != 0:
        print(reference.output[-3000:])
        return 1
    ref_rows = reference.batches()
    recipe = write_recipe(soak_dir, shards, max_batches)

    identical, restarts, restarts_after_import, saves = 0, [], [], []
    for i in range(args.interruptions + 1):
        done = _last_batch(soak_dir / "ckpt")
        target = None if i == args.interruptions else done + rng.randint(1, 2 * SAVE_EVERY)
        if target is not None and target > max_batches - 3:
            target = None  # too close to the end to interrupt: finish instead
        run, sig = attempt(recipe, f"attempt{i:02d}", rng, target)
        rows = run.batches()
        ok = same_as_reference(run, ref_rows)
        identical += ok
        if rows and i > 0:
            restarts.append(rows[0]["time"] - rows[0]["process_started"])
            restarts_after_import.append(rows[0]["time"] - rows[0]["imported"])
        save = re.search(r"stored ([0-9.]+) s after the signal", run.output)
        if save:
            saves.append(float(save.group(1)))
        resumed = re.search(r"from the checkpoint at batch (\d+)", run.output)
        print(
            f"attempt {i:2d}: {signal.Signals(sig).name if sig else 'to the end':10s} exit {run.returncode:4d}  "
            f"resumed at {resumed.group(1) if resumed else '-':>3}  batches "
            f"{rows[0]['batch'] if rows else '-'}..{rows[-1]['batch'] if rows else '-'}  "
            f"identical to reference: {ok}",
            flush=True,
        )
        if sig is None:
            break
    final_ok = False
    if reference.weights.exists() and run.weights.exists():
        try:
            rs.assert_same_weights(reference.weights, run.weights)
            final_ok = True
        except AssertionError:
            pass
    interrupted = i if sig is None else i + 1
    print(f"\nattempts whose batches equal the reference run: {identical}/{i + 1}")
    print(f"final weights identical to the uninterrupted run: {final_ok} (after {interrupted} interruptions)")
    if restarts:
        print(
            f"restart to first new training step: median {statistics.median(restarts):.1f} s "
            f"({statistics.median(restarts_after_import):.1f} s after imports)"
        )
    if saves:
        print(
            f"SIGTERM to stored checkpoint: median {statistics.median(saves):.2f} s, max {max(saves):.2f} s"
        )
    return 0 if final_ok and identical == i + 1 and interrupted >= args.interruptions else 1


if __name__ == "__main__":
    sys.exit(main())
