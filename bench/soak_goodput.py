"""Preemption soak: goodput of a run saving by `auto` to S3 behind a bandwidth cap, killed again and again.

    python -m bench.soak_goodput [--interruptions 8] [--batches 60] [--cap 20MB/s] [--notice 8]
                                 [--seed 0] [--workdir DIR]

A small recipe (the resume harness's shards, a wider model: ~10 MB checkpoints) saves with
`checkpoint.save_interval=auto` to a moto S3 server on loopback behind a bandwidth cap
(`scenarios/proxy.py`), each step sleeping 0.2 s for GPU compute. One uninterrupted run is the
reference; then the same command is started again and again: each attempt gets SIGKILL (no
notice) or SIGTERM with `preemption.notice_s` at a random moment, until the requested number of
interruptions; a last attempt runs to the end. Printed:

- per attempt: the signal, where it resumed, the batches it ran, whether they equal the reference
  run's (sample hashes and losses), the `[preemption]` line's outcome;
- goodput = the steps of the uninterrupted schedule / the steps executed over all attempts, and the
  time lost split into redone steps (executed twice), restarts (process start to its first step)
  and stalls (the training thread's part of the saves: each save's gap beyond a plain step's);
- whether the final weights equal the reference's (bit-identical);
- for each SIGTERM, the seconds from the signal to the process's exit, against the notice (the
  process must be gone before the platform's kill).
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

from bench.checkpoint import CREDENTIALS, SIZES, Server
from bench.soak_resume import same_as_reference
from llm.checkpoint.sizes import parse_bandwidth
from scenarios import resume as rs
from scenarios.proxy import Proxy

STEP_S = 0.2  # stand-in compute per step


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--interruptions", type=int, default=8)
    parser.add_argument("--batches", type=int, default=60, help="the run's max_duration in batches")
    parser.add_argument("--cap", default="20MB/s", help="bandwidth cap to S3, both directions")
    parser.add_argument("--notice", type=float, default=8.0, help="preemption.notice_s of a SIGTERM attempt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="default: a new temp folder")
    args = parser.parse_args(argv)
    try:
        args.rate = parse_bandwidth(args.cap, "--cap")
    except ValueError as err:
        parser.error(str(err))
    return args


def write_recipe(folder: Path, shards: Path, save: str, batches: int) -> Path:
    recipe = rs.write_recipe(folder / "recipe.yaml", shards, save, cache=folder / "cache")
    text = recipe.read_text().replace(f"max_duration: {rs.MAX_BATCHES}ba", f"max_duration: {batches}ba")
    recipe.write_text(text.replace(f"save_interval: {rs.SAVE_EVERY}ba", "save_interval: auto"))
    return recipe


def stall_seconds(rows: list[dict]) -> float:
    """The training thread's time in saves: each gap between a batch's end and the next one's start
    beyond the median gap (a plain step's callbacks)."""
    gaps = [b["started"] - a["time"] for a, b in zip(rows, rows[1:], strict=False) if b.get("started")]
    if not gaps:
        return 0.0
    plain = statistics.median(gaps)
    return sum(max(0.0, g - plain) for g in gaps)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="soak-goodput-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards = rs.write_shards(work / "shards", shard_bytes=1 << 14)
    server = Server()
    server.create_bucket("soak")
    capped = Proxy(server.port, rate=args.rate)
    env = {"S3_ENDPOINT_URL": capped.endpoint, **CREDENTIALS}
    model = SIZES["small"]
    try:
        return soak(args, rng, work, shards, env, model)
    finally:
        capped.cut()
        server.stop()


def soak(args, rng: random.Random, work: Path, shards: Path, env: dict, model: list[str]) -> int:
    ref_dir, soak_dir = work / "reference", work / "soak"
    ref_dir.mkdir(exist_ok=True)
    soak_dir.mkdir(exist_ok=True)
    print(
        f"soak: {args.interruptions} interruptions of a {args.batches}-batch run saving by auto to S3 at "
        f"{args.cap}, steps of {STEP_S} s; SIGTERM with a {args.notice:g} s notice, or SIGKILL",
        flush=True,
    )
    ref_recipe = write_recipe(ref_dir, shards, "s3://soak/reference", args.batches)
    started = time.monotonic()
    proc, record, weights = rs.start(
        ref_recipe, "reference", cwd=ref_dir, overrides=model, sleep=STEP_S, env=env
    )
    reference = rs.finish(proc, record, weights, started, timeout=1800)
    if reference.returncode != 0:
        print(reference.output[-3000:])
        return 1
    ref_rows = reference.batches()
    plain_step = statistics.median(
        b["time"] - a["time"] for a, b in zip(ref_rows, ref_rows[1:], strict=False)
    )

    recipe = write_recipe(soak_dir, shards, "s3://soak/run", args.batches)
    notice = [f"preemption.notice_s={args.notice:g}", "preemption.margin_s=1"]
    executed, restarts, stalls, identical, attempts, exits = 0, [], [], 0, 0, []
    for i in range(args.interruptions + 1):
        last = i == args.interruptions
        sig = None if last else rng.choice([signal.SIGKILL, signal.SIGTERM])
        tag = f"attempt{i:02d}"
        proc, record, weights = rs.start(
            recipe, tag, cwd=soak_dir, overrides=[*model, *notice], sleep=STEP_S, env=env
        )
        t0, sent = time.monotonic(), None
        if sig is not None:
            try:
                rs.wait_for_batch(record, 1, proc, timeout=600)  # it trains; then a random moment
                time.sleep(rng.uniform(2.0, 12.0))
            except AssertionError:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
                sent = time.monotonic()
        run = rs.finish(proc, record, weights, t0, timeout=1800)
        gone = time.monotonic() - sent if sig == signal.SIGTERM and sent is not None else None
        if gone is not None:
            exits.append(gone)
        attempts += 1
        rows = run.batches()
        executed += len(rows)
        if rows:
            restarts.append(rows[0]["time"] - rows[0]["process_started"])
        stalls.append(stall_seconds(rows))
        ok = same_as_reference(run, ref_rows) or not rows
        identical += ok
        resumed = re.search(r"from the checkpoint at batch (\d+)", run.output)
        told = next((x for x in run.output.splitlines() if x.startswith("[preemption]")), "")
        print(
            f"attempt {i:2d}: {signal.Signals(sig).name if sig else 'to the end':10s} exit {run.returncode:4d}  "
            f"resumed at {resumed.group(1) if resumed else '-':>3}  batches "
            f"{rows[0]['batch'] if rows else '-'}..{rows[-1]['batch'] if rows else '-'}  identical: {ok}"
            + (f"  exit {gone:.2f} s after the signal" if gone is not None else "")
            + (f"\n            {told[13:]}" if told else ""),
            flush=True,
        )
        if last and run.returncode != 0:
            print(run.output[-3000:])
            return 1
    final_ok = False
    if run.weights.exists():
        try:
            rs.assert_same_weights(reference.weights, run.weights)
            final_ok = True
        except AssertionError:
            pass
    redone = executed - args.batches
    goodput = args.batches / executed if executed else 0.0
    useful = args.batches * plain_step
    lost = redone * plain_step + sum(restarts) + sum(stalls)
    print(f"\nattempts whose batches equal the reference run: {identical}/{attempts}")
    if exits:
        print(
            f"SIGTERM to exit: {min(exits):.2f}-{max(exits):.2f} s over {len(exits)} SIGTERM(s), notice "
            f"{args.notice:g} s less its 1 s margin: {'all within it' if max(exits) < args.notice - 1 else 'NOT all within it'}"
        )
    print(
        f"final weights identical to the uninterrupted run: {final_ok} (after {args.interruptions} interruptions)"
    )
    print(
        f"goodput (steps): {goodput:.1%} = {args.batches} scheduled / {executed} executed; "
        f"{redone} steps redone ({redone / max(1, args.interruptions):.1f} per interruption)"
    )
    print(
        f"time: {useful:.0f} s of useful steps, {lost:.0f} s lost = redone steps {redone * plain_step:.0f} s + "
        f"restarts {sum(restarts):.0f} s ({statistics.median(restarts) if restarts else 0:.1f} s each, "
        f"mostly imports) + save stalls {sum(stalls):.1f} s; goodput (time) {useful / (useful + lost):.1%}"
    )
    return 0 if final_ok and identical == attempts else 1


if __name__ == "__main__":
    sys.exit(main())
