"""The checkpointing entry point: callbacks come in the one order that works, or the build fails."""

from __future__ import annotations

import pytest
import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, LRMonitor
from torch.utils.data import DataLoader

from llm.checkpoint.plan import plan_checkpointing
from llm.checkpoint.preemption import PreemptionCallback
from llm.checkpoint.publisher import CheckpointPublisher
from llm.checkpoint.resume import RunAlreadyComplete
from llm.composer_model import LanguageModel
from llm.config import load_config
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


def test_the_plan_puts_saver_publisher_and_preemption_last_in_that_order(tmp_path):
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck")})
    plan = plan_checkpointing(cfg, rank=0, world_size=1)
    others = [LRMonitor()]
    callbacks = plan.callbacks_after(others)
    assert [type(c) for c in callbacks] == [
        LRMonitor,
        CheckpointSaver,
        CheckpointPublisher,
        PreemptionCallback,
    ]
    assert plan.trainer_kwargs["save_folder"] is None and plan.trainer_kwargs["autoresume"] is False
    build(callbacks).close()  # the right order builds
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
