"""Real, short Composer runs on the CPU over real shards of Chinese text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from composer.core import Callback

from llm.errors import ConfigError
from tests.support.config import lr_at
from tests.support.training import load, read_metrics, train_py, write_recipe


def test_loss_falls_and_run_files_are_written(tmp_path, train_data, capsys):
    from llm.trainer import train

    cfg = load(write_recipe(tmp_path / "r.yaml", train_data))
    result = train(cfg)
    out = capsys.readouterr().out

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [4, 8, 12, 16, 20, 24]
    assert records[0]["loss"] - records[-1]["loss"] > 0.5, records
    assert all(r["tokens"] == r["step"] * 8 * train_data.seq_len for r in records)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [12, 24]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[1]["eval_perplexity"] == pytest.approx(math.exp(evals[1]["eval_loss"]), rel=1e-3)
    assert records[-1]["tokens_per_sec"] > 0
    # Composer steps its schedulers before advancing the batch counter, so the rate logged at
    # step s is the schedule's value at s - 1: warmup over 4 steps, then cosine to 1e-4 at 24.
    for r in records:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, 3e-3, 1e-4, 4, 24), rel=1e-6)

    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"vocab_size: {train_data.vocab_size}" in saved and "lr: 0.003" in saved
    assert str(tmp_path / "run" / "loss.png") in out
    # One line names the saved config; the dump of every key is behind --print-config (issue 39).
    config_lines = [line for line in out.splitlines() if "config" in line]
    assert (
        f"[config] run 'test': the resolved recipe is in {tmp_path / 'run' / 'config.yaml'}" in config_lines
    )
    assert "resolved config" not in out and "vocab_size" not in out
    assert result.step == 24 and result.eval_loss == pytest.approx(evals[1]["eval_loss"])


def test_print_config_prints_the_resolved_recipe_in_full(tmp_path, train_data, capsys):
    import train as train_script
    from llm.config import to_yaml
    from llm.trainer import announce

    cfg = load(write_recipe(tmp_path / "r.yaml", train_data))
    assert train_script.parse_args([str(tmp_path / "r.yaml"), "--print-config"]).print_config
    assert not train_script.parse_args([str(tmp_path / "r.yaml")]).print_config
    announce(cfg, tmp_path / "run", print_config=True)
    out = capsys.readouterr().out
    assert to_yaml(cfg) in out and "[config] run 'test'" in out
    assert (tmp_path / "run" / "config.yaml").read_text() == to_yaml(cfg)


class GradRecorder(Callback):
    """Keeps the gradients Composer hands the optimizer (AFTER_TRAIN_BATCH runs before the step)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def after_train_batch(self, state, logger):
        self.grads = {n: p.grad.detach().clone() for n, p in state.model.named_parameters()}


def _one_step(tmp_path: Path, train_data, microbatch: int):
    from llm.trainer import build_trainer

    recipe = write_recipe(tmp_path / f"mb{microbatch}" / "r.yaml", train_data)
    cfg = load(
        recipe,
        f"training.device_microbatch_size={microbatch}",
        "training.max_duration=1ba",
        "training.grad_clip_norm=0",
        # Adam's first step is lr * g / (|g| + eps): with the default eps, the few entries whose
        # |g| is near 1e-8 turn float noise into visible weight differences.
        "optimizer.eps=1e-5",
        "scheduler.warmup=0ba",
        "data.eval=[]",
    )
    recorder = GradRecorder()
    trainer = build_trainer(cfg, extra_callbacks=[recorder])
    trainer.fit()
    weights = {n: p.detach().clone() for n, p in trainer.state.model.named_parameters()}
    loss = trainer.state.total_loss_dict["loss/train/total"]
    trainer.close()
    return recorder.grads, weights, loss


def test_gradient_accumulation_matches_one_full_batch(tmp_path, train_data):
    grads_full, weights_full, loss_full = _one_step(tmp_path, train_data, microbatch=8)
    grads_acc, weights_acc, loss_acc = _one_step(tmp_path, train_data, microbatch=4)
    assert loss_acc == pytest.approx(loss_full, rel=1e-5)
    for name, grad in grads_full.items():
        torch.testing.assert_close(
            grads_acc[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    for name, weight in weights_full.items():
        torch.testing.assert_close(
            weights_acc[name], weight, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_a_micro_batch_of_0_is_resolved_from_the_plan_before_the_loaders_and_composer(
    tmp_path, train_data, capsys
):
    from llm.trainer import build_trainer

    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    cfg = load(
        recipe,
        "training.device_microbatch_size=0",
        "training.max_duration=1ba",
        "scheduler.warmup=0ba",
        "data.eval=[]",
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    per_rank = cfg.training.global_batch_size  # one rank; on the CPU the plan's 80 GB fit it whole
    assert trainer.state.device_train_microbatch_size == per_rank
    assert trainer.state.timestamp.batch.value == 1
    trainer.close()
    out = capsys.readouterr().out
    assert (
        f"[micro-batch] from the plan: {per_rank} of {per_rank} samples per GPU (the least recomputation"
        in out
    )
    saved = load(tmp_path / "run" / "config.yaml")  # the run's recipe keeps the value it ran with
    assert saved.training.device_microbatch_size == per_rank
    assert cfg.training.device_microbatch_size == 0  # the caller's recipe is left as it was


@pytest.mark.parametrize("loss_chunk", [0, 512], ids=["plain", "chunked"])
def test_a_step_computes_the_cross_entropy_once_per_micro_batch(
    tmp_path, train_data, monkeypatch, loss_chunk
):
    """The train loss is the only cross-entropy: no train metric recomputes it over the logits
    (the plain head: F.cross_entropy; the chunked one: llm.loss's, once per micro-batch)."""
    import torch.nn.functional as F

    import llm.composer_model
    from llm.trainer import build_trainer

    calls = []
    owner, name = (F, "cross_entropy") if loss_chunk == 0 else (llm.composer_model, "chunked_loss_terms")
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    cfg = load(
        recipe,
        "training.device_microbatch_size=4",
        "training.max_duration=2ba",
        "scheduler.warmup=0ba",
        "data.eval=[]",
        f"model.loss_chunk={loss_chunk}",
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    loss = trainer.state.total_loss_dict["loss/train/total"]
    trainer.close()
    assert len(calls) == 2 * 2, calls  # 2 steps x 2 micro-batches of 4
    assert math.isfinite(float(loss))


def test_recipe_errors_exit_2_with_one_line(tmp_path, train_data, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    assert train_py(str(recipe), "optimizer.lrr=1e-4") == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0, err
    assert "optimizer.lrr" in err and "did you mean 'lr'" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.precision=amp_bf16"], "training.precision=amp_bf16 needs a GPU"),
        (["fsdp.enabled=true", "fsdp.replicate=3"], "fsdp.replicate=3 does not divide the world size 1"),
        (["training.device=gpu"], "no CUDA GPU is visible"),
        (["checkpoint.load_path=/elsewhere/ep0-ba4-rank0.pt"], "allow_untrusted_load_path=true"),
        (["scheduler.warmup=24ba"], "shorten the warmup"),
    ],
)
def test_settings_the_cpu_cannot_run_are_refused(tmp_path, train_data, overrides, message):
    from llm.trainer import build_trainer

    cfg = load(write_recipe(tmp_path / "r.yaml", train_data), *overrides)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build_trainer(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.float8.enabled=true"], "training.float8"),  # was refused after 28 s, the run folder made
        (
            ["training.profile.enabled=true", "training.profile.ranks=[0, 5]"],
            "training.profile.ranks=[0, 5]: rank 5 does not exist in a world of 1 rank(s)",
        ),
        (["model.attention=documents"], "model.attention='documents' is not one of causal, document"),
    ],
)
def test_what_this_machine_or_world_cannot_run_is_one_line_before_the_run_folder_exists(
    tmp_path, train_data, capsys, overrides, message
):
    recipe = write_recipe(tmp_path / "r.yaml", train_data, checkpoint={"save_folder": str(tmp_path / "ck")})
    assert train_py(str(recipe), *overrides) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()


def test_batch_that_does_not_divide_over_ranks_is_refused(tmp_path, train_data):
    cfg = load(write_recipe(tmp_path / "r.yaml", train_data), "training.device_microbatch_size=4")
    assert cfg.check_world_size(2) == 4
    with pytest.raises(ConfigError, match="not divisible by world size 4"):
        cfg.check_world_size(4)


class GroupRates(Callback):
    """Each optimizer group's rate after every step."""

    def __init__(self):
        self.rates: list[list[float]] = []

    def batch_end(self, state, logger):
        self.rates.append([g["lr"] for g in state.optimizers[0].param_groups])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embedding_lr_gives_the_token_embeddings_their_own_rate_on_the_same_schedule(
    tmp_path, train_data, tied
):
    from llm.trainer import build_trainer

    recipe = write_recipe(tmp_path / "r.yaml", train_data)
    cfg = load(
        recipe,
        f"model.tie_embeddings={str(tied).lower()}",
        "optimizer.embedding_lr=0.05",
        "training.max_duration=6ba",
        "scheduler.warmup=2ba",
        "data.eval=[]",
    )
    recorder = GroupRates()
    trainer = build_trainer(cfg, extra_callbacks=[recorder])
    names = {id(p): n for n, p in trainer.state.model.named_parameters()}
    groups = trainer.state.optimizers[0].param_groups
    assert [names[id(p)] for p in groups[2]["params"]] == ["model.tok_embeddings.weight"]
    others = {names[id(p)] for g in groups[:2] for p in g["params"]}
    assert ("model.output.weight" in others) is not tied  # tied: the one matrix takes embedding_lr
    assert groups[2]["weight_decay"] == groups[0]["weight_decay"] == cfg.optimizer.weight_decay
    trainer.fit()
    trainer.close()
    assert len(recorder.rates) == 6
    for decay, no_decay, embedding in recorder.rates:
        assert decay == no_decay
        assert embedding == pytest.approx(decay * 0.05 / cfg.optimizer.lr, rel=1e-9)
    assert recorder.rates[1][2] > recorder.rates[-1][2] > 0  # warmed up, then decayed
