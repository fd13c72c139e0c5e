"""The memory budget of a conversion (`--memory-budget`): what every structure that grows with the
corpus must stay under, and how its sizes are written.

The structures that grow with the corpus are the de-duplication state (exact digests, band keys,
sketches) and the parts' records. A conversion that fits keeps them in memory; otherwise they
go to disk as sorted runs (convert/dedup/runs.py) and are decided partition by partition, the
partitions sized so that each one, in each worker at once, fits its share of the budget
(convert/dedup/stages.py). The default is DEFAULT_SHARE of this machine's memory (or of the
container's limit when it has one).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from convert.errors import ConvertError

DEFAULT_SHARE = 0.5
MINIMUM = 16 << 20  # less than this cannot hold a partition's fixed costs
# What each process of a conversion holds beside its share of the budget: the interpreter, numpy,
# SentencePiece, a batch in flight. `python -m bench.dedup_scale --whole-job 1e6` (2026-12-04):
# a job of 3 processes on 20 k short documents peaked at 125.5-150.9 MiB (42-50 MiB each, PSS),
# the same job on 1 M under a 256 MiB budget at 353.8-384.0 MiB. A job peaks within the budget
# plus this for each process (the plan line says so); 56 MiB leaves a margin over the 50 measured.
PROCESS_BYTES = 56 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "256MB", "8G", "1.5GiB" or a plain number of bytes (units are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ConvertError(f"--memory-budget {text!r} is not a size: give e.g. 256MB, 8GB or 1.5TB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < MINIMUM:
        raise ConvertError(f"--memory-budget {text} is below {format_size(MINIMUM)}: give more")
    return size


def format_size(size: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def machine_memory() -> int:
    """This machine's memory, or its container's limit (cgroup v2 or v1) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def resolve_budget(budget: int) -> int:
    """A budget in bytes; 0 means the default share of the machine's memory."""
    return budget if budget > 0 else int(DEFAULT_SHARE * machine_memory())


def expected_peak(budget: int, processes: int) -> int:
    """What a job of `processes` processes under `budget` is expected to hold at most."""
    return budget + processes * PROCESS_BYTES


def describe_peak(budget: int, processes: int) -> str:
    return (
        f"the job's {processes} processes peak within about {format_size(expected_peak(budget, processes))} "
        f"(the budget and {format_size(PROCESS_BYTES)} each)"
    )


def budget_warning(budget: int, processes: int, machine: int | None = None) -> str | None:
    """One warning line when the job's expected peak passes this machine's memory (or its
    container's limit), else None."""
    machine = machine_memory() if machine is None else machine
    peak = expected_peak(budget, processes)
    if peak <= machine:
        return None
    room = machine - processes * PROCESS_BYTES
    fix = f"give --memory-budget {format_size(room)} or less" if room >= MINIMUM else "use fewer --workers"
    return (
        f"warning: --memory-budget {format_size(budget)} and {processes} processes (about {format_size(peak)} at "
        f"the peak) are more than this machine's memory or its container's limit ({format_size(machine)}): the "
        f"job may be killed; {fix}"
    )
