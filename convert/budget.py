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
