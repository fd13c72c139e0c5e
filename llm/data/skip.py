"""Skip windows: data batches a run never trains on (the recipe's `data.skip`, and the guard's).

Numbering. A window `[from, to)` counts data batches in sample order from 0, every batch the
training loader produces, trained or not: with the step numbering of metrics.jsonl and the
checkpoints (step N = the state after N batches), the window holds the batches after the first
`from` up to batch `to`, so a checkpoint at batch `from` is the state just before it. A skipped
batch is read and dropped: its samples are consumed, never reshuffled or repeated, and the rest of
the sample order is unchanged.

Skipped batches count as steps. The trainer's batch counter (Composer's timestamp: the
learning-rate schedule, `max_duration`, the checkpoint names and metrics.jsonl's steps) stays equal
to the number of data batches consumed, trained or skipped (`llm/callbacks/skip_windows.py` moves it
over each window). So a batch number means the same data everywhere, a checkpoint's sample
position (Composer stores streaming's `state_dict` at `timestamp.sample_in_epoch`) is exact with no
translation, and a run told `data.skip: [[a, b]]` from the start reaches batch `b` with the state of
batch `a`, exactly as a run that rolled back to `a` and skipped the same window. The price: a
window's batches are not made up at the end (the run takes `b - a` fewer optimizer steps, and the
schedule moves past them), a few hundred of the 7B recipe's ~570,000.

`SkippingLoader` is the training `DataLoader` with the windows applied: it counts the batches it
takes from the loader (`next_index`, set from the resume point when training starts) and drops
those inside a window. Every rank drops the same indices, so the ranks' parts of each global batch
stay together. The data stream only moves forward: a rollback's window starts at the rollback
point, so the batches between it and the spike, already read, are simply not read again.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader


class SkipWindows:
    """Sorted, merged half-open windows `[start, end)` of data batch indices."""

    def __init__(self, windows: Iterable[Iterable[int]] = ()):
        self._windows: list[tuple[int, int]] = []
        for start, end in windows:
            self.add(start, end)

    def add(self, start: int, end: int) -> bool:
        """Add `[start, end)`, merged with the windows it touches; whether anything new is skipped."""
        if end <= start or self.covers(start, end):
            return False
        merged = [(s, e) for s, e in self._windows if e < start or s > end]
        touching = [(s, e) for s, e in self._windows if not (e < start or s > end)]
        low = min([start, *(s for s, _ in touching)])
        high = max([end, *(e for _, e in touching)])
        self._windows = sorted([*merged, (low, high)])
        return True

    def __contains__(self, index: int) -> bool:
        at = bisect.bisect_right(self._windows, (index, float("inf"))) - 1
        return at >= 0 and self._windows[at][0] <= index < self._windows[at][1]

    def covers(self, start: int, end: int) -> bool:
        """Whether every index of `[start, end)` is skipped (True for an empty range)."""
        if end <= start:
            return True
        at = bisect.bisect_right(self._windows, (start, float("inf"))) - 1
        return at >= 0 and self._windows[at][0] <= start and end <= self._windows[at][1]

    def as_lists(self) -> list[list[int]]:
        """The windows as `data.skip` writes them: `[[from, to], ...]`."""
        return [[start, end] for start, end in self._windows]

    def __len__(self) -> int:
        return len(self._windows)

    def __repr__(self) -> str:
        return f"SkipWindows({self.as_lists()})"


class SkippingLoader(DataLoader):
    """The training DataLoader, dropping the batches inside `windows` (see the module docstring).

    `next_index` is the data index of the next batch taken from the loader: the trainer's callback
    sets it from the resume point when training starts (`llm/callbacks/skip_windows.py`); it then
    counts every batch taken, trained or dropped, so the batch just yielded is `next_index - 1`."""

    def __init__(self, *args: Any, windows: SkipWindows | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.windows = windows if windows is not None else SkipWindows()
        self.next_index = 0

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            index = self.next_index
            self.next_index += 1
            if index not in self.windows:
                yield batch
