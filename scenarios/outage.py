"""Storage outages for the outage tests and `make soak-outage`: an S3 endpoint that goes away and
comes back, and a training run that must ride it out.

The endpoint is a `scenarios.proxy.Proxy` in front of the S3 server: `down()` refuses connections
as a killed server does, `up()` listens again on the same port, `freeze()` never answers.

`outage_run` starts the resume harness's tiny training (scenarios/resume.py) with its shards and
checkpoints on S3 behind such a proxy, takes the endpoint down at a given moment for a given time,
and returns the finished run with when the outage really began and ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from scenarios import resume as rs
from scenarios.proxy import Proxy

# Shards small enough that downloads are still in flight while training runs (about 2 samples a
# shard, 48 shards), fetched lazily: a few samples ahead, small shuffle blocks.
SHARD_BYTES = 200
LAZY = ["data.predownload=2", "data.shuffle_block_size=8"]


def upload_split(client, bucket: str, split: Path, prefix: str) -> str:
    """Copy a local split folder to s3://bucket/prefix; return that URL."""
    for path in sorted(split.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(split).as_posix()}")
    return f"s3://{bucket}/{prefix}"


@dataclass
class OutageRun:
    run: rs.Run
    down_at: float | None  # seconds after the process started that the endpoint went down
    down_for: float  # how long it stayed down
    phase: str  # what the run was doing when it went down
    down_wall: float = 0.0  # time.time() when it went down and when it came back (to compare with
    up_wall: float = 0.0  # the recorder's per-batch times)

    def batches_while_down(self) -> list[int]:
        return [b["batch"] for b in self.run.batches() if self.down_wall < b["time"] < self.up_wall]


def outage_run(
    folder: Path, switch: Proxy, data_remote: str, save_folder: str, *, at_batch: int | None,
    delay: float, down_for: float, env: dict, tag: str = "outage", timeout: float = 600, overrides=(),
) -> OutageRun:  # fmt: skip
    """Train the harness recipe through `switch`; the endpoint goes down `delay` seconds after the
    run reached batch `at_batch` (None: after the process started) and comes back `down_for`
    seconds later. Returns the finished run (the caller checks rc and weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = rs.write_recipe(folder / "recipe.yaml", data_remote, save_folder, cache=folder / "cache")
    pause = () if at_batch is None else at_batch
    started = time.monotonic()
    proc, record, weights = rs.start(
        recipe,
        tag,
        cwd=folder,
        overrides=[*LAZY, *overrides],
        env={"S3_ENDPOINT_URL": switch.endpoint, **env},
        pause_at=pause,
    )
    try:
        if at_batch is not None:
            rs.wait_for_batch(record, at_batch, proc)
        time.sleep(delay)
        phase = _phase(record, at_batch)
        down_at, down_wall = time.monotonic() - started, time.time()
        switch.down()
        if at_batch is not None:
            rs.release(record, at_batch)
        time.sleep(down_for)
        up_wall = time.time()
        switch.up()
        result = rs.finish(proc, record, weights, started, timeout)
    finally:
        switch.up()
        rs.kill_group(proc)
    return OutageRun(result, down_at, down_for, phase, down_wall, up_wall)


def _phase(record: Path, at_batch: int | None) -> str:
    rows = record.read_text().splitlines() if record.exists() else []
    if not rows:
        return "start (before the first batch)"
    if at_batch is not None and at_batch % rs.SAVE_EVERY == 0:
        return f"the save at batch {at_batch}, with downloads ahead"
    return f"streaming, after batch {len(rows)}"
