"""The Makefile's demo targets as make runs them: a demo whose training is stopped says how to go on.

`make demo-sft` stopped by a SIGTERM printed `make: *** ... Error 143` and nothing else of what to
do (issue 39). The demo targets train through the Makefile's `demo_train`; here make runs that
macro on the resume harness's tiny recipe (`scenarios/resume.py`), the training process is sent
SIGTERM once it trains, and the output is read as a user reads it.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from tests.support.paths import REPO
from tests.support.resume import write_recipe


def _training_process(make: subprocess.Popen) -> psutil.Process:
    """train.py under make's shell (whose own command line also names train.py)."""
    for child in psutil.Process(make.pid).children(recursive=True):
        cmdline = child.cmdline()
        if len(cmdline) > 1 and cmdline[1] == "train.py":
            return child
    raise AssertionError("no train.py process under make")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_demo_whose_training_is_stopped_by_sigterm_says_it_can_be_resumed_and_how(tmp_path, shards):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    extra = tmp_path / "stopped.mk"
    extra.write_text(
        f"stopped-demo:\n\t$(call demo_train,{recipe} training.max_duration=100000ba,demo-sft)\n"
    )
    make = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "-f",
            "Makefile",
            "-f",
            str(extra),
            "stopped-demo",
            f"PY={sys.executable}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in make.stdout:  # until the run trains: its handler for SIGTERM is in place
        lines.append(line.rstrip("\n"))
        if line.startswith("[progress]"):
            _training_process(make).send_signal(signal.SIGTERM)
            break
    lines += make.stdout.read().splitlines()
    assert make.wait() == 2, "\n".join(lines[-30:])  # make's own code for a failed recipe
    output = "\n".join(lines)
    assert "[preemption] SIGTERM: checkpoint at batch" in output, output[-3000:]
    said = lines.index(
        "make demo-sft: training stopped on a signal (exit 143); to resume it from its checkpoint, "
        "run make demo-sft again"
    )
    (failed,) = [i for i, line in enumerate(lines) if "Error 143" in line]
    assert said < failed  # said before make's own line, which is the last
    assert list((tmp_path / "ckpt" / "manifests").iterdir())  # a checkpoint to resume from
