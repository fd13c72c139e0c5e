"""What a checkpoint costs: stall sync vs background, SIGTERM-to-durable, restart, and the 7B projection.

    python -m bench.checkpoint [--caps 20MB/s,100MB/s] [--sizes small,large] [--step-s 0.5] [--workdir DIR]

Real `train.py` processes (scenarios/resume_driver.py, the resume harness's tiny shards and
recipe with a wider model) save to a moto S3 server on loopback behind a bandwidth cap
(scenarios/proxy.py's rate cap, both directions). Each step sleeps `--step-s` after its work (the
driver's LLM_TEST_BATCH_SLEEP), standing in for GPU compute: the training thread waits while the
CPU is free for an upload, as on a GPU node. For each checkpoint size and cap, side by side:

- stall per save: the seconds the training thread spends in each periodic save (every 4 steps:
  from the save's batch end to the next batch's start, less that gap after a batch without a
  save), synchronous (`checkpoint.background_upload=false`) and background, and as a share of the
  interval's training time;
- upload: seconds from the save to its manifest stored, and the achieved bandwidth;
- SIGTERM to durable: a background run held after batch 6 gets SIGTERM; the seconds from the
  signal to the checkpoint stored (the `[preemption]` line);
- restart: the same command in a new, empty folder resumes from S3; the `[restart]` line's
  phases (imports, checkpoint with its download and bandwidth, Trainer and load, loader resume,
  first step).

Then the 7B recipe on 8 and 64 GPUs, from the memory plan (`llm.memory_plan.checkpoint_cost`) at
the stated bandwidths: bytes per rank, seconds per save, stall share and the work a preemption
loses with and without notice, for save intervals of 50, 200 and 1,000 batches.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llm.checkpoint.sizes import DEFAULT_DISK_BANDWIDTH, DEFAULT_UPLOAD_BANDWIDTH, NOTICES_S, parse_bandwidth
from llm.config import load_config
from llm.memory_plan import ANCHOR_MFU, PEAK_BF16_FLOPS, checkpoint_cost, describe
from scenarios import resume as rs
from scenarios.proxy import Proxy

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # name -> model overrides (vocab 256, seq 32 from the harness)
    "small": ["model.dim=128", "model.n_layers=4", "model.n_heads=4"],
    "large": ["model.dim=320", "model.n_layers=4", "model.n_heads=4"],
}
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
INFO = {"LLM_TEST_LOG_INFO": "llm.checkpoint.publisher"}  # the driver prints the publisher's info lines
INTERVALS = (50, 200, 1000)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--caps", default="20MB/s,100MB/s", help="bandwidth caps to S3, comma-separated")
    parser.add_argument("--sizes", default="small,large", help=f"checkpoint sizes: {', '.join(SIZES)}")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds each step waits (GPU compute)")
    parser.add_argument(
        "--upload-bandwidth", default=DEFAULT_UPLOAD_BANDWIDTH, help="per node, 7B projection"
    )
    parser.add_argument("--disk-bandwidth", default=DEFAULT_DISK_BANDWIDTH, help="per node, 7B projection")
    parser.add_argument("--workdir", default=None, help="default: a new temp folder, deleted at the end")
    args = parser.parse_args(argv)
    try:
        args.cap_rates = [(c.strip(), parse_bandwidth(c, "--caps")) for c in args.caps.split(",")]
    except ValueError as err:
        parser.error(str(err))
    args.size_names = [s.strip() for s in args.sizes.split(",")]
    unknown = [s for s in args.size_names if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    return args


class Server:
    """moto's S3 server as its own process (its request handling stays off the throttle's GIL)."""

    def __init__(self):
        self.port = rs.free_port()
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


# --- one measurement -----------------------------------------------------------------------------


def stall_per_save(rows: list[dict]) -> float:
    """Mean seconds the training thread spent between a periodic save's batch end and the next
    batch's start (the save), less the same gap after batches without a save (the step's sleep and
    the other callbacks): the save's own stall, apart from the noise of the steps' compute."""
    end = {r["batch"]: r["time"] for r in rows}
    start = {r["batch"]: r["started"] for r in rows}
    gaps = {b: start[b + 1] - end[b] for b in end if b + 1 in start}
    saves = [b for b in gaps if b % rs.SAVE_EVERY == 0]
    clean = statistics.median(g for b, g in gaps.items() if b not in saves)
    return statistics.mean(gaps[b] - clean for b in saves)


def uploads(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"stored in \S+ \(([0-9.]+) s after the save\)", output)]


def train(recipe: Path, tag: str, folder: Path, env: dict, overrides: list[str], step_s: float) -> rs.Run:
    started = time.monotonic()
    proc, record, weights = rs.start(
        recipe, tag, cwd=folder, overrides=overrides, sleep=step_s, env=env, folder=folder
    )
    return rs.finish(proc, record, weights, started, timeout=900)


def measure(
    work: Path, shards: Path, server: Server, size: str, cap: tuple[str, float], step_s: float
) -> dict:
    name = f"{size}-{cap[0].replace('/', 'p')}"
    bucket = re.sub(r"[^a-z0-9-]", "-", f"bench-{name}".lower())
    server.create_bucket(bucket)
    throttle = Proxy(server.port, rate=cap[1])
    env = {"S3_ENDPOINT_URL": throttle.endpoint, **CREDENTIALS, **INFO}
    out: dict = {"size": size, "cap": cap[0]}
    try:
        for mode in ("sync", "background"):
            folder = work / name / mode
            folder.mkdir(parents=True)
            save = f"s3://{bucket}/{mode}"
            recipe = rs.write_recipe(folder / "recipe.yaml", shards, save, cache=folder / "cache")
            over = [*SIZES[size], f"checkpoint.background_upload={str(mode == 'background').lower()}"]
            run = train(recipe, mode, folder, env, over, step_s)
            if run.returncode != 0:
                raise RuntimeError(f"{name} {mode}: exit {run.returncode}\n{run.output[-3000:]}")
            out[f"stall_{mode}"] = stall_per_save(run.batches())
            out[f"upload_{mode}"] = statistics.mean(uploads(run.output)[:-1] or [float("nan")])
            out["step"] = statistics.median(
                b["time"] - a["time"] for a, b in zip(run.batches()[:3], run.batches()[1:4], strict=False)
            )
        out.update(sigterm_and_restart(work / name, shards, bucket, env, SIZES[size], step_s))
    finally:
        throttle.close()
    return out


def sigterm_and_restart(
    root: Path, shards: Path, bucket: str, env: dict, model: list[str], step_s: float
) -> dict:
    """SIGTERM after batch 6 (background uploads), then the same command on an empty machine."""
    a, b = root / "preempted", root / "restarted"
    a.mkdir()
    b.mkdir()
    save = f"s3://{bucket}/preempted"
    recipe = rs.write_recipe(a / "recipe.yaml", shards, save, cache=a / "cache")
    first = rs.interrupt(recipe, "a", cwd=a, at_batch=6, sig=signal.SIGTERM, overrides=model, env=env)
    durable = re.search(r"stored ([0-9.]+) s after the signal", first.output)
    if first.returncode != 143 or durable is None:
        raise RuntimeError(f"SIGTERM run: exit {first.returncode}\n{first.output[-3000:]}")
    recipe = rs.write_recipe(b / "recipe.yaml", shards, save, cache=b / "cache")
    second = train(recipe, "b", b, env, model, step_s)
    line = next((x for x in second.output.splitlines() if x.startswith("[restart]")), "")
    if second.returncode != 0 or not line:
        raise RuntimeError(f"restart: exit {second.returncode}\n{second.output[-3000:]}")
    phases = dict(
        (k.strip(), float(v))
        for k, v in re.findall(r"([A-Za-z ]+?) ([0-9.]+) s(?=[ ,(]|$)", line.split(": ", 1)[1])
    )
    size = re.search(r"([0-9.]+) MB downloaded at ([0-9.]+) MB/s", line)
    first_step = re.search(r"first step ([0-9.]+) s after the process started", line)
    return {
        "sigterm_durable": float(durable.group(1)),
        "restart_total": float(first_step.group(1)) if first_step else float("nan"),
        "restart_phases": phases,
        "mb_per_rank": float(size.group(1)) if size else float("nan"),
        "download_mbps": float(size.group(2)) if size else float("nan"),
    }


# --- printing ------------------------------------------------------------------------------------


def print_measured(rows: list[dict], step_s: float) -> None:
    every = rs.SAVE_EVERY
    print(
        f"\nMeasured (loopback moto S3 behind a bandwidth cap, a save every {every} steps, each step "
        f"{step_s:g} s of stand-in compute):"
    )
    head = (
        f"{'size':6s} {'cap':>9s} {'MB/rank':>8s} {'step s':>7s} {'stall sync':>11s} {'stall bg':>9s} "
        f"{'sync/bg':>8s} {'share sync':>11s} {'share bg':>9s} {'upload s':>9s} {'up MB/s':>8s} "
        f"{'SIGTERM->durable':>17s} {'restart s':>10s} {'down MB/s':>10s}"
    )
    print(head)
    for r in rows:
        interval = every * r["step"]
        mb = r["mb_per_rank"]
        ratio = r["stall_sync"] / r["stall_background"] if r["stall_background"] > 0 else float("inf")
        print(
            f"{r['size']:6s} {r['cap']:>9s} {mb:8.1f} {r['step']:7.2f} {r['stall_sync']:11.2f} "
            f"{r['stall_background']:9.2f} {ratio:8.1f} {100 * r['stall_sync'] / interval:10.1f}% "
            f"{100 * r['stall_background'] / interval:8.1f}% {r['upload_background']:9.2f} "
            f"{mb / r['upload_background']:8.1f} {r['sigterm_durable']:17.2f} {r['restart_total']:10.1f} "
            f"{r['download_mbps']:10.1f}"
        )
    print("\nRestart phases (seconds, from the [restart] line of the run resumed on an empty folder):")
    names = ["imports", "checkpoint", "data and model", "Trainer and load", "loader resume", "first step"]
    print(f"{'size':6s} {'cap':>9s} " + " ".join(f"{n:>16s}" for n in names))
    for r in rows:
        print(
            f"{r['size']:6s} {r['cap']:>9s} "
            + " ".join(f"{r['restart_phases'].get(n, float('nan')):16.2f}" for n in names)
        )


def projection(upload_bw: str, disk_bw: str) -> list[str]:
    cfg = load_config(REPO / "recipes" / "7b.yaml")
    seq = cfg.model.max_seq_len
    summary = describe(cfg.model, seq, cfg.training.global_batch_size * seq)
    params = summary.params
    lines = [
        f"7B recipe projection (memory plan: 12 bytes a parameter; {ANCHOR_MFU:.0%} MFU on H100; "
        f"{upload_bw} to S3 and {disk_bw} local write per node):",
        "| GPUs | GB per rank | write s | upload s | SIGTERM save s (30 s / 120 s notice) | save_interval | "
        "stall background | stall sync | lost per preemption: no notice | 30 s notice | 120 s notice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for gpus in (8, 64):
        step = summary.flops_per_step / (gpus * PEAK_BF16_FLOPS["H100"] * ANCHOR_MFU)
        cost = checkpoint_cost(cfg, gpus, params, step, parse_bandwidth(upload_bw), parse_bandwidth(disk_bw))
        fits = " / ".join("fits" if cost.fits(n) else "no" for n in NOTICES_S)
        for interval in INTERVALS:
            lost = cost.lost_without_save_s(interval)
            noticed = " | ".join("restart only" if cost.fits(n) else _minutes(lost) for n in NOTICES_S)
            lines.append(
                f"| {gpus} | {cost.size.per_rank / 1e9:.2f} | {cost.write_s:.0f} | {cost.upload_s:.0f} | "
                f"{cost.sync_stall_s:.0f} ({fits}) | {interval} ({_minutes(interval * step)}) | "
                f"{100 * cost.stall_share(interval):.2f}% | {100 * cost.stall_share(interval, False):.2f}% | "
                f"{_minutes(lost)} | {noticed} |"
            )
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-checkpoint-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards = rs.write_shards(work / "shards")
    server = Server()
    rows = []
    try:
        for size in args.size_names:
            for cap in args.cap_rates:
                print(f"measuring {size} checkpoints at {cap[0]} ...", flush=True)
                rows.append(measure(work, shards, server, size, cap, args.step_s))
    finally:
        server.stop()
    print_measured(rows, args.step_s)
    print()
    print("\n".join(projection(args.upload_bandwidth, args.disk_bandwidth)))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
