"""What a checkpoint costs: stall of a snapshot save vs background vs sync, SIGTERM-to-durable, restart,
and the 7B projection.

    python -m bench.checkpoint [--caps 20MB/s,100MB/s] [--sizes small,large] [--step-s 0.5]
                               [--save-every 12] [--workdir DIR]

Real `train.py` processes (scenarios/resume_driver.py, the resume harness's tiny shards and
recipe with a wider model) save to a moto S3 server on loopback behind a bandwidth cap
(scenarios/proxy.py's rate cap, both directions). Each step sleeps `--step-s` after its work (the
driver's LLM_TEST_BATCH_SLEEP), standing in for GPU compute: the training thread waits while the
CPU is free for an upload, as on a GPU node. For each checkpoint size and cap, side by side:

- stall per save: the seconds the training thread spends in each periodic save (every
  `--save-every` steps, 12 by default, so that a save's upload ends before the next one in every
  mode, as `auto` would have it: from the save's batch end to the next batch's start, less that
  gap after a batch without a save), in three modes, one run each: snapshot (the default: a copy to host memory on the training
  thread, the write and the upload in the background, llm/checkpoint/saver.py), background
  (`checkpoint.snapshot=false`: Composer writes on the training thread, the upload in the
  background, as before the snapshot) and sync (`checkpoint.background_upload=false` too: the step
  waits for the write and the upload); and as a share of the interval's training time, with the
  ratios background / snapshot and sync / snapshot; the snapshot's rate (MB per rank over its stall);
- upload: seconds from the save to its manifest stored (background mode), and the achieved bandwidth;
- SIGTERM to durable: a background run held after batch 6 gets SIGTERM; the seconds from the
  signal to the checkpoint stored (the `[preemption]` line);
- restart: the same command in a new, empty folder with a temp folder of its own (an empty
  machine: no copy of the checkpoint on its disk) resumes from S3; the `[restart]` line's phases
  (llm/checkpoint/restart.py: the checkpoint fetch with its download and bandwidth among them).

Then the 7B recipe on 8 and 64 GPUs, from the memory plan (`llm.memory_plan.checkpoint_cost`) at
the stated bandwidths (a GPU's device-to-host copy `--snapshot-bandwidth`, 12 GB/s unless `make
gpu-check` measured it), and on 8 ranks whose snapshot runs at the rate measured here (the CPU
row): bytes per rank, the stall per save, the interval `auto` picks, the stall share and the work a
preemption loses without notice and with a 30 s and a 120 s one, beside fixed intervals of 200 and
1,000 batches.
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

from llm.checkpoint import restart
from llm.checkpoint.sizes import (
    DEFAULT_DISK_BANDWIDTH,
    DEFAULT_SNAPSHOT_BANDWIDTH,
    DEFAULT_UPLOAD_BANDWIDTH,
    NOTICES_S,
    parse_bandwidth,
)
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
INFO = {
    "LLM_TEST_LOG_INFO": "llm.checkpoint.publisher,llm.checkpoint.saver"
}  # the driver prints the publisher's info lines
INTERVALS = (200, 1000)  # fixed intervals beside auto's
MODES = {  # the three ways a save can run, one run each
    "snapshot": ["checkpoint.background_upload=true", "checkpoint.snapshot=true"],
    "background": ["checkpoint.background_upload=true", "checkpoint.snapshot=false"],
    "sync": ["checkpoint.background_upload=false", "checkpoint.snapshot=false"],
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--caps", default="20MB/s,100MB/s", help="bandwidth caps to S3, comma-separated")
    parser.add_argument("--sizes", default="small,large", help=f"checkpoint sizes: {', '.join(SIZES)}")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds each step waits (GPU compute)")
    parser.add_argument(
        "--save-every", type=int, default=12, help="steps between saves (each run trains 3 intervals)"
    )
    parser.add_argument(
        "--upload-bandwidth", default=DEFAULT_UPLOAD_BANDWIDTH, help="per node, 7B projection"
    )
    parser.add_argument("--disk-bandwidth", default=DEFAULT_DISK_BANDWIDTH, help="per node, 7B projection")
    parser.add_argument(
        "--snapshot-bandwidth",
        default=DEFAULT_SNAPSHOT_BANDWIDTH,
        help="device to host per GPU, 7B projection",
    )
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


def stall_per_save(rows: list[dict], every: int) -> float:
    """Mean seconds the training thread spent between a periodic save's batch end and the next
    batch's start (the save), less the same gap after batches without a save (the step's sleep and
    the other callbacks): the save's own stall, apart from the noise of the steps' compute."""
    end = {r["batch"]: r["time"] for r in rows}
    start = {r["batch"]: r["started"] for r in rows}
    gaps = {b: start[b + 1] - end[b] for b in end if b + 1 in start}
    saves = [b for b in gaps if b % every == 0]
    clean = statistics.median(g for b, g in gaps.items() if b not in saves)
    return statistics.median(gaps[b] - clean for b in saves)


def saver_seconds(output: str) -> list[float]:
    """The training thread's seconds in each save as the saver measured them (its INFO lines)."""
    return [float(x) for x in re.findall(r"on the training thread in ([0-9.]+) s", output)]


def uploads(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"stored in \S+ \(([0-9.]+) s after the save\)", output)]


def train(recipe: Path, tag: str, folder: Path, env: dict, overrides: list[str], step_s: float) -> rs.Run:
    started = time.monotonic()
    proc, record, weights = rs.start(
        recipe, tag, cwd=folder, overrides=overrides, sleep=step_s, env=env, folder=folder
    )
    return rs.finish(proc, record, weights, started, timeout=900)


def measure(
    work: Path, shards: Path, server: Server, size: str, cap: tuple[str, float], step_s: float, every: int
) -> dict:
    name = f"{size}-{cap[0].replace('/', 'p')}"
    bucket = re.sub(r"[^a-z0-9-]", "-", f"bench-{name}".lower())
    server.create_bucket(bucket)
    throttle = Proxy(server.port, rate=cap[1])
    env = {"S3_ENDPOINT_URL": throttle.endpoint, **CREDENTIALS, **INFO}
    out: dict = {"size": size, "cap": cap[0]}
    try:
        for mode, settings in MODES.items():
            folder = work / name / mode
            folder.mkdir(parents=True)
            save = f"s3://{bucket}/{mode}"
            recipe = rs.write_recipe(folder / "recipe.yaml", shards, save, cache=folder / "cache")
            paced = [f"checkpoint.save_interval={every}ba", f"training.max_duration={3 * every}ba"]
            run = train(recipe, mode, folder, env, [*SIZES[size], *settings, *paced], step_s)
            if run.returncode != 0:
                raise RuntimeError(f"{name} {mode}: exit {run.returncode}\n{run.output[-3000:]}")
            out[f"stall_{mode}"] = stall_per_save(run.batches(), every)
            out[f"saver_{mode}"] = statistics.median(saver_seconds(run.output) or [float("nan")])
            if mode == "snapshot":
                parts = re.findall(r"the state dict ([0-9.]+) s, the copy ([0-9.]+) s", run.output)
                out["state_dict_s"] = statistics.median(float(a) for a, _ in parts) if parts else float("nan")
                out["copy_s"] = statistics.median(float(b) for _, b in parts) if parts else float("nan")
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
    (b / "tmp").mkdir(parents=True)  # its own temp folder: no node copy of a's checkpoint there
    save = f"s3://{bucket}/preempted"
    recipe = rs.write_recipe(a / "recipe.yaml", shards, save, cache=a / "cache")
    first = rs.interrupt(recipe, "a", cwd=a, at_batch=6, sig=signal.SIGTERM, overrides=model, env=env)
    durable = re.search(r"stored ([0-9.]+) s after the signal", first.output)
    if first.returncode != 143 or durable is None:
        raise RuntimeError(f"SIGTERM run: exit {first.returncode}\n{first.output[-3000:]}")
    recipe = rs.write_recipe(b / "recipe.yaml", shards, save, cache=b / "cache")
    second = train(recipe, "b", b, {**env, "TMPDIR": str(b / "tmp")}, model, step_s)
    line = next((x for x in second.output.splitlines() if x.startswith("[restart]")), "")
    if second.returncode != 0 or not line:
        raise RuntimeError(f"restart: exit {second.returncode}\n{second.output[-3000:]}")
    phases = restart.parse(line) or {}
    size = re.search(r"([0-9.]+) MB downloaded at ([0-9.]+) MB/s", line)
    return {
        "sigterm_durable": float(durable.group(1)),
        "restart_total": phases.pop("total", float("nan")),
        "restart_phases": phases,
        "mb_per_rank": float(size.group(1)) if size else float("nan"),
        "download_mbps": float(size.group(2)) if size else float("nan"),
    }


# --- printing ------------------------------------------------------------------------------------


def print_measured(rows: list[dict], step_s: float, every: int) -> None:
    print(
        f"\nMeasured (loopback moto S3 behind a bandwidth cap, a save every {every} steps, each step "
        f"{step_s:g} s of stand-in compute; one run per mode; stall: the median save's gap beyond a plain "
        "step's; saver: the training thread's seconds in the save as the saver measured them):"
    )
    head = (
        f"{'size':6s} {'cap':>9s} {'MB/rank':>8s} {'step s':>7s} {'stall snap':>11s} {'stall bg':>9s} "
        f"{'stall sync':>11s} {'bg/snap':>8s} {'sync/snap':>10s} {'saver snap':>11s} {'(state+copy)':>13s} "
        f"{'saver bg':>9s} {'bg/snap':>8s} {'share snap':>11s} {'share bg':>9s} {'copy MB/s':>10s} "
        f"{'upload s':>9s} {'up MB/s':>8s} {'SIGTERM->durable':>17s} {'restart s':>10s} {'down MB/s':>10s}"
    )
    print(head)
    for r in rows:
        interval = every * r["step"]
        mb = r["mb_per_rank"]
        snap, bg, sync = r["stall_snapshot"], r["stall_background"], r["stall_sync"]
        split = f"{r['state_dict_s']:.3f}+{r['copy_s']:.3f}"
        print(
            f"{r['size']:6s} {r['cap']:>9s} {mb:8.1f} {r['step']:7.2f} {snap:11.3f} {bg:9.3f} {sync:11.2f} "
            f"{_ratio(bg, snap):>8s} {_ratio(sync, snap):>10s} {r['saver_snapshot']:11.3f} {split:>13s} "
            f"{r['saver_background']:9.3f} {_ratio(r['saver_background'], r['saver_snapshot']):>8s} "
            f"{100 * snap / interval:10.2f}% {100 * bg / interval:8.2f}% {_rate(mb, r['copy_s']):>10s} "
            f"{r['upload_background']:9.2f} {mb / r['upload_background']:8.1f} {r['sigterm_durable']:17.2f} "
            f"{r['restart_total']:10.1f} {r['download_mbps']:10.1f}"
        )
    print("\nRestart phases (seconds, from the [restart] line of the run resumed on an empty folder):")
    names = restart.LABELS
    print(f"{'size':6s} {'cap':>9s} " + " ".join(f"{n:>19s}" for n in names))
    for r in rows:
        print(
            f"{r['size']:6s} {r['cap']:>9s} "
            + " ".join(f"{r['restart_phases'].get(n, float('nan')):19.2f}" for n in names)
        )


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}" if b > 0 else "inf"


def _rate(mb: float, seconds: float) -> str:
    return f"{mb / seconds:.0f}" if seconds > 0 else "inf"


def measured_snapshot_rate(rows: list[dict]) -> float | None:
    """Bytes per second of this machine's snapshot, state dict and copy together (the saver's
    seconds): the largest size's MB per rank over its median."""
    done = [r for r in rows if r.get("saver_snapshot", 0) > 0]
    if not done:
        return None
    largest = max(r["mb_per_rank"] for r in done)
    return largest * 1e6 / statistics.median(r["saver_snapshot"] for r in done if r["mb_per_rank"] == largest)


def projection(upload_bw: str, disk_bw: str, snapshot_bw: str, cpu_rate: float | None = None) -> list[str]:
    """The 7B recipe on 8 and 64 GPUs at `snapshot_bw` per GPU, and on 8 ranks snapshotting at
    `cpu_rate` bytes/s (this machine's measured rate), at the stated disk and upload rates."""
    cfg = load_config(REPO / "recipes" / "7b.yaml")
    seq = cfg.model.max_seq_len
    summary = describe(cfg.model, seq, cfg.training.global_batch_size * seq)
    notices = " / ".join(f"{n} s notice" for n in NOTICES_S)
    lines = [
        f"7B recipe projection (memory plan: 12 bytes a parameter; {ANCHOR_MFU:.0%} MFU on H100; "
        f"{upload_bw} to S3 and {disk_bw} local write per node; snapshot at {snapshot_bw} per GPU"
        + (f", CPU row at this machine's measured {cpu_rate / 1e6:.0f} MB/s" if cpu_rate else "")
        + "):",
        "| ranks | snapshot rate | GB per rank | stall s (snapshot) | write + upload s | SIGTERM save s "
        f"({notices}) | save_interval | stall | lost per preemption: no notice | 30 s notice | 120 s notice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [(8, snapshot_bw, parse_bandwidth(snapshot_bw)), (64, snapshot_bw, parse_bandwidth(snapshot_bw))]
    if cpu_rate:
        rows.append((8, f"{cpu_rate / 1e6:.0f} MB/s (CPU, measured)", cpu_rate))
    for gpus, label, rate in rows:
        step = summary.flops_per_step / (gpus * PEAK_BF16_FLOPS["H100"] * ANCHOR_MFU)
        cost = checkpoint_cost(
            cfg, gpus, summary.params, step, parse_bandwidth(upload_bw), parse_bandwidth(disk_bw), rate
        )
        fits = " / ".join("fits" if cost.fits(n) else "not started" for n in NOTICES_S)
        for interval, name in [(cost.interval_snapshot, "auto"), *((i, f"{i}ba") for i in INTERVALS)]:
            noticed = " | ".join(
                "restart only" if cost.fits(n) else _minutes(cost.lost_s(interval, n)) for n in NOTICES_S
            )
            lines.append(
                f"| {gpus} | {label} | {cost.size.per_rank / 1e9:.2f} | {cost.snapshot_s:.2f} | "
                f"{cost.background_s:.0f} | {cost.stop_save_s:.0f} ({fits}) | {name}: {interval} "
                f"({_minutes(interval * step)}) | {100 * cost.stall_share(interval):.2f}% | "
                f"{_minutes(cost.lost_s(interval))} | {noticed} |"
            )
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def print_targets(rows: list[dict], rate: float | None, args: argparse.Namespace) -> None:
    """Issue 32's targets, against what was measured and projected."""
    large = [r for r in rows if r["size"] == "large"]
    if large:
        gap = statistics.median(r["stall_snapshot"] / r["stall_background"] for r in large)
        saver = statistics.median(r["saver_snapshot"] / r["saver_background"] for r in large)
        print(
            f"\ntarget: large size, snapshot stall <= 1/5 of the background stall: measured {gap:.2f} of it "
            f"(gaps), {saver:.2f} (the saver's seconds)"
        )
    cfg = load_config(REPO / "recipes" / "7b.yaml")
    seq = cfg.model.max_seq_len
    summary = describe(cfg.model, seq, cfg.training.global_batch_size * seq)
    step = summary.flops_per_step / (8 * PEAK_BF16_FLOPS["H100"] * ANCHOR_MFU)
    cost = checkpoint_cost(
        cfg, 8, summary.params, step, parse_bandwidth(args.upload_bandwidth),
        parse_bandwidth(args.disk_bandwidth), parse_bandwidth(args.snapshot_bandwidth),
    )  # fmt: skip
    every = cost.interval_snapshot
    print(
        f"target: 7B on 8 GPUs, stall <= 2 s a save: {cost.snapshot_s:.2f} s; lost per preemption without "
        f"notice <= 5 min at <= 1% stall: {_minutes(cost.lost_s(every))} at {100 * cost.stall_share(every):.2f}% "
        f"(auto, every {every} batches); 30 s notice: the {cost.stop_save_s:.0f} s save is "
        f"{'started' if cost.fits(30) else 'not started'}"
    )


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
                rows.append(measure(work, shards, server, size, cap, args.step_s, args.save_every))
    finally:
        server.stop()
    print_measured(rows, args.step_s, args.save_every)
    print()
    rate = measured_snapshot_rate(rows)
    print("\n".join(projection(args.upload_bandwidth, args.disk_bandwidth, args.snapshot_bandwidth, rate)))
    print_targets(rows, rate, args)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
