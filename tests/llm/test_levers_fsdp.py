"""Activation-checkpointing policies under FSDP2 on 2 ranks (gloo): the losses and gradients of no
checkpointing, also with documents kept apart on the GPU's kernel (FlexAttention's block mask).
One two-rank launch (tests/support/drivers/levers_fsdp_driver.py) computes every policy; the tests
assert on it."""

from __future__ import annotations

import json
import os

import pytest

from tests.support import forkserver, paths
from tests.support.drivers.levers_fsdp_driver import SMALL

pytestmark = pytest.mark.slow  # starts two processes
ROOT = paths.REPO


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("policies")
    result = forkserver.run(
        [forkserver.COMPOSER, "-n", "2", str(paths.DRIVERS / "levers_fsdp_driver.py"), str(out)],
        cwd=out,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("documents", ["", "/documents"], ids=["causal", "documents"])
@pytest.mark.parametrize("policy", ["full/0", "selective/0", "selective/2"])
def test_each_policy_trains_like_no_checkpointing_under_fsdp2(two_ranks, policy, documents):
    plain, policy = f"none/0{documents}", f"{policy}{documents}"
    for rank in two_ranks:
        assert rank[policy]["wrapped"] == SMALL.n_layers
        assert rank[policy]["losses"] == pytest.approx(rank[plain]["losses"], abs=1e-6)
        assert rank[policy]["grads"].keys() == rank[plain]["grads"].keys()
        for name, grad in rank[plain]["grads"].items():
            assert rank[policy]["grads"][name] == pytest.approx(grad, abs=1e-6), name
    assert two_ranks[0]["none/0/documents"]["losses"] != two_ranks[0]["none/0"]["losses"]


def test_the_ranks_saw_different_data_and_agree_on_the_gradients(two_ranks):
    first, second = two_ranks
    assert first["none/0"]["losses"] != second["none/0"]["losses"]  # each rank its own batch
    assert first["none/0"]["grads"] == second["none/0"]["grads"]  # all-reduced: one gradient


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_the_chunked_loss_head_trains_like_the_plain_one_under_fsdp2(two_ranks, tied):
    """IGNORE_INDEX targets, z-loss and max-z loss; the output weight gathered once per step, as
    the plain path gathers it (not once per chunk: 3 chunks of 12 tokens here)."""
    for rank in two_ranks:
        plain, chunked = rank[f"loss/plain/{tied}"], rank[f"loss/chunked/{tied}"]
        assert chunked["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        assert chunked["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            assert chunked["grads"][name] == pytest.approx(grad, rel=1e-5, abs=1e-7), name
        assert chunked["all_gathers"] == plain["all_gathers"] > 0
