"""Evaluation during training: per-source eval loss with its total, and multiple-choice tasks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from composer import Trainer
from composer.loggers import LoggerDestination
from torch.utils.data import DataLoader

from llm.callbacks.task_eval import TaskEvalCallback
from llm.composer_model import LanguageModel
from llm.config import EvalTasksCallbackConfig
from llm.errors import ConfigError
from llm.model import ModelConfig
from llm.plots import load_run
from tests.support.training import load, read_metrics, write_recipe


@pytest.fixture(scope="module")
def demo_task(tmp_path_factory) -> str:
    from convert.demo.tasks import write_demo_tasks

    out = tmp_path_factory.mktemp("tasks") / "zh-demo"
    write_demo_tasks(str(out), questions=4)
    return str(out)


def test_each_eval_stream_reports_its_loss_and_the_token_weighted_total(
    tmp_path, train_data, demo_task, capsys
):
    from llm.callbacks.eval_sources import EvalSources
    from llm.callbacks.loss_plot import LossPlot
    from llm.trainer import build_trainer, print_summary, summarize

    recipe = write_recipe(
        tmp_path / "r.yaml",
        train_data,
        data={
            "train": [{"remote": str(train_data.train)}],
            "eval": [
                {"remote": str(train_data.val), "name": "news"},
                {"remote": str(train_data.train), "name": "seen"},
            ],
            "cache_root": str(tmp_path / "cache"),
        },
    )
    cfg = load(
        recipe,
        "training.eval_subset_num_batches=2",
        f"callbacks.eval_tasks.tasks=[{demo_task}]",
        "callbacks.eval_tasks.interval=12ba",
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    result = summarize(trainer, cfg)
    sources = next(cb for cb in trainer.state.callbacks if isinstance(cb, EvalSources))
    plot = next(cb for cb in trainer.state.callbacks if isinstance(cb, LossPlot))
    trainer.close()
    print_summary(result)
    out = capsys.readouterr().out

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [12, 24]
    for r in evals:
        for name in ("news", "seen"):
            assert r[f"eval_perplexity/{name}"] == pytest.approx(math.exp(r[f"eval_loss/{name}"]), rel=1e-4)
    # The total weighs each source by the tokens it scored (the last evaluation's counts).
    latest = sources.latest
    weighted = sum(latest[n]["loss"] * latest[n]["tokens"] for n in ("news", "seen"))
    assert latest["news"]["tokens"] > 0 and latest["seen"]["tokens"] == 2 * 8 * (train_data.seq_len - 1)
    assert evals[-1]["eval_loss"] == pytest.approx(
        weighted / (latest["news"]["tokens"] + latest["seen"]["tokens"])
    )
    assert evals[-1]["eval_loss/news"] == pytest.approx(latest["news"]["loss"])
    assert evals[-1]["eval_loss/news"] != pytest.approx(evals[-1]["eval_loss/seen"])
    # The state, the summary and the plot read the total; the plot also has each source's curve.
    assert result.eval_loss == pytest.approx(evals[-1]["eval_loss"])
    assert set(result.eval_sources) == {"news", "seen"}
    curves = load_run(str(tmp_path / "run"))  # what loss.png is drawn from
    tokens_at = [12 * 8 * train_data.seq_len, 24 * 8 * train_data.seq_len]
    assert curves.points("eval_loss")[0] == tokens_at and curves.eval_sources() == ["news", "seen"]
    assert all(curves.points(f"eval_loss/{n}")[0] == tokens_at for n in ("news", "seen"))
    assert plot.path.read_bytes()[:4] == b"\x89PNG"
    assert "[eval] step 24: loss" in out and "| news " in out and "| seen " in out and "    news " in out

    # The multiple-choice task ran at 12 and at the end, into tasks.jsonl and metrics.jsonl.
    rows = [json.loads(line) for line in (tmp_path / "run" / "tasks.jsonl").read_text().splitlines()]
    assert [(r["step"], r["subject"]) for r in rows] == [
        (12, "news_next_sentence"),
        (12, "review_sentiment"),
        (24, "news_next_sentence"),
        (24, "review_sentiment"),
    ]
    assert all(r["questions"] == 4 and 0 <= r["acc"] <= 1 for r in rows)
    tasks = [r for r in records if "tasks/zh-demo/acc" in r]
    assert [r["step"] for r in tasks] == [12, 24]
    assert "tasks/zh-demo/review_sentiment/acc" in tasks[0] and "[tasks] step 24" in out


def test_eval_stream_names_must_differ_and_task_settings_are_checked(tmp_path, train_data):
    twice = {
        "eval": [{"remote": "s3://a/wiki/val"}, {"remote": "s3://b/wiki/val"}],
        "train": [{"remote": "x"}],
    }
    with pytest.raises(
        ConfigError, match="data.eval.0 and data.eval.1 are both named 'wiki'; give them distinct"
    ):
        load(write_recipe(tmp_path / "a.yaml", train_data, data=twice))
    with pytest.raises(ConfigError, match=r"data.eval.0.name='a/b': use letters"):
        load(write_recipe(tmp_path / "b.yaml", train_data), "data.eval.0.name=a/b")
    with pytest.raises(ConfigError, match="callbacks.eval_tasks.shots=-1 must be 0 or more"):
        load(write_recipe(tmp_path / "c.yaml", train_data), "callbacks.eval_tasks.shots=-1")
    with pytest.raises(ConfigError, match="callbacks.eval_tasks.interval='0ba' is zero"):
        load(write_recipe(tmp_path / "d.yaml", train_data), "callbacks.eval_tasks.interval=0ba")


# --- the callback leaves training as it was ------------------------------------------------------

CFG = ModelConfig(vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=96, tie_embeddings=True)


@pytest.fixture(scope="module")
def samples(small_tokenizer, chinese_documents) -> torch.Tensor:
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(small_tokenizer)
    ids = [t for doc in chinese_documents[:20] for t in tok.encode(doc) + [tok.eos_id]]
    return torch.tensor(ids[: 10 * 33]).view(10, 33)


class Recorder(LoggerDestination):
    def __init__(self):
        self.losses: dict[int, float] = {}
        self.tasks: dict[int, float] = {}

    def log_metrics(self, metrics, step=None):
        if "loss/train/total" in metrics:
            self.losses[step] = float(metrics["loss/train/total"])
        if "tasks/zh-demo/acc" in metrics:
            self.tasks[step] = metrics["tasks/zh-demo/acc"]


def fit(samples, callbacks):
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
        loggers=[recorder],
        progress_bar=False,
    )
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.close()
    return weights, recorder


def test_the_task_callback_does_not_change_training(tmp_path, samples, small_tokenizer, demo_task):
    base_weights, base = fit(samples, [])
    settings = EvalTasksCallbackConfig(tasks=[demo_task], interval="4ba", shots=1)
    callback = TaskEvalCallback(settings, small_tokenizer, tmp_path / "run")
    weights, recorded = fit(samples, [callback])
    assert recorded.losses == base.losses and len(base.losses) == 10
    assert all(torch.equal(weights[k], base_weights[k]) for k in base_weights)
    assert sorted(recorded.tasks) == [4, 8, 10]  # every 4 batches and at the end
    assert callback.last_report is not None and callback.last_report.num_questions == 8


def test_a_bad_task_folder_stops_the_run_before_its_first_step(tmp_path, samples, small_tokenizer):
    (tmp_path / "bad" / "val").mkdir(parents=True)
    (tmp_path / "bad" / "val" / "x.csv").write_text("question,A,B\nq,a,b\n", encoding="utf-8")
    settings = EvalTasksCallbackConfig(tasks=[str(tmp_path / "bad")], interval="4ba")
    callback = TaskEvalCallback(settings, small_tokenizer, tmp_path / "run")
    with pytest.raises(ConfigError, match="no 'answer' column"):
        fit(samples, [callback])
