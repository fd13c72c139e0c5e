"""`<run_dir>/trackers.json`: each tracker's run id, kept across resumes.

The MLflow and W&B run ids are written as soon as they are known; the file is one of the run's
records, which travel with the checkpoints (llm/run_dir.py), so a resumed run, even on an empty
machine, continues the same tracker runs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from composer.utils import dist

from storage import atomic_write_text


class TrackerIds:
    """`<run_dir>/trackers.json`: each tracker's run id, written by rank 0 as soon as it is known."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        try:
            value = json.loads(self.path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and value else None

    def set(self, key: str, value: str) -> None:
        if dist.get_global_rank() != 0:
            return
        with self._lock:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            data = data if isinstance(data, dict) else {}
            data[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
