"""The chunked loss head (`model.loss_chunk`, llm/loss.py) against the plain one: the same loss and
gradients in fp32 (IGNORE_INDEX targets, z-loss, max-z loss, tied and untied), the same eval
metrics, never every token's logits alive; in real runs the guard reads the same losses. Under
FSDP2: tests/llm/test_levers_fsdp.py; resuming: tests/e2e/test_preemption.py (variant chunked)."""

from __future__ import annotations

import pytest
import torch

from llm.composer_model import LanguageModel
from llm.model import ModelConfig

VOCAB = 97
BATCH = (3, 17)  # 3 x 16 = 48 targets


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied)


def _batch(masked: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    batch = {"input_ids": torch.randint(0, VOCAB, BATCH, generator=generator)}
    if masked:  # SFT's mask: a third of the targets are IGNORE_INDEX, one row has none scored
        mask = torch.rand(BATCH, generator=generator) > 0.33
        mask[1] = False
        batch["loss_mask"] = mask
    return batch


def _step(chunk: int, tied: bool, batch, z: float, max_z: float):
    model = LanguageModel.from_config(_cfg(tied), seed=3, z_loss=z, max_z_loss=max_z, loss_chunk=chunk)
    loss = model.loss(model(batch), batch)
    terms = loss if isinstance(loss, dict) else {"total": loss}
    terms["total"].backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {k: v.item() for k, v in terms.items()}, grads


PENALTIES = [(0.0, 0.0), (1e-2, 0.0), (0.0, 2e-2), (1e-2, 2e-2)]


@pytest.mark.parametrize("chunk", [7, 1000], ids=["ragged chunks", "one chunk"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("masked", [False, True], ids=["all targets", "IGNORE_INDEX rows"])
@pytest.mark.parametrize("z, max_z", PENALTIES, ids=["ce", "z-loss", "max-z", "both"])
def test_loss_and_every_gradient_equal_the_plain_path_in_fp32(chunk, tied, masked, z, max_z):
    batch = _batch(masked)
    plain, plain_grads = _step(0, tied, batch, z, max_z)
    chunked, chunked_grads = _step(chunk, tied, batch, z, max_z)
    assert chunked.keys() == plain.keys()  # the same terms logged
    for key, value in plain.items():
        assert chunked[key] == pytest.approx(value, rel=1e-5), key
    assert chunked_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert ((chunked_grads[name] - grad).abs().max() / scale).item() < 1e-5, name
    assert all(grad.abs().sum() > 0 for name, grad in plain_grads.items() if "output" in name)


@pytest.mark.parametrize("masked", [False, True], ids=["all targets", "IGNORE_INDEX rows"])
def test_eval_metrics_equal_the_plain_paths(masked):
    batch = _batch(masked)
    values = []
    for chunk in (0, 7):
        model = LanguageModel.from_config(_cfg(False), seed=3, loss_chunk=chunk).eval()
        metrics = model.get_metrics()
        with torch.no_grad():
            outputs = model(batch)
            for metric in metrics.values():
                model.update_metric(batch, outputs, metric)
        values.append({name: metric.compute().item() for name, metric in metrics.items()})
    plain, chunked = values
    assert chunked.keys() == {"LanguageCrossEntropy", "LanguagePerplexity"}
    for name, value in plain.items():
        assert chunked[name] == pytest.approx(value, rel=1e-5), name


def test_autograd_keeps_no_tensor_of_every_tokens_logits():
    """The plain path keeps [tokens, vocab] logits for backward; the chunked one nothing larger than
    a parameter (the output weight), its backward recomputing each chunk's logits."""
    batch = _batch(False)
    cfg = ModelConfig(vocab_size=1000, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    tokens = BATCH[0] * (BATCH[1] - 1)
    biggest = {}
    for chunk in (0, 8):
        model = LanguageModel.from_config(cfg, seed=3, loss_chunk=chunk)
        saved: list[int] = []

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss(model(batch), batch)
        loss.backward()
        biggest[chunk] = max(saved)
    largest_parameter = cfg.vocab_size * cfg.dim
    assert biggest[0] >= tokens * cfg.vocab_size > largest_parameter
    assert biggest[8] <= largest_parameter


def test_a_bad_chunk_is_refused():
    from llm.loss import chunked_loss_terms

    with pytest.raises(ValueError, match="chunk must be a positive number of tokens"):
        chunked_loss_terms(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), 0)


@pytest.mark.slow  # two training runs (the resume harness's references, shared with test_preemption)
def test_the_guard_reads_the_same_losses_from_either_head(reference_plain, reference_chunked):
    """12 steps with the guard on: the loss of every step (what the guard reads) within 1e-5."""
    plain, chunked = reference_plain.batches(), reference_chunked.batches()
    assert [b["batch"] for b in chunked] == [b["batch"] for b in plain] == list(range(1, 13))
    assert [b["ids"] for b in chunked] == [b["ids"] for b in plain]
    for a, b in zip(chunked, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["batch"]
