"""`model.z_loss` and `model.max_z_loss`: value and gradient against the plain formulas, in fp32,
over all targets and over an SFT batch's answer tokens; logged as their own metrics in a real run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm.composer_model import IGNORE_INDEX, LanguageModel, penalised_loss
from llm.model import ModelConfig
from tests.support.training import load, read_metrics, write_recipe

CFG = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
Z, MAX_Z = 1e-4, 2e-4  # PaLM's and Baichuan 2's weights


def reference(logits: torch.Tensor, targets: torch.Tensor, z: float, max_z: float) -> torch.Tensor:
    """The formulas as the papers write them, in float64: cross-entropy + z * log(Z)^2 +
    max_z * max(logits)^2, each averaged over the scored targets."""
    logits = logits.double()
    scored = targets != IGNORE_INDEX
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    log_z = torch.log(torch.exp(logits).sum(dim=-1))[scored]
    biggest = logits.max(dim=-1).values[scored]
    return ce + z * (log_z**2).mean() + max_z * (biggest**2).mean()


def _logits(n: int = 24, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, CFG.vocab_size, generator=generator) * 8 + 3).requires_grad_(True)


@pytest.mark.parametrize("masked", [False, True], ids=["all targets", "answer tokens only"])
def test_value_and_gradient_match_the_reference_formulas(masked):
    logits = _logits()
    targets = torch.randint(0, CFG.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    if masked:
        targets[::3] = IGNORE_INDEX
    ours = penalised_loss(logits, targets, Z, MAX_Z)
    assert set(ours) == {"total", "cross_entropy", "z_loss", "max_z_loss"}
    (grad,) = torch.autograd.grad(ours["total"], logits)
    theirs = reference(logits, targets, Z, MAX_Z)
    (want,) = torch.autograd.grad(theirs, logits)
    assert ours["total"].item() == pytest.approx(theirs.item(), rel=1e-6)
    assert torch.allclose(grad, want, rtol=1e-5, atol=1e-8)
    # Each term on its own: the logged metrics are what the formulas give.
    assert ours["z_loss"].item() == pytest.approx(
        reference(logits, targets, Z, 0).item() - reference(logits, targets, 0, 0).item(), rel=1e-5
    )
    assert ours["max_z_loss"].item() == pytest.approx(
        reference(logits, targets, 0, MAX_Z).item() - reference(logits, targets, 0, 0).item(), rel=1e-5
    )
    assert ours["cross_entropy"].item() == pytest.approx(reference(logits, targets, 0, 0).item(), rel=1e-6)
    # The penalties push the log-normaliser and the largest logit towards 0.
    assert grad.sum(dim=-1).abs().max() > 0


def test_low_precision_logits_are_penalised_in_fp32():
    logits = _logits().detach().to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, CFG.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    ours = penalised_loss(logits, targets, Z, MAX_Z)
    assert all(v.dtype == torch.float32 for v in ours.values())
    assert ours["total"].item() == pytest.approx(
        reference(logits.float(), targets, Z, MAX_Z).item(), rel=1e-6
    )


def test_the_model_loss_is_the_plain_cross_entropy_tensor_when_both_are_off():
    model = LanguageModel.from_config(CFG, seed=3)
    batch = {
        "input_ids": torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    }
    outputs = model(batch)
    plain = model.loss(outputs, batch)
    assert isinstance(plain, torch.Tensor)
    model.z_loss, model.max_z_loss = Z, MAX_Z
    penalised = model.loss(outputs, batch)
    assert penalised["cross_entropy"].item() == pytest.approx(plain.item(), rel=1e-6)
    assert penalised["total"].item() > plain.item()


def test_a_run_logs_each_penalty_as_its_own_metric_and_backpropagates_their_sum(tmp_path, train_data):
    from llm.trainer import train

    recipe = write_recipe(
        tmp_path / "r.yaml",
        train_data,
        training={
            "global_batch_size": 8,
            "device_microbatch_size": 4,
            "max_duration": "2ba",
            "log_interval": 1,
        },
        scheduler={"warmup": "1ba"},
    )
    train(load(recipe, f"model.z_loss={Z}", f"model.max_z_loss={MAX_Z}"))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["z_loss"] > 0 and row["max_z_loss"] > 0
        assert row["loss"] == pytest.approx(
            row["cross_entropy"] + row["z_loss"] + row["max_z_loss"], rel=1e-5
        )
    # At initialisation log(Z) is about log(vocab): the z-loss is near Z * log(vocab)^2.
    assert rows[0]["z_loss"] == pytest.approx(
        Z * torch.log(torch.tensor(float(train_data.vocab_size))).item() ** 2, rel=0.2
    )
