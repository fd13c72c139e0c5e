"""Activation-checkpointing policies under FSDP2 on 2 ranks (gloo): the losses and gradients of no
checkpointing. One two-rank launch computes every policy; the tests assert on it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from llm.model import ModelConfig, Transformer
from llm.parallelism import apply_activation_checkpointing

pytestmark = pytest.mark.slow  # starts two processes

POLICIES = [("none", 0), ("full", 0), ("selective", 0), ("selective", 2)]
SMALL = ModelConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)
WRAPPER = "._checkpoint_wrapped_module"


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for policy, every in POLICIES:
        model = Transformer(SMALL, seed=3)
        wrapped = apply_activation_checkpointing(model, policy, every) if policy != "none" else 0
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        tokens = torch.randint(0, SMALL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(2):  # the second step runs on weights the first one updated
            loss = _loss(model, tokens)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.item())
        _loss(model, tokens).backward()
        grads = {
            n.replace(WRAPPER, ""): p.grad.full_tensor().flatten().tolist()
            for n, p in model.named_parameters()
        }
        results[f"{policy}/{every}"] = {"losses": losses, "grads": grads, "wrapped": wrapped}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("policies")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("policy", ["full/0", "selective/0", "selective/2"])
def test_each_policy_trains_like_no_checkpointing_under_fsdp2(two_ranks, policy):
    for rank in two_ranks:
        assert rank[policy]["wrapped"] == SMALL.n_layers
        assert rank[policy]["losses"] == pytest.approx(rank["none/0"]["losses"], abs=1e-6)
        assert rank[policy]["grads"].keys() == rank["none/0"]["grads"].keys()
        for name, grad in rank["none/0"]["grads"].items():
            assert rank[policy]["grads"][name] == pytest.approx(grad, abs=1e-6), name


def test_the_ranks_saw_different_data_and_agree_on_the_gradients(two_ranks):
    first, second = two_ranks
    assert first["none/0"]["losses"] != second["none/0"]["losses"]  # each rank its own batch
    assert first["none/0"]["grads"] == second["none/0"]["grads"]  # all-reduced: one gradient
