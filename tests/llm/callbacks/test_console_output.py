"""Console output written to a file holds no progress-bar control sequences; a terminal keeps its bars.

Training (`train.py`) and conversion (`python -m convert shards`) run as a user runs them, once with
stdout and stderr going to files (as `make demo > log 2>&1`) and once to a pseudo-terminal (the
`pty` module), and what each wrote is read back.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios
import tty
from pathlib import Path

import pytest

from tests.support import forkserver
from tests.support.training import REPO, write_recipe

CONTROL = ("\r", "\x1b[")  # a bar's carriage return, cursor moves and clears


def run_into_files(args: list[str], cwd: Path) -> str:
    proc = forkserver.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def run_on_terminal(args: list[str], cwd: Path) -> str:
    """stdout and stderr on a pseudo-terminal; everything the program wrote, as the terminal got it."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no "\n" -> "\r\n" translation: every "\r" read back is the program's own
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column screen
    proc = forkserver.popen(args, cwd=cwd, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the program exited and closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def training_runs(train_data, tmp_path_factory):
    out = {}
    for where, run in (("file", run_into_files), ("terminal", run_on_terminal)):
        root = tmp_path_factory.mktemp(f"console-{where}")
        training = {"global_batch_size": 8, "device_microbatch_size": 8, "max_duration": "8ba"}
        training |= {"eval_interval": "8ba", "eval_subset_num_batches": 2, "log_interval": 4}
        recipe = write_recipe(
            root / "recipe.yaml", train_data, training=training, loggers={"progress_bar": True}
        )
        out[where] = run([sys.executable, "train.py", str(recipe)], REPO)
    return out


@pytest.mark.slow
def test_training_written_to_a_file_has_labelled_lines_and_no_bars(training_runs):
    log = training_runs["file"]
    assert "[progress] step 8/8 (100%)" in log
    found = [c for c in CONTROL if c in log]
    assert not found, f"control sequences {found} in a log written to a file"


@pytest.mark.slow
def test_training_on_a_terminal_keeps_its_live_bars(training_runs):
    screen = training_runs["terminal"]
    assert "[progress] step 8/8 (100%)" in screen
    assert "\r" in screen and "train" in screen  # Composer's bar redrawing in place


def conversion_args(train_data, out: Path) -> list[str]:
    corpus = train_data.root / "corpus.jsonl"
    return [
        sys.executable, "-m", "convert", "shards", str(corpus), "--format", "jsonl",
        "--tokenizer", str(train_data.tokenizer), "--seq-len", "64", "--workers", "1", "--out", str(out),
    ]  # fmt: skip


def test_conversion_written_to_a_file_prints_labelled_progress_lines(train_data, tmp_path):
    log = run_into_files(conversion_args(train_data, tmp_path / "shards"), REPO)
    assert "[progress] reading: 400 doc" in log
    found = [c for c in CONTROL if c in log]
    assert not found, f"control sequences {found} in a log written to a file"


def test_conversion_on_a_terminal_draws_its_bar(train_data, tmp_path):
    screen = run_on_terminal(conversion_args(train_data, tmp_path / "shards"), REPO)
    assert "reading" in screen and "\r" in screen and "[progress] reading" not in screen
