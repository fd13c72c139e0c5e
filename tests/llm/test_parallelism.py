"""FSDP2, HSDP and per-block compile through the real trainer on CPUs (gloo), as on GPUs.

- compile: `training.compile=true` with FSDP2 and activation checkpointing trains with inductor
  (the system C compiler) to the same losses as eager, within float tolerance: inductor fuses and
  reorders float arithmetic, so bit equality is not expected. One graph serves every block.
- HSDP: 4 ranks as 2 "nodes" x 2 ranks (two `composer` launchers, each in its own /dev/shm, as
  tests/e2e/test_multinode.py does), `fsdp.replicate=2`: parameters sharded within a node, gradients
  all-reduced between the nodes. Compared with plain FSDP2 over the same 4 ranks: the same data
  in the same order, only the reduction differs (reduce-scatter over 2 ranks then an all-reduce
  between 2 replicas, instead of one reduce-scatter over 4), so losses and weights agree within
  float tolerance. It checkpoints (only the first replica writes shards), stops on SIGTERM, and
  resumes with exactly the weights it saved. Both keep documents apart (`model.attention=document`,
  positions restarting), which the 4-rank runs exercise at no extra cost.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.support.resume import interrupt, load_weights, private_shm_problem, run, run_nodes, write_recipe

pytestmark = pytest.mark.slow

STEPS = 8
FSDP = [
    "fsdp.enabled=true",
    "fsdp.activation_checkpointing=true",
    "model.tie_embeddings=true",  # as recipes/tiny.yaml: tied weights inside the root FSDP unit
    f"training.max_duration={STEPS}ba",
    "checkpoint.save_interval=4ba",
]


def _losses(record: Path) -> dict[int, float]:
    return {r["batch"]: r["loss"] for r in map(json.loads, record.read_text().splitlines())}


def _parallelism_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("parallelism: ")]
    assert lines, output[-4000:]
    return lines[0]


def _assert_close_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] - wb[k]).abs().max() <= atol, k


# --- compile -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager(tmp_path_factory, shards):
    """FSDP2 (one rank) with activation checkpointing, eager: the compile test's reference."""
    folder = tmp_path_factory.mktemp("eager")
    recipe = write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    result = run(recipe, "eager", cwd=folder, overrides=FSDP)
    assert result.returncode == 0, result.output[-6000:]
    return result


def test_compile_per_block_with_fsdp2_and_checkpointing_trains_like_eager(tmp_path, shards, eager):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    inductor = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TORCH_LOGS": "recompiles"}
    compiled = run(recipe, "compiled", cwd=tmp_path, overrides=[*FSDP, "training.compile=true"], env=env)
    assert compiled.returncode == 0, compiled.output[-6000:]

    line = _parallelism_line(compiled.output)
    assert "FSDP2 full shard over 1 rank(s)" in line, line
    assert "activation checkpointing on 2/2 blocks; compiled 2/2 blocks" in line, line
    assert "compiled 0/2 blocks" in _parallelism_line(eager.output)
    # Inductor really generated code (C++ for the CPU), and one graph served both blocks: no
    # recompilation from one block to the next, nor for the checkpointed recomputation.
    assert list(inductor.rglob("*.cpp")) or list(inductor.rglob("*.so")), sorted(inductor.rglob("*"))[:20]
    assert "Recompiling function" not in compiled.output, compiled.output[-6000:]

    ref, got = _losses(eager.record), _losses(compiled.record)
    assert list(got) == list(ref) == list(range(1, STEPS + 1))
    for batch in ref:
        assert got[batch] == pytest.approx(ref[batch], rel=1e-4), batch
    _assert_close_weights(eager.weights, compiled.weights, atol=1e-3)


# --- HSDP --------------------------------------------------------------------------------------

NODES = (2, 2)  # launchers x ranks per launcher
DOCUMENTS = ["model.attention=document", "model.positions=document"]
WS4 = [*FSDP, "training.device_microbatch_size=1", *DOCUMENTS]  # global batch 4 over 4 ranks


@pytest.fixture(scope="module")
def nodes_ok():
    problem = private_shm_problem()
    if problem:
        pytest.skip(f"cannot give each 'node' its own /dev/shm here: {problem}")


@pytest.fixture(scope="module")
def fsdp_4_ranks(tmp_path_factory, shards, nodes_ok):
    """Plain FSDP2 over the same 2 x 2 ranks: HSDP's reference."""
    folder = tmp_path_factory.mktemp("fsdp4")
    recipe = write_recipe(folder / "recipe.yaml", shards, str(folder / "ckpt"), cache=folder / "cache")
    result = run_nodes(recipe, "fsdp4", cwd=folder, nodes=NODES[0], nproc=NODES[1], overrides=WS4)
    assert result.returncode == 0, result.output[-6000:]
    assert "FSDP2 full shard over 4 rank(s)" in _parallelism_line(result.output)
    return result


def test_hsdp_two_nodes_trains_like_fsdp_checkpoints_from_one_replica_and_resumes(
    tmp_path, shards, fsdp_4_ranks
):
    save = tmp_path / "ckpt"
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(save), cache=tmp_path / "cache")
    hsdp = [*WS4, "fsdp.replicate=2"]
    first = interrupt(
        recipe,
        "first",
        cwd=tmp_path,
        at_batch=3,
        sig=signal.SIGTERM,
        overrides=hsdp,
        env={"LLM_TEST_STOP_WEIGHTS": str(tmp_path / "stop.weights.pt")},
        nodes=NODES,
    )
    line = _parallelism_line(first.output)
    assert "FSDP2 HSDP over 4 ranks: 2 replica groups x 2-way shards, replica all-reduce on 3 units" in line
    assert "activation checkpointing on 2/2 blocks" in line
    stop = first.batches()[-1]["batch"]
    assert 3 <= stop < STEPS, first.output[-4000:]

    # The first replica (global ranks 0 and 1) wrote the shards and the manifests; the second
    # replica holds the same shards and wrote nothing.
    shard_files = sorted(p.name for p in (save / f"ep0-ba{stop}").glob("*.distcp"))
    assert shard_files == ["__0_0.distcp", "__1_0.distcp"], first.output[-4000:]
    manifests = sorted(p.name for p in (save / "manifests").glob(f"ba{stop:010d}-*.json"))
    assert manifests == [f"ba{stop:010d}-rank00000.json", f"ba{stop:010d}-rank00001.json"]
    head = json.loads((save / "manifests" / manifests[0]).read_text())
    assert (head["writers"], head["world_size"], head["sharded"]) == (2, 4, True)

    second = run_nodes(
        recipe,
        "second",
        cwd=tmp_path,
        nodes=NODES[0],
        nproc=NODES[1],
        overrides=hsdp,
        env={"LLM_TEST_LOADED_WEIGHTS": str(tmp_path / "loaded.weights.pt")},
    )
    assert second.returncode == 0, second.output[-6000:]
    assert f"resuming run 'rs' from the checkpoint at batch {stop}" in second.output
    stopped, loaded = load_weights(tmp_path / "stop.weights.pt"), load_weights(tmp_path / "loaded.weights.pt")
    assert stopped.keys() == loaded.keys() and all(torch.equal(stopped[k], loaded[k]) for k in stopped)

    # Against plain FSDP2 on the same ranks and data: equal within float tolerance, batch by batch.
    ref = _losses(fsdp_4_ranks.record)
    losses = {**_losses(first.record), **_losses(second.record)}
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    for batch, loss in losses.items():
        assert loss == pytest.approx(ref[batch], abs=5e-4), (batch, losses, ref)
    _assert_close_weights(fsdp_4_ranks.weights, second.weights, atol=5e-3)
    assert re.search(r"finished at step 8\b", second.output)
