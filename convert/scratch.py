"""Scratch folders of one conversion in the system temp folder, and the leftovers of killed runs.

A run's spool files (convert/run/ranges.py) and the index processes' sketch file
(convert/dedup/index_processes.py) live in `<tmp>/convert-<kind>-<pid>-<random>`, removed when the
run ends. A run killed by SIGKILL cannot remove them; the next conversion on the machine removes
every such folder whose process is gone, so the temp folder does not fill up with the spools of
killed runs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

_NAME = re.compile(r"^convert-(spool|sketches|merge)-(\d+)-")


def make_scratch(kind: str) -> str:
    """A new scratch folder of this process (`kind`: spool, sketches or merge), after removing stale ones."""
    remove_stale_scratch()
    return tempfile.mkdtemp(prefix=f"convert-{kind}-{os.getpid()}-")


def remove_stale_scratch(root: str | None = None) -> list[Path]:
    """Remove the scratch folders of processes that no longer run; returns what was removed."""
    removed = []
    for entry in Path(root or tempfile.gettempdir()).glob("convert-*-*-*"):
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
