"""`RunRecordsHook`: what checkpointing asks of the run's records, as a protocol.

The trainer hands checkpointing the run folder's records (`llm.run_dir.RunRecords`): `plan.py`
brings them back for the step a run starts at, `publisher.py` stores them with each checkpoint
(before its manifests, rank 0) and once more at the end. Checkpointing knows nothing of the files;
it sees only this protocol. A leaf: it imports nothing of the project, so every module of the
package can name the type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from composer.core import State


class RunRecordsHook(Protocol):
    """The run's records, as checkpointing uses them (implemented by `llm.run_dir.RunRecords`)."""

    def restore(self, step: int) -> object:
        """Bring the records back for a run starting at `step`; clear them for a fresh start."""
        ...

    def save(self, state: State | None = None) -> object:
        """Store the records beside the checkpoints (`state`: the trainer's, at a save)."""
        ...

    def save_quietly(self) -> None:
        """`save` at the end of a run, a failure reported as one warning."""
        ...

    def snapshot(self, state: State | None = None) -> Callable[[], object]:
        """The records as they are now, read into memory at a save; the returned call stores them
        (from the background upload thread, so a later step cannot change what is stored)."""
        ...
