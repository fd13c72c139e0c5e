"""Preemption soak: goodput of a run saving by `auto` to S3 behind a bandwidth cap, killed again and again.

    python -m bench.soak_goodput [--interruptions 8] [--batches 60] [--cap 20MB/s] [--notice 8]
                                 [--seed 0] [--workdir DIR] [--before TREE] [--spare-node]

A small recipe (the resume harness's shards, a wider model: ~10 MB checkpoints) saves with
`checkpoint.save_interval=auto` to a moto S3 server on loopback behind a bandwidth cap
(`scenarios/proxy.py`), each step sleeping 0.2 s for GPU compute. One uninterrupted run is the
reference; then the same command is started again and again: each attempt gets SIGKILL (no
notice) or SIGTERM with `preemption.notice_s` at a random moment, until the requested number of
interruptions; a last attempt runs to the end. Printed:

- per attempt: the signal, where it resumed, the batches it ran, whether they equal the reference
  run's (sample hashes and losses), the `[preemption]` line's outcome, and for a restart its time
  from the process's start to its first new step with the parts of its `[restart]` line
  (llm/checkpoint/restart.py);
- goodput = the steps of the uninterrupted schedule / the steps executed over all attempts, and the
  time lost split into redone steps (executed twice), restarts (process start to its first step)
  and stalls (the training thread's part of the saves: each save's gap beyond a plain step's);
- whether the final weights equal the reference's (bit-identical);
- for each SIGTERM, the seconds from the signal to the process's exit, against the notice (the
  process must be gone before the platform's kill);
- the restarts' median and range, and each part's median.

`--before TREE` runs a second soak beside this one, of the code checked out in TREE (e.g. `git
worktree add /tmp/old-restart <commit>`; its own scenarios/resume_driver.py, this venv): its own
bucket prefix and folder, the same signals at the same moments, each of its attempts right before
this code's, so that both see the same load; then the two restarts' medians and their ratio.
Both must end identical to the (this code's) uninterrupted run. `--spare-node` gives each attempt a
temp folder of its own, as a restart on another machine would find (no copy of the checkpoint on
its disk, `llm.checkpoint.local_copy`); by default they share this machine's, as a restart on the
node that was preempted does.
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
from dataclasses import dataclass, field
from pathlib import Path

from bench.checkpoint import CREDENTIALS, SIZES, Server
from bench.soak_resume import same_as_reference
from llm.checkpoint import restart
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
    parser.add_argument(
        "--before",
        default=None,
        help="a checkout of older code: its soak runs beside this one (module docstring)",
    )
    parser.add_argument(
        "--spare-node", action="store_true", help="each attempt on an empty temp folder (another machine)"
    )
    args = parser.parse_args(argv)
    if args.before is not None and not (Path(args.before) / "scenarios" / "resume_driver.py").is_file():
        parser.error(
            f"--before {args.before}: no scenarios/resume_driver.py there; give a checkout of this project"
        )
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


@dataclass
class Arm:
    """One soak: a code tree (None: this one), its folder and bucket prefix, what its attempts did."""

    name: str
    tree: Path | None
    folder: Path
    recipe: Path | None = None
    executed: int = 0
    identical: int = 0
    attempts: int = 0
    restarts: list[float] = field(default_factory=list)  # process start to first new step, per restart
    by_attempt: dict[int, float] = field(default_factory=dict)  # the same, by attempt number
    parts: list[dict[str, float]] = field(default_factory=list)  # the [restart] lines' phases
    stalls: list[float] = field(default_factory=list)
    exits: list[float] = field(default_factory=list)
    weights: Path | None = None  # the final weights, of the attempt that reached the end

    def start(self, tag: str, overrides: list[str], env: dict):
        driver = (self.tree / "scenarios" / "resume_driver.py") if self.tree else rs.DRIVER
        env = {**env, "PYTHONPATH": str(self.tree)} if self.tree else env
        return rs.start(
            self.recipe, tag, cwd=self.folder, overrides=overrides, sleep=STEP_S, env=env, driver=driver
        )


def soak(args, rng: random.Random, work: Path, shards: Path, env: dict, model: list[str]) -> int:
    ref_dir = work / "reference"
    ref_dir.mkdir(exist_ok=True)
    arms = [Arm("after", None, work / "soak")]
    if args.before:
        arms.insert(0, Arm("before", Path(args.before).resolve(), work / "soak-before"))
    for arm in arms:
        arm.folder.mkdir(exist_ok=True)
        arm.recipe = write_recipe(arm.folder, shards, f"s3://soak/run-{arm.name}", args.batches)
    print(
        f"soak: {args.interruptions} interruptions of a {args.batches}-batch run saving by auto to S3 at "
        f"{args.cap}, steps of {STEP_S} s; SIGTERM with a {args.notice:g} s notice, or SIGKILL"
        + (f"; beside it the code in {args.before} (before), attempt by attempt" if args.before else "")
        + ("; each attempt on a spare node (an empty temp folder)" if args.spare_node else ""),
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
    notice = [f"preemption.notice_s={args.notice:g}", "preemption.margin_s=1"]
    for i in range(args.interruptions + 1):
        last = i == args.interruptions
        sig = None if last else rng.choice([signal.SIGKILL, signal.SIGTERM])
        delay = rng.uniform(2.0, 12.0)
        for arm in arms:
            here = env
            if args.spare_node:  # a machine of its own: nothing of the earlier attempts on its disk
                (arm.folder / f"tmp{i:02d}").mkdir(exist_ok=True)
                here = {**env, "TMPDIR": str(arm.folder / f"tmp{i:02d}")}
            run = attempt(arm, i, sig, delay, [*model, *notice], here, ref_rows)
            if last and run.returncode != 0:
                print(run.output[-3000:])
                return 1
    print()
    ok = True
    for arm in arms:
        ok &= summarize(arm, args, reference, plain_step, label=f"{arm.name}: " if len(arms) > 1 else "")
    if len(arms) > 1:
        before, after = (statistics.median(a.restarts) if a.restarts else float("nan") for a in arms)
        print(
            f"\nrestart, process start to first new step, median of {len(arms[1].restarts)} restarts each: "
            f"{before:.2f} s before, {after:.2f} s after: {after / before:.2f} of it "
            f"({100 * (1 - after / before):.0f}% shorter); load average {os.getloadavg()[0]:.1f} at the end"
        )
        # Attempt by attempt, where both restarted (an arm whose run ended sooner restarts no more)
        both = sorted(set(arms[0].by_attempt) & set(arms[1].by_attempt))
        if both:
            ratios = [arms[1].by_attempt[i] / arms[0].by_attempt[i] for i in both]
            print(
                f"the same attempts ({len(both)}, where both restarted): medians "
                f"{statistics.median(arms[0].by_attempt[i] for i in both):.2f} s before, "
                f"{statistics.median(arms[1].by_attempt[i] for i in both):.2f} s after; after/before attempt by "
                f"attempt: median {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}"
            )
    return 0 if ok else 1


def attempt(
    arm: Arm, i: int, sig, delay: float, overrides: list[str], env: dict, ref_rows: list[dict]
) -> rs.Run:
    """One attempt of `arm`: started, signalled `delay` s after its first batch (None: to the end)."""
    proc, record, weights = arm.start(f"attempt{i:02d}", overrides, env)
    t0, sent = time.monotonic(), None
    if sig is not None:
        try:
            rs.wait_for_batch(record, 1, proc, timeout=600)  # it trains; then a random moment
            time.sleep(delay)
        except AssertionError:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            sent = time.monotonic()
    run = rs.finish(proc, record, weights, t0, timeout=1800)
    if run.weights.exists():
        arm.weights = run.weights
    gone = time.monotonic() - sent if sig == signal.SIGTERM and sent is not None else None
    if gone is not None:
        arm.exits.append(gone)
    arm.attempts += 1
    rows = run.batches()
    arm.executed += len(rows)
    parts = restart.parse(run.output)
    took = None
    if rows and i > 0:
        took = (parts or {}).get("total", rows[0]["time"] - rows[0]["process_started"])
        arm.restarts.append(took)
        arm.by_attempt[i] = took
        arm.parts.append(parts or {})
    arm.stalls.append(stall_seconds(rows))
    ok = same_as_reference(run, ref_rows) or not rows
    arm.identical += ok
    resumed = re.search(r"from the checkpoint at batch (\d+)", run.output)
    told = next((x for x in run.output.splitlines() if x.startswith("[preemption]")), "")
    line = next((x for x in run.output.splitlines() if x.startswith("[restart]")), "")
    print(
        f"{arm.name + ' ' if arm.tree else ''}attempt {i:2d}: {signal.Signals(sig).name if sig else 'to the end':10s} "
        f"exit {run.returncode:4d}  resumed at {resumed.group(1) if resumed else '-':>3}  batches "
        f"{rows[0]['batch'] if rows else '-'}..{rows[-1]['batch'] if rows else '-'}  identical: {ok}"
        + (f"  restart {took:.1f} s" if took is not None else "")
        + (f"  exit {gone:.2f} s after the signal" if gone is not None else "")
        + (f"\n            {line.split(': ', 1)[1]}" if line else "")
        + (f"\n            {told[13:]}" if told else ""),
        flush=True,
    )
    return run


def summarize(arm: Arm, args, reference: rs.Run, plain_step: float, label: str = "") -> bool:
    final_ok = False
    if arm.weights is not None:
        try:
            rs.assert_same_weights(reference.weights, arm.weights)
            final_ok = True
        except AssertionError:
            pass
    redone = arm.executed - args.batches
    goodput = args.batches / arm.executed if arm.executed else 0.0
    useful = args.batches * plain_step
    restarts, stalls = arm.restarts, arm.stalls
    lost = redone * plain_step + sum(restarts) + sum(stalls)
    print(f"{label}attempts whose batches equal the reference run: {arm.identical}/{arm.attempts}")
    if arm.exits:
        exits = arm.exits
        print(
            f"{label}SIGTERM to exit: {min(exits):.2f}-{max(exits):.2f} s over {len(exits)} SIGTERM(s), notice "
            f"{args.notice:g} s less its 1 s margin: {'all within it' if max(exits) < args.notice - 1 else 'NOT all within it'}"
        )
    print(
        f"{label}final weights identical to the uninterrupted run: {final_ok} (after {args.interruptions} interruptions)"
    )
    print(
        f"{label}goodput (steps): {goodput:.1%} = {args.batches} scheduled / {arm.executed} executed; "
        f"{redone} steps redone ({redone / max(1, args.interruptions):.1f} per interruption)"
    )
    each = (
        f"median {statistics.median(restarts):.1f} s, {min(restarts):.1f}-{max(restarts):.1f} s"
        if restarts
        else "none"
    )
    print(
        f"{label}time: {useful:.0f} s of useful steps, {lost:.0f} s lost = redone steps {redone * plain_step:.0f} s + "
        f"restarts {sum(restarts):.0f} s ({len(restarts)}, {each}) + save stalls {sum(stalls):.1f} s; "
        f"goodput (time) {useful / (useful + lost):.1%}"
    )
    names = [n for n in dict.fromkeys(k for p in arm.parts for k in p) if n != "total"]
    if names:
        medians = ", ".join(
            f"{n} {statistics.median(p[n] for p in arm.parts if n in p):.2f} s" for n in names
        )
        print(f"{label}restart parts, median: {medians}")
    return final_ok and arm.identical == arm.attempts


if __name__ == "__main__":
    sys.exit(main())
