"""Scratch folders of one conversion in the system temp folder, and the leftovers of killed runs.

A run's spool files (convert/run/ranges.py), the index processes' sketch file
(convert/dedup/index_processes.py) and the merge's spilled runs (convert/run/merge.py) live in
`<tmp>/convert-<kind>-<pid>-<random>`, removed when the run ends. A run killed by SIGKILL cannot
remove them; the next conversion on the machine removes every such folder whose process is gone
(`storage.scratch`), so the temp folder does not fill up with the spools of killed runs.
"""

from __future__ import annotations

from pathlib import Path

from storage.scratch import make_process_folder, remove_dead_process_folders

_KINDS = r"convert-(?:spool|sketches|merge)-"


def make_scratch(kind: str) -> str:
    """A new scratch folder of this process (`kind`: spool, sketches or merge), after removing stale ones."""
    remove_stale_scratch()
    return str(make_process_folder(f"convert-{kind}-"))


def remove_stale_scratch(root: str | None = None) -> list[Path]:
    """Remove the scratch folders of processes that no longer run; returns what was removed."""
    return remove_dead_process_folders(_KINDS, root)
