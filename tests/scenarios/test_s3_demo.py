"""`make demo-s3`, reduced to a few batches: its own SeaweedFS store, shards converted into it, a
run streaming from it stopped by SIGTERM and resumed from its checkpoint there, the closing eval
figure and the checkpoint listed in the store, the store stopped. One demo, several assertions."""

from __future__ import annotations

import contextlib
import io
import re
import socket

import pytest

from scenarios import s3_demo
from tests.support import forkserver
from tests.support.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.s3]

REDUCED = [
    "training.max_duration=8ba",
    "scheduler.warmup=2ba",
    "training.eval_interval=4ba",
    "model.max_seq_len=64",
    "callbacks.eval_tasks.tasks=[]",  # the demo's task folder is made by `make demo-s3`, not here
    "loggers.progress_bar=false",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory, small_corpus, small_tokenizer):
    out = tmp_path_factory.mktemp("demo-s3")
    log = out.parent / "demo-s3.log"
    args = [
        "--corpus",
        small_corpus,
        "--tokenizer",
        small_tokenizer,
        "--out",
        str(out / "run"),
        "--seq-len",
        "64",
    ]
    args += ["--interrupt-at", "4", "--log", str(log), "--timeout", "300"]
    args += [f"--set={override}" for override in REDUCED]
    printed = io.StringIO()
    s3_demo.SPAWN = forkserver.popen
    try:
        with contextlib.redirect_stdout(printed):
            code = s3_demo.main(args)
    finally:
        s3_demo.SPAWN = __import__("subprocess").Popen
    return code, printed.getvalue(), log.read_text(errors="replace")


def test_the_demo_ends_well_and_says_where_each_step_went(demo):
    code, printed, runs = demo
    assert code == 0, runs[-3000:]
    said = [line for line in printed.splitlines() if line.startswith("[demo-s3]")]
    assert said[0].startswith("[demo-s3] local S3 store (SeaweedFS) at http://127.0.0.1:")
    assert "[demo-s3] converting" in printed and "into shards in s3://demo/shards" in printed
    assert said[-1] == "[demo-s3] store stopped"


def test_sigterm_saves_in_the_store_and_the_same_command_resumes_from_it(demo):
    _, printed, runs = demo
    saved = re.search(
        r"SIGTERM at batch 4: the run saved a checkpoint at batch (\d+) in (\S+), exit 143", printed
    )
    assert saved and saved[2] == "s3://demo/checkpoints/demo-s3", printed
    batch = int(saved[1])
    assert 4 <= batch < 8, "saved where SIGTERM stopped it (the demo signals once batch 4 is logged)"
    assert f"[resume] resuming run 'demo-s3' from the checkpoint at batch {batch}:" in runs
    # On the machine that saved it, the resume loads this node's copy once it matches the store's
    # manifest (checkpoint.local_copy); a new machine downloads it (tests/e2e/test_resume_s3.py).
    restart = re.search(
        rf"\[restart\] resumed at batch {batch},.* \(\d+ file\(s\), [\d.]+ MB"
        r"(?: downloaded|: this node's copy, verified)",
        runs,
    )
    assert restart, "the resumed run read its checkpoint from the store or this node's verified copy"


def test_it_closes_with_the_eval_figure_and_the_checkpoint_in_the_store(demo):
    _, printed, _ = demo
    assert re.search(r"bigram baseline .* eval loss \d+\.\d+ \| the model: \d+\.\d+", printed), printed
    listed = printed.split("files:\n", 1)[1].splitlines()
    names = [line.split()[-1] for line in listed if line.startswith("  ")]
    assert "latest.json" in names and any(re.fullmatch(r"manifests/ba0*8-rank0*\.json", n) for n in names)
    assert any(n.startswith("ep") and "ba8" in n for n in names), names


def test_the_store_is_stopped_and_nothing_is_left_in_the_repository(demo):
    _, printed, _ = demo
    port = int(re.search(r"at http://127\.0\.0\.1:(\d+)", printed)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the store still answers"
    assert not (REPO / "s3:").exists()
