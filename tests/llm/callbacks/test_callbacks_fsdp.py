"""The task-eval and generation callbacks on an FSDP2-sharded model over two ranks: every rank takes
part in each call and gets the same result, rank 0 alone writes, and the results are those of one
process on the gathered weights.

One `composer -n 2` launch (tests/support/drivers/callbacks_rank_driver.py), run once for the module, with both
callbacks in it; the tests assert on what it left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.support import forkserver, paths
from tests.support.drivers.callbacks_rank_driver import CFG

pytestmark = pytest.mark.slow  # a two-rank launch

REPO = paths.REPO
DRIVER = paths.DRIVERS / "callbacks_rank_driver.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory, small_tokenizer, chinese_documents) -> tuple[Path, str]:
    """The launch's folder and the task folder it scored."""
    from convert.demo.tasks import write_demo_tasks
    from shards.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("callbacks-fsdp")
    tok = Tokenizer(small_tokenizer)
    ids = [t for doc in chinese_documents[:20] for t in tok.encode(doc) + [tok.eos_id]]
    torch.save(torch.tensor(ids[: 10 * 33]).view(10, 33), out / "samples.pt")
    task = str(out / "zh-demo")
    write_demo_tasks(task, questions=5)
    launcher = forkserver.COMPOSER
    result = forkserver.run(
        [launcher, "-n", "2", str(DRIVER), str(out), small_tokenizer, task],
        cwd=out,
        env={**os.environ, "FSDP_VERSION": "2", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, task


def _ranks(out: Path) -> tuple[dict, dict]:
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))


def test_under_fsdp2_both_ranks_score_the_same_and_rank_zero_writes(launched, small_tokenizer):
    from llm.eval.harness import load_tasks, prepare, run
    from llm.model import Transformer
    from shards.tokenizer import Tokenizer

    out, task = launched
    rank0, rank1 = (r["scores"] for r in _ranks(out))
    assert len(rank0) == 2 and rank0 == rank1  # steps 2 and 4, every score on both ranks
    rows = [json.loads(line) for line in (out / "run" / "tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 4, 4]  # written once, by rank 0

    # The same scores as one process scoring the final (gathered) weights.
    tok = Tokenizer(small_tokenizer)
    model = Transformer(CFG)
    model.load_state_dict(torch.load(out / "final_weights.pt"))
    prepared = prepare(load_tasks([task]), tok, 1, tok.start_id)
    alone = [q.loglikelihoods for t in run(model.eval(), prepared).tasks for q in t.questions]
    assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(alone, rank0[-1], strict=True))


def test_under_fsdp2_every_rank_generates_in_lockstep_and_rank_zero_writes(launched):
    from llm.weights.read import load_model

    out, _ = launched
    rank0, rank1 = (r["texts"] for r in _ranks(out))
    assert len(rank0) == 2 and rank0 == rank1  # both ranks took part in both calls, same tokens
    lines = [json.loads(line) for line in (out / "run" / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [2, 2, 4, 4]  # written once, by rank 0
    assert [row["text"] for row in lines] == rank0[0] + rank0[1]

    # The sharded checkpoint loads into one model (llm generate / export) with the final weights.
    (checkpoint,) = (out / "ckpt").glob("ep*-ba4")
    model = load_model(str(checkpoint))
    final = torch.load(out / "final_weights.pt")
    assert all(torch.equal(p, final[n]) for n, p in model.state_dict().items())
