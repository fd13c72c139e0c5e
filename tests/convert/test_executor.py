"""The conversion's worker pool: a worker that dies, even in the middle of sending a result,
ends the run with one clear error instead of a hang."""

from __future__ import annotations

import gc
import os
import struct
import time
from multiprocessing.queues import SimpleQueue

import pytest

from convert.errors import ConvertError
from convert.executor import ordered, start_workers


def _noop() -> None:
    pass


def _square(x: int) -> int:
    return x * x


def _die_halfway_through_a_result(x: int) -> int:
    """Write the start of a 1 MB result message to the pool's result pipe, then die."""
    queue = next(o for o in gc.get_objects() if isinstance(o, SimpleQueue))
    writer = queue._writer
    os.write(writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)  # header + 1000 of 1 MB
    os._exit(9)


def test_results_come_back_in_input_order():
    with start_workers(2, _noop) as executor:
        assert list(ordered(executor, _square, range(20), window=4)) == [x * x for x in range(20)]


def test_a_worker_dying_mid_result_is_a_clear_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(ConvertError, match="worker process died"):
        with start_workers(1, _noop) as executor:
            list(ordered(executor, _die_halfway_through_a_result, [1], window=1))
    assert time.monotonic() - start < 30
