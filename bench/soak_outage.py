"""Soak test for the outage budget: the S3 endpoint goes away for a minute at random points of runs.

    python -m bench.soak_outage [--runs 5] [--down-for 60] [--seed 0] [--workdir DIR]

A loopback S3 server (moto) holds the shards (small, so downloads are in flight while training
runs) and the checkpoints; every training process reaches it through a `scenarios.proxy.Proxy`.
One uninterrupted reference run, then `--runs` runs, each with the endpoint taken down (connection
refused, as from a killed server) for `--down-for` seconds at a random point: at start (during
the set-up reads: meta.json, index.json, the run lock, the checkpoint scan), while streaming, or
during a save (with downloads ahead). The outage budget is the default `LLM_S3_OUTAGE_S` unless
the environment sets it. Printed per run: where the outage fell, the exit code, the run's time and
whether its final weights are bit-identical to the reference's; then how many runs survived.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

from scenarios import outage as so
from scenarios import resume as rs
from scenarios.proxy import Proxy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--down-for", type=float, default=60.0, help="seconds the endpoint stays away")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="default: a new temp folder")
    return parser.parse_args(argv)


def start_s3() -> tuple[object, int]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="soak", AWS_SECRET_ACCESS_KEY="soak", AWS_DEFAULT_REGION="us-east-1",
        S3_ENDPOINT_URL=f"http://{host}:{port}",
    )  # fmt: skip
    return server, port


def same_weights(a: Path, b: Path) -> bool:
    try:
        rs.assert_same_weights(a, b)
    except (AssertionError, FileNotFoundError):
        return False
    return True


def pick(rng: random.Random) -> dict:
    """Where the outage falls: at start, while streaming, or at a save."""
    phase = rng.choice(["start", "streaming", "save"])
    if phase == "start":
        return {"at_batch": None, "delay": rng.uniform(0.0, 12.0)}
    if phase == "save":
        return {"at_batch": rng.choice([rs.SAVE_EVERY, 2 * rs.SAVE_EVERY]), "delay": 0.0}
    batch = rng.choice([b for b in range(1, rs.MAX_BATCHES) if b % rs.SAVE_EVERY])
    return {"at_batch": batch, "delay": rng.uniform(0.0, 0.5)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import boto3

    work = Path(args.workdir or tempfile.mkdtemp(prefix="soak-outage-"))
    server, port = start_s3()
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    client.create_bucket(Bucket="soak")
    split = rs.write_shards(work / "shards", shard_bytes=so.SHARD_BYTES)
    data = so.upload_split(client, "soak", split, "data/train")
    switch = Proxy(port)
    budget = os.environ.get("LLM_S3_OUTAGE_S", "300 (default)")
    print(
        f"soak-outage: {args.runs} runs, endpoint away {args.down_for:g} s each, LLM_S3_OUTAGE_S={budget}",
        flush=True,
    )
    rng = random.Random(args.seed)
    try:
        ref_folder = work / "reference"
        ref_folder.mkdir(parents=True, exist_ok=True)
        recipe = rs.write_recipe(
            ref_folder / "recipe.yaml", data, "s3://soak/reference", cache=ref_folder / "cache"
        )
        reference = rs.run(
            recipe, "reference", cwd=ref_folder, overrides=so.LAZY, env={"S3_ENDPOINT_URL": switch.endpoint}
        )
        if reference.returncode != 0:
            print(reference.output[-3000:], file=sys.stderr)
            return 1
        survived = 0
        for i in range(args.runs):
            where = pick(rng)
            result = so.outage_run(
                work / f"run-{i}", switch, data, f"s3://soak/run-{i}", down_for=args.down_for, env={},
                timeout=args.down_for + 900, **where,
            )  # fmt: skip
            ok = result.run.returncode == 0 and same_weights(result.run.weights, reference.weights)
            survived += ok
            print(
                f"run {i}: endpoint away {result.down_for:g} s from {result.down_at:.1f} s ({result.phase}); "
                f"rc {result.run.returncode}, {result.run.seconds:.0f} s, final weights "
                f"{'bit-identical' if ok else 'DIFFERENT or missing'}",
                flush=True,
            )
            if not ok:
                print(result.run.output[-2000:], file=sys.stderr)
        print(f"soak-outage: {survived}/{args.runs} runs survived a {args.down_for:g} s outage", flush=True)
        return 0 if survived == args.runs else 1
    finally:
        switch.down()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
