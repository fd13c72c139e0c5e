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
from llm.errors import ConfigError
from llm.model import ModelConfig
from llm.weights.read import load_model

VOCAB, SEQ = 2000, 32
CFG = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, max_seq_len=SEQ + 16, tie_embeddings=True)
PROMPTS = ["中国", "北京市经济"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, chinese_documents) -> str:
    from convert.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tok.model"
    train_tokenizer(chinese_documents[:60], vocab_size=VOCAB, out=str(out), character_coverage=0.98)
    return str(out)


@pytest.fixture(scope="module")
def samples(tokenizer_path, chinese_documents) -> torch.Tensor:
    """10 real-text samples of SEQ + 1 tokens."""
    from llm.tokenizer import Tokenizer

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
    return GenerationCallback(PROMPTS, "4ba", tokenizer_path, run_dir, **settings)


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
    with pytest.raises(ConfigError, match="2000 pieces but the model's vocabulary is 1000"):
        trainer.fit()
    trainer.close()


# --- two ranks under FSDP2 (CPU, gloo) ----------------------------------------------------------


class RecordingCallback(GenerationCallback):
    """Keeps what each call returned on this rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history: list[list[str]] = []

    def run(self, state, logger):
        texts = super().run(state, logger)
        self.history.append(texts)
        return texts


def _fsdp2_driver(out_dir: str, tokenizer_path: str) -> None:
    """Run by `composer -n 2` (see the test below): 4 FSDP2 steps with generation every 2."""
    from pathlib import Path

    from composer.utils import FSDP2Config, dist

    out = Path(out_dir)
    data = [{"input_ids": s} for s in torch.load(out / "samples.pt")]
    model = LanguageModel.from_config(CFG, seed=5)
    callback = RecordingCallback(
        PROMPTS, "2ba", tokenizer_path, out / "run", max_new_tokens=8, temperature=1.0, top_k=0, seed=3
    )
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=2, sampler=dist.get_sampler(data, shuffle=False)),
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_duration="4ba",
        device="cpu",
        precision="fp32",
        parallelism_config={"fsdp": FSDP2Config(activation_checkpointing=False, state_dict_type="sharded")},
        callbacks=[callback],
        progress_bar=False,
        save_folder=str(out / "ckpt"),
        save_interval="4ba",
    )
    from torch.distributed.tensor import DTensor

    assert isinstance(model.model.tok_embeddings.weight, DTensor)  # really sharded
    trainer.fit()
    (out / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(callback.history, ensure_ascii=False))
    full = {k: v.full_tensor() for k, v in model.model.state_dict().items()}  # collective
    if dist.get_global_rank() == 0:
        torch.save(full, out / "final_weights.pt")
    trainer.close()


@pytest.mark.slow
def test_under_fsdp2_every_rank_generates_in_lockstep_and_rank_zero_writes(tmp_path, tokenizer_path, samples):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    torch.save(samples, tmp_path / "samples.pt")
    launcher = str(Path(sys.executable).parent / "composer")
    result = subprocess.run(
        [launcher, "-n", "2", __file__, str(tmp_path), tokenizer_path],
        cwd=tmp_path,
        env={**os.environ, "FSDP_VERSION": "2", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert len(rank0) == 2 and rank0 == rank1  # both ranks took part in both calls, same tokens
    lines = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [2, 2, 4, 4]  # written once, by rank 0
    assert [row["text"] for row in lines] == rank0[0] + rank0[1]

    # The sharded checkpoint loads into one model (llm generate / export) with the final weights.
    model = load_model(str(tmp_path / "ckpt" / "ep1-ba4"))
    final = torch.load(tmp_path / "final_weights.pt")
    assert all(torch.equal(p, final[n]) for n, p in model.state_dict().items())


if __name__ == "__main__":
    import sys

    _fsdp2_driver(sys.argv[1], sys.argv[2])


def test_console_logging_without_pandas_does_not_stop_training(tmp_path, tokenizer_path, samples):
    """Composer's console logger needs pandas for tables; the samples are printed by us instead."""
    from composer.loggers import ConsoleLogger

    _, recorded = fit(
        samples, [make_callback(tokenizer_path, tmp_path / "run")], extra_loggers=[ConsoleLogger()]
    )
    assert len(recorded.losses) == 10
    assert [step for step, _ in recorded.tables] == [4, 8, 10]
