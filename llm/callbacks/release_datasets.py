"""A run's datasets give their shared memory back when the run ends (`Trainer.close`).

streaming keeps each dataset's shared memory until the process ends (its `atexit` hooks hold every
segment). In a process that goes on after a run (a notebook, a test worker, a benchmark) the
finished run's prefixes would stay taken, and every later dataset walks past each of them (keeping a
descriptor for each); a start cannot tell them from a live dataset's on the same local shards.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from composer.core import Callback, State
from composer.loggers import Logger

from llm.data.shared_memory import release_shared_memory


class ReleaseDatasets(Callback):
    """At `Trainer.close`, unlink the shared memory of the run's datasets (the mappings stay)."""

    def __init__(self, datasets: Iterable[object]) -> None:
        self._datasets = [weakref.ref(d) for d in datasets if d is not None]

    def close(self, state: State, logger: Logger) -> None:
        release_shared_memory([d for ref in self._datasets if (d := ref()) is not None])
