"""The generation callback in real Composer runs: samples at the right steps, training unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from composer import Trainer
from composer.loggers import LoggerDestination
from torch.utils.data import DataLoader

from llm.callbacks.generation import GenerationCallback
from llm.commands import main as llm_main
from llm.composer_model import LanguageModel
from llm.config import GenerateCallbackConfig
from llm.model import ModelConfig
from llm.weights.read import load_model
from shards.errors import ShardsError

VOCAB, SEQ = 2000, 32
CFG = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, max_seq_len=SEQ + 16, tie_embeddings=True)
PROMPTS = ["中国", "北京市经济"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, chinese_documents) -> str:
    from convert.tokens.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tok.model"
    train_tokenizer(chinese_documents[:60], vocab_size=VOCAB, out=str(out), character_coverage=0.98)
    return str(out)


@pytest.fixture(scope="module")
def samples(tokenizer_path, chinese_documents) -> torch.Tensor:
    """10 real-text samples of SEQ + 1 tokens."""
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    ids = [t for doc in chinese_documents[:20] for t in tok.encode(doc) + [tok.eos_id]]
    return torch.tensor(ids[: 10 * (SEQ + 1)]).view(10, SEQ + 1)


class Recorder(LoggerDestination):
    def __init__(self):
        self.losses: dict[int, float] = {}
        self.tables: list[tuple[int, list]] = []

    def log_metrics(self, metrics, step=None):
        if "loss/train/total" in metrics:
            self.losses[step] = float(metrics["loss/train/total"])

    def log_table(self, columns, rows, name="Table", step=None):
        self.tables.append((step, rows))


def fit(samples, callbacks, save_folder=None, extra_loggers=()):
    """10 batches of 2 over 10 samples: 2 epochs, shuffled from the global RNG each epoch."""
    loader = DataLoader([{"input_ids": s} for s in samples], batch_size=2, shuffle=True)
    recorder = Recorder()
    model = LanguageModel.from_config(CFG, seed=5)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration="10ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        device="cpu",
        precision="fp32",
        seed=42,
        callbacks=callbacks,
        loggers=[recorder, *extra_loggers],
        progress_bar=False,
        save_folder=save_folder,
        save_interval="10ba",
    )
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.close()
    return weights, recorder


def make_callback(tokenizer_path, run_dir, **kwargs):
    settings = dict(max_new_tokens=8, temperature=0.8, top_k=20, seed=3, **kwargs)
    return GenerationCallback(
        GenerateCallbackConfig(prompts=PROMPTS, interval="4ba", **settings), tokenizer_path, run_dir
    )


def test_callback_writes_samples_and_does_not_change_training(tmp_path, tokenizer_path, samples):
    base_weights, base = fit(samples, [])
    callback = make_callback(tokenizer_path, tmp_path / "run")
    weights, recorded = fit(samples, [callback], save_folder=str(tmp_path / "ckpt"))

    assert recorded.losses == base.losses and len(base.losses) == 10
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)

    lines = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [4, 4, 8, 8, 10, 10]  # every 4 batches and at the end
    assert [row["prompt"] for row in lines[:2]] == PROMPTS
    assert all(isinstance(row["text"], str) for row in lines)
    assert [step for step, _ in recorded.tables] == [4, 8, 10]
    assert callback.last_seconds > 0

    # The checkpoint records the model's shape (through the callback): no recipe needed to load it.
    model = load_model(str(tmp_path / "ckpt" / "ep1-ba10-rank0.pt"))
    trained = {k.removeprefix("model."): v for k, v in weights.items()}
    assert all(torch.equal(p, trained[n]) for n, p in model.state_dict().items())


def test_a_run_stopping_on_sigterm_skips_the_end_samples_so_its_checkpoint_comes_first(
    tmp_path, tokenizer_path, samples
):
    import os
    import signal

    from composer.callbacks import CheckpointSaver
    from composer.core import Callback

    from llm.checkpoint.preemption import PreemptionCallback

    class SigtermAt(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    callback = make_callback(tokenizer_path, tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        saver = CheckpointSaver(folder=str(tmp_path / "ckpt"), save_interval="10ba")
        fit(samples, [callback, SigtermAt(), saver, PreemptionCallback()])  # preemption's must be last
    assert stopped.value.code == 143
    assert (tmp_path / "ckpt" / "ep0-ba5-rank0.pt").exists()
    lines = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [4, 4]  # none at the stop (batch 5)


def test_llm_generate_continues_prompts_from_a_composer_checkpoint(tmp_path, tokenizer_path, samples, capsys):
    fit(samples, [make_callback(tokenizer_path, tmp_path / "run")], save_folder=str(tmp_path / "ckpt"))
    ckpt = str(tmp_path / "ckpt" / "latest-rank0.pt")
    capsys.readouterr()  # drop the training run's output
    args = ["generate", ckpt, "--tokenizer", tokenizer_path, "--prompt", "中国", "--prompt", "北京"]
    assert llm_main([*args, "--max-new-tokens", "6", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert "中国" in first and "北京" in first
    assert llm_main([*args, "--max-new-tokens", "6", "--seed", "1"]) == 0
    assert capsys.readouterr().out == first  # seeded: the same continuation


def test_a_tokenizer_larger_than_the_model_vocab_is_refused_at_fit_start(tmp_path, tokenizer_path, samples):
    small = ModelConfig(vocab_size=VOCAB // 2, dim=32, n_layers=1, n_heads=2, max_seq_len=SEQ + 16)
    model = LanguageModel.from_config(small, seed=5)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader([{"input_ids": s % (VOCAB // 2)} for s in samples], batch_size=2),
        optimizers=torch.optim.AdamW(model.parameters()),
        max_duration="2ba",
        device="cpu",
        callbacks=[make_callback(tokenizer_path, tmp_path / "run")],
        progress_bar=False,
    )
    with pytest.raises(ShardsError, match="2000 pieces but the model's vocabulary is 1000"):
        trainer.fit()
    trainer.close()


# --- two ranks under FSDP2 (CPU, gloo) ----------------------------------------------------------


# The callback on an FSDP2-sharded model over two ranks: tests/llm/callbacks/test_callbacks_fsdp.py.


def test_console_logging_without_pandas_does_not_stop_training(tmp_path, tokenizer_path, samples):
    """Composer's console logger needs pandas for tables; the samples are printed by us instead."""
    from composer.loggers import ConsoleLogger

    _, recorded = fit(
        samples, [make_callback(tokenizer_path, tmp_path / "run")], extra_loggers=[ConsoleLogger()]
    )
    assert len(recorded.losses) == 10
    assert [step for step, _ in recorded.tables] == [4, 8, 10]
