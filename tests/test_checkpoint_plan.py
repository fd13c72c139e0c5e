"""The checkpointing entry point: callbacks come in the one order that works, or the build fails."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, LRMonitor
from torch.utils.data import DataLoader

from llm.checkpoint.lock import LOCK_FILE
from llm.checkpoint.plan import RunLockCallback, plan_checkpointing
from llm.checkpoint.preemption import PreemptionCallback
from llm.checkpoint.publisher import CheckpointPublisher
from llm.checkpoint.resume import RunAlreadyComplete
from llm.composer_model import LanguageModel
from llm.config import load_config
from llm.errors import ConfigError
from llm.memory_plan import count_params
from llm.model import ModelConfig
from storage import open_store

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)


def build(callbacks) -> Trainer:
    model = LanguageModel.from_config(CFG, seed=1)
    data = DataLoader([{"input_ids": torch.randint(0, 64, (9,))} for _ in range(4)], batch_size=2)
    return Trainer(
        model=model,
        train_dataloader=data,
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        callbacks=callbacks,
        progress_bar=False,
    )


def recipe(tmp_path, **overrides):
    path = tmp_path / "r.yaml"
    path.write_text(
        "run_name: plan\nmodel: {vocab_size: 64, dim: 32, n_layers: 1, n_heads: 2, max_seq_len: 16}\n"
        "tokenizer: {path: t.model}\ndata: {train: [{remote: x}]}\n"
    )
    return load_config(str(path), [f"{k}={v}" for k, v in overrides.items()])


def test_the_plan_puts_saver_publisher_lock_and_preemption_last_in_that_order(tmp_path):
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck")})
    plan = plan_checkpointing(cfg, rank=0, world_size=1)
    others = [LRMonitor()]
    callbacks = plan.callbacks_after(others)
    assert [type(c) for c in callbacks] == [
        LRMonitor,
        CheckpointSaver,
        CheckpointPublisher,
        RunLockCallback,
        PreemptionCallback,
    ]
    assert plan.trainer_kwargs["save_folder"] is None and plan.trainer_kwargs["autoresume"] is False
    assert (tmp_path / "ck" / LOCK_FILE).is_file()  # rank 0 holds the folder's run lock
    build(callbacks).close()  # the right order builds; closing the Trainer releases the lock
    assert not (tmp_path / "ck" / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="PreemptionCallback must come from plan_checkpointing"):
        plan.callbacks_after([PreemptionCallback()])


def test_a_wrong_order_fails_when_the_trainer_is_built(tmp_path):
    with pytest.raises(RuntimeError, match="PreemptionCallback must be the last callback"):
        build([PreemptionCallback(), LRMonitor()])
    saver = CheckpointSaver(folder=str(tmp_path / "ck"))
    publisher = CheckpointPublisher(open_store(tmp_path / "ck"), str(tmp_path / "ck"), num_to_keep=1)
    with pytest.raises(RuntimeError, match="right after Composer's CheckpointSaver"):
        build([publisher, saver, PreemptionCallback()])
    with pytest.raises(RuntimeError, match="right after Composer's CheckpointSaver"):
        build([saver, LRMonitor(), publisher, PreemptionCallback()])


def test_run_already_complete_is_a_plain_exception_that_prints_nothing(capsys):
    err = RunAlreadyComplete("run 'x' already finished")
    assert not isinstance(err, SystemExit) and str(err) == "run 'x' already finished"
    assert capsys.readouterr() == ("", "")


@pytest.fixture
def read_only(tmp_path):
    """A folder nobody may write into, root included (`chattr +i` as root, else mode 0555)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
            pytest.skip("running as root without chattr +i: no way to make a folder read-only")
        yield folder
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def test_a_read_only_save_folder_is_refused_before_training(tmp_path, read_only):
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(read_only / "ckpt")})
    with pytest.raises(ConfigError, match=r"checkpoint\.save_folder=.*/ro/ckpt cannot be written \(.*ro"):
        plan_checkpointing(cfg, rank=0, world_size=1)
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(read_only)})  # the folder itself
    with pytest.raises(ConfigError, match="cannot be written"):
        plan_checkpointing(cfg, rank=0, world_size=1)


def test_a_save_folder_without_room_for_one_checkpoint_is_refused_before_training(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    per_layer = count_params(
        ModelConfig(vocab_size=64, dim=4096, n_layers=1, n_heads=32, max_seq_len=16)
    ).block
    layers = 2 * free // (12 * per_layer) + 1  # twice the disk's free space, at 12 bytes a parameter
    model = f"{{vocab_size: 64, dim: 4096, n_layers: {layers}, n_heads: 32, max_seq_len: 16}}"
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck"), "model": model})
    with pytest.raises(ConfigError, match=r"GiB free, but one checkpoint of this model needs at least"):
        plan_checkpointing(cfg, rank=0, world_size=1)
    assert not (tmp_path / "ck" / LOCK_FILE).exists()  # refused before the lock was taken
