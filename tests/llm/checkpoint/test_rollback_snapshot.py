"""The guard's rollback from the snapshot in host memory, on a real Composer run.

One `train.py` run in this process (8 batches, a monolithic checkpoint every 4, guard off) with a
probe that rolls back by hand at the end of batches 6 and 7: from the snapshot of the save at 4,
then from that checkpoint on disk (`NewestCheckpoint`), and compares the two bit for bit; at 7
again from the snapshot, which the training of batch 7 must not have changed; and asked for a
batch before any save, the snapshot gives way to the checkpoint in storage. The rollbacks inside
`train.py` processes (the guard's line, bit-identity with `data.skip`) are
tests/e2e/test_guard_rollback.py's.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from composer.core import Callback
from composer.utils import reproducibility

from llm.checkpoint.rollback import IN_MEMORY, HostSnapshot, NewestCheckpoint, Restored, _storages
from llm.checkpoint.saver import Saver
from tests.support.training import write_recipe


@dataclass
class Taken:
    """The state right after a restore: weights, optimizer, scheduler, RNG; and whether any live
    tensor is one of the snapshot's buffers."""

    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: list[dict]
    shares_buffers: bool


def _take(state) -> Taken:
    saver = next(cb for cb in state.callbacks if isinstance(cb, Saver))
    buffers = _storages(saver.held.state_dict)
    optimizer = state.optimizers[0]
    live = [*state.model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]
    return Taken(
        weights={k: v.detach().clone() for k, v in state.model.state_dict().items()},
        optimizer=copy.deepcopy(optimizer.state_dict()),
        scheduler=copy.deepcopy(state.schedulers[0].state_dict()),
        rng=copy.deepcopy(reproducibility.get_rng_state()),
        shares_buffers=any(isinstance(t, torch.Tensor) and _storages(t) & buffers for t in live),
    )


class Probe(Callback):
    """Rolls back by hand at the end of batches 6 and 7 (module docstring); what each gave."""

    def __init__(self, save_folder: str):
        self.save_folder = save_folder
        self.restored: dict[str, Restored | None] = {}
        self.taken: dict[str, Taken] = {}

    def batch_end(self, state, logger) -> None:
        batch = int(state.timestamp.batch)
        point = HostSnapshot(NewestCheckpoint(self.save_folder))
        if batch == 6:
            self.restored["snapshot"] = point.restore(state, logger, at_most=6)
            self.taken["snapshot"] = _take(state)
            self.restored["disk"] = NewestCheckpoint(self.save_folder).restore(state, logger, at_most=4)
            self.taken["disk"] = _take(state)
        elif batch == 7:
            self.restored["again"] = point.restore(state, logger, at_most=7)
            self.taken["again"] = _take(state)
            self.restored["further_back"] = point.restore(state, logger, at_most=3)


@pytest.fixture(scope="module")
def probed(tmp_path_factory, train_data) -> Probe:
    import train

    root = tmp_path_factory.mktemp("rollback-snapshot")
    save_folder = str(root / "ckpt")
    recipe = write_recipe(
        root / "r.yaml",
        train_data,
        checkpoint={"save_folder": save_folder, "save_interval": "4ba"},
        training={"global_batch_size": 8, "device_microbatch_size": 4, "max_duration": "8ba"},
    )
    probe = Probe(save_folder)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train.main([str(recipe)], extra_callbacks=[probe])
    assert code == 0, out.getvalue()[-3000:]
    return probe


def _assert_same(a: Taken, b: Taken) -> None:
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.optimizer["param_groups"] == b.optimizer["param_groups"]
    assert a.optimizer["state"].keys() == b.optimizer["state"].keys()
    for key, values in a.optimizer["state"].items():
        assert values.keys() == b.optimizer["state"][key].keys()
        assert all(torch.equal(v, b.optimizer["state"][key][name]) for name, v in values.items()), key
    assert a.scheduler == b.scheduler
    ((ra,), (rb,)) = a.rng, b.rng
    assert ra.keys() == rb.keys() and ra["python"] == rb["python"] and torch.equal(ra["torch"], rb["torch"])
    assert all(np.array_equal(x, y) for x, y in zip(ra["numpy"], rb["numpy"], strict=True))


def test_the_snapshot_restores_what_loading_its_checkpoint_from_disk_restores(probed):
    assert probed.restored["snapshot"] == Restored(4, IN_MEMORY)
    disk = probed.restored["disk"]
    assert disk == Restored(4, f"the checkpoint {probed.save_folder}/ep0-ba4-rank0.pt")
    _assert_same(probed.taken["snapshot"], probed.taken["disk"])


def test_the_restored_state_shares_no_memory_with_the_snapshot_so_later_steps_leave_it_intact(probed):
    assert not probed.taken["snapshot"].shares_buffers
    # A step after the restore (batch 7), then the same snapshot once more: still the state at 4.
    assert probed.restored["again"] == Restored(4, IN_MEMORY)
    assert not probed.taken["again"].shares_buffers
    _assert_same(probed.taken["again"], probed.taken["disk"])


def test_a_rollback_further_back_than_the_snapshot_loads_the_checkpoint_from_storage(probed):
    # None at or before 3: the newest there is, the checkpoint at 4, read from disk.
    fallback = probed.restored["further_back"]
    assert fallback == Restored(4, f"the checkpoint {probed.save_folder}/ep0-ba4-rank0.pt")
