"""Where a restart's time goes: one `[restart]` line at the first training step of a resumed run.

    [restart] resumed at batch 6, first step 9.4 s after the process started: process and imports
    5.2 s, process group 0.0 s, checkpoint fetch 0.1 s (1 file(s), 10.5 MB: this node's copy,
    verified), data and model 0.1 s, Trainer 0.6 s, checkpoint load 0.3 s, data position 0.0 s,
    first step 0.4 s

The phases are cut at marks: the process's start (from /proc, so the interpreter's own start-up
counts), `setup` (imports, the recipe and the data's meta.json checked: the trainer is about to
start the process group), `process_group` (started), `checkpoint` (the run lock taken, the resume
point chosen: manifests scanned, files verified and downloaded, or this node's copy verified:
`llm.checkpoint.local_copy`), Composer's INIT (datasets and model built), BEFORE_LOAD (the Trainer
built around them), AFTER_LOAD (the checkpoint loaded into the model and optimizer), the first
AFTER_DATALOADER (streaming's resume to the saved sample position and the first batch, which
fetches the first shards of a remote stream) and the first BATCH_END. `bench/restart.py` and
`bench/soak_goodput.py` read the line (`parse`). The marks are process-wide (one run per process);
Composer's events are marked by `llm.checkpoint.plan.RestartTimings`. No heavy imports:
`llm.checkpoint.resume` (used by `llm generate` too) records its downloads here.
"""

from __future__ import annotations

import os
import re
import time

MARKS: dict[str, float] = {}  # name -> time.time()
DOWNLOADED = {"files": 0, "bytes": 0, "seconds": 0.0}
REUSED = {"files": 0, "bytes": 0}  # this node's copy of the checkpoint, verified and loaded


def mark(name: str) -> None:
    """Record the first time `name` is reached (later calls keep the first)."""
    MARKS.setdefault(name, time.time())


def record_download(files: int, size: int, seconds: float) -> None:
    DOWNLOADED["files"] += files
    DOWNLOADED["bytes"] += size
    DOWNLOADED["seconds"] += seconds


def record_reuse(files: int, size: int) -> None:
    """The checkpoint came from this node's verified copy (`llm.checkpoint.local_copy`), not the store."""
    REUSED["files"] += files
    REUSED["bytes"] += size


def process_start_time() -> float | None:
    """When this process started (wall clock), from /proc; None where /proc is missing."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


PHASES = (  # (label, from mark, to mark)
    ("process and imports", "process", "setup"),
    ("process group", "setup", "process_group"),
    ("checkpoint fetch", "process_group", "checkpoint"),
    ("data and model", "checkpoint", "trainer_init"),
    ("Trainer", "trainer_init", "before_load"),
    ("checkpoint load", "before_load", "loaded"),
    ("data position", "loaded", "first_batch"),
    ("first step", "first_batch", "first_step"),
)
LABELS = tuple(label for label, _, _ in PHASES)


def phases() -> list[tuple[str, float]]:
    """(label, seconds) of each phase whose two marks were reached."""
    marks = dict(MARKS)
    start = process_start_time()
    if start is not None:
        marks["process"] = start
    return [(label, marks[b] - marks[a]) for label, a, b in PHASES if a in marks and b in marks]


def _fetched() -> str:
    if REUSED["files"]:
        return f" ({REUSED['files']} file(s), {REUSED['bytes'] / 1e6:.1f} MB: this node's copy, verified)"
    if DOWNLOADED["files"]:
        mb, took = DOWNLOADED["bytes"] / 1e6, DOWNLOADED["seconds"]
        rate = f" at {mb / took:.1f} MB/s" if took > 0 else ""
        return f" ({DOWNLOADED['files']} file(s), {mb:.1f} MB downloaded{rate})"
    return ""


def total_s() -> float | None:
    """Seconds from the process's start to the end of its first step (None: not known yet)."""
    start = process_start_time()
    if start is None or "first_step" not in MARKS:
        return None
    return MARKS["first_step"] - start


def describe(batch: int) -> str:
    parts = []
    for label, seconds in phases():
        parts.append(f"{label} {seconds:.1f} s" + (_fetched() if label == "checkpoint fetch" else ""))
    start = process_start_time()
    total = f", first step {MARKS['first_step'] - start:.1f} s after the process started" if start else ""
    return f"[restart] resumed at batch {batch}{total}: " + ", ".join(parts)


_PART = re.compile(r"([A-Za-z ]+?) (-?[0-9.]+) s")


def parse(output: str) -> dict[str, float] | None:
    """A run's `[restart]` line read back from its output: each phase's seconds and `total` (process
    start to the first step); None without a line. Used by the benchmarks; the labels are taken as
    written, so that a line of an older version (`imports`, `Trainer and load`) reads too."""
    line = next((x for x in output.splitlines() if x.startswith("[restart]")), None)
    if line is None:
        return None
    head, _, body = line.partition(": ")
    found: dict[str, float] = {}
    for part in re.split(r", (?![^(]*\))", body):  # commas inside a phase's (...) stay with it
        match = _PART.match(part.strip())
        if match:
            found[match.group(1)] = float(match.group(2))
    total = re.search(r"first step ([0-9.]+) s after the process started", head)
    if total:
        found["total"] = float(total.group(1))
    return found
