"""Memory-safe initialisation: meta build + FSDP2 shards give an ordinary init's weights, per rank."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from llm.memory_plan import plan_memory
from llm.meta_init import build_meta_model, materialize_
from llm.model import ModelConfig, Transformer
from tests.support import forkserver, paths

ROOT = paths.REPO
SMALL = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
MIB = 1024**2


def test_meta_build_allocates_no_parameter_storage():
    model = build_meta_model(SMALL, seed=3)
    assert all(p.is_meta for p in model.parameters())
    assert model.init_seed == 3


@pytest.mark.parametrize("tied, qkv_bias", [(True, False), (False, False), (False, True)])
def test_materialising_a_meta_model_gives_the_ordinary_init(tied, qkv_bias):
    cfg = ModelConfig(**{**SMALL.__dict__, "tie_embeddings": tied, "qkv_bias": qkv_bias})
    model = build_meta_model(cfg, seed=7)
    materialize_(model, "cpu")
    expected = Transformer(cfg, seed=7).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    biases = [t for name, t in got.items() if name.endswith(".bias")]
    assert len(biases) == (3 * cfg.n_layers if qkv_bias else 0) and all(not b.any() for b in biases)
    other_seed = Transformer(cfg, seed=8).state_dict()
    assert not torch.equal(got["layers.0.attention.wq.weight"], other_seed["layers.0.attention.wq.weight"])


def test_sharding_without_a_process_group_says_how_to_launch(tmp_path):
    # A process of its own: other tests in this session may have started a process group.
    code = (
        "from llm.meta_init import MetaInitError, build_meta_model, shard_fsdp2\n"
        "from llm.model import ModelConfig\n"
        "cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)\n"
        "try:\n"
        "    shard_fsdp2(build_meta_model(cfg, seed=0))\n"
        "except MetaInitError as err:\n"
        "    print('MetaInitError:', err)\n"
    )
    script = tmp_path / "shard.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = forkserver.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "MetaInitError:" in result.stdout and "composer -n" in result.stdout


@pytest.mark.slow
def test_fsdp2_over_two_ranks_equals_single_process_init_and_stays_below_model_size(tmp_path):
    """Two CPU ranks (gloo) shard a ~50 M-parameter meta model; no rank holds the full model.

    The gathered weights of it and of the warm-up model (uneven shards, grouped-query attention)
    equal an ordinary single-process init."""
    from tests.support.drivers.meta_init_driver import CFG

    out = tmp_path / "report.json"
    # The driver holds glibc's mmap threshold fixed itself (see fix_mmap_threshold), so the ranks
    # may be forks of the suite's fork server.
    env = {**os.environ, "FSDP_VERSION": "2", "PYTHONPATH": str(ROOT)}
    result = forkserver.run(
        [forkserver.COMPOSER, "-n", "2", str(paths.DRIVERS / "meta_init_driver.py"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert report["keys_equal"] and report["mismatched"] == []
    # The warm-up model: uneven shards (97 rows over 2 ranks) and grouped-query attention.
    assert report["warmup_keys_equal"] and report["warmup_mismatched"] == []

    plan = plan_memory(CFG, n_gpus=2, micro_batch=1, seq_len=CFG.max_seq_len)
    full_model = plan.host_memory_per_rank_eager  # what an ordinary build costs every rank
    for rank, figures in enumerate(report["ranks"]):
        shard, peak = figures["shard_bytes"], figures["peak_growth"]
        assert abs(shard - full_model / 2) < MIB, f"rank {rank} holds {shard} bytes, not half the model"
        # The shard stays in host memory here (CPU); the rest is the plan's transient: a few full
        # parameters being drawn before they are cut, plus allocator slack.
        assert peak <= shard + 2 * plan.host_memory_per_rank + 16 * MIB, (rank, peak)
        assert peak < 0.6 * full_model, f"rank {rank} peaked at {peak / MIB:.0f} MiB"
