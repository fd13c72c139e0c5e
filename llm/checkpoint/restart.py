"""Where a restart's time goes: one `[restart]` line at the first training step of a resumed run.

    [restart] resumed at batch 6, first step 19.4 s after the process started: imports 14.0 s,
    checkpoint 1.4 s (1 file(s), 61.5 MB downloaded at 64.5 MB/s), data and model 0.6 s, Trainer
    and load 1.5 s, loader resume 0.0 s, first step 1.9 s

The phases are cut at marks: the process's start (from /proc, so the interpreter's own start-up
counts), `setup` (the trainer begins: imports and config done), `checkpoint` (the data's
meta.json checked, the run lock taken, the resume point chosen: manifests scanned, files verified
and downloaded), Composer's INIT (datasets and model
built), AFTER_LOAD (the Trainer built and the checkpoint loaded), the first AFTER_DATALOADER
(streaming's resume to the saved sample position and the first batch) and the first BATCH_END.
`bench/restart.py` reads the line. The marks are process-wide (one run per process); Composer's
events are marked by `llm.checkpoint.plan.RestartTimings`. No heavy imports: `llm.checkpoint.resume`
(used by `llm generate` too) records its downloads here.
"""

from __future__ import annotations

import os
import time

MARKS: dict[str, float] = {}  # name -> time.time()
DOWNLOADED = {"files": 0, "bytes": 0, "seconds": 0.0}


def mark(name: str) -> None:
    """Record the first time `name` is reached (later calls keep the first)."""
    MARKS.setdefault(name, time.time())


def record_download(files: int, size: int, seconds: float) -> None:
    DOWNLOADED["files"] += files
    DOWNLOADED["bytes"] += size
    DOWNLOADED["seconds"] += seconds


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
    ("imports", "process", "setup"),
    ("checkpoint", "setup", "checkpoint"),
    ("data and model", "checkpoint", "trainer_init"),
    ("Trainer and load", "trainer_init", "loaded"),
    ("loader resume", "loaded", "first_batch"),
    ("first step", "first_batch", "first_step"),
)


def phases() -> list[tuple[str, float]]:
    """(label, seconds) of each phase whose two marks were reached."""
    marks = dict(MARKS)
    start = process_start_time()
    if start is not None:
        marks["process"] = start
    return [(label, marks[b] - marks[a]) for label, a, b in PHASES if a in marks and b in marks]


def describe(batch: int) -> str:
    parts = []
    for label, seconds in phases():
        text = f"{label} {seconds:.1f} s"
        if label == "checkpoint" and DOWNLOADED["files"]:
            mb, took = DOWNLOADED["bytes"] / 1e6, DOWNLOADED["seconds"]
            rate = f" at {mb / took:.1f} MB/s" if took > 0 else ""
            text += f" ({DOWNLOADED['files']} file(s), {mb:.1f} MB downloaded{rate})"
        parts.append(text)
    start = process_start_time()
    total = f", first step {MARKS['first_step'] - start:.1f} s after the process started" if start else ""
    return f"[restart] resumed at batch {batch}{total}: " + ", ".join(parts)
