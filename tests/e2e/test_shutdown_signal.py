"""A further SIGTERM once the preemption checkpoint is stored and the process is exiting (its close
and atexit hooks running) says so in one line instead of raising SystemExit inside those hooks,
which printed a 14-line `SystemExit: 143` traceback from Composer's handler. In-process."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from llm.checkpoint.preemption import PreemptionCallback, StopSave


def test_a_signal_during_shutdown_after_a_preemption_save_is_one_line_not_an_exception(capsys):
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # as Composer's
    callback = PreemptionCallback()
    callback.stop_signal, callback.stop_batch, callback.received_at = signal.SIGTERM, 5, None
    callback.save_outcome = StopSave(batch=5, stored=True, resume_batch=5)  # what the publisher reports
    try:
        with pytest.raises(SystemExit) as stopped:
            callback.fit_end(None, None)  # the state is not read on this path
        assert stopped.value.code == 143
        os.kill(os.getpid(), signal.SIGTERM)  # the second one, while close/atexit run: no raise
        out = capsys.readouterr().out
        assert "[preemption] SIGTERM: checkpoint at batch 5 stored" in out
        assert "[preemption] SIGTERM during shutdown: the process is already exiting" in out
    finally:
        signal.signal(signal.SIGTERM, before)
