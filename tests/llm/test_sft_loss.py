"""The SFT loss: a mean over answer tokens only, computed per example even when examples are packed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from composer.metrics import LanguageCrossEntropy

from llm.composer_model import LanguageModel, segment_documents
from llm.model import ModelConfig, document_mask, document_positions

CFG = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
BOS, EOS, PAD = 1, 2, 0

# (prompt-part ids incl. the template's <bos>, answer-part ids incl. <eos>); token 0 is a real
# answer token in the second example (baby-llama2-chinese's ignore_index=0 dropped such tokens).
EXAMPLES = [
    ([7, 8, 9, BOS], [11, 12, EOS]),
    ([13, 14, BOS], [0, 15, 0, EOS]),
    ([16, 17, 18, 19, 20, BOS], [21, EOS]),
]


def row(examples, length=16):
    """One sample: the examples side by side, then padding; tokens, loss_mask, segments."""
    tokens, mask, segments = [], [], []
    for i, (prompt, answer) in enumerate(examples, start=1):
        tokens += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
        segments += [i] * (len(prompt) + len(answer))
    pad = length - len(tokens)
    return tokens + [PAD] * pad, mask + [0] * pad, segments + [0] * pad


def batch_of(rows) -> dict[str, torch.Tensor]:
    tokens, mask, segments = zip(*rows, strict=True)
    return {
        "input_ids": torch.tensor(tokens),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
        "segments": torch.tensor(segments, dtype=torch.int32),
    }


@pytest.fixture(scope="module")
def model() -> LanguageModel:
    return LanguageModel.from_config(CFG, seed=3)


def test_the_loss_is_the_mean_over_answer_targets_and_prompts_get_no_gradient(model):
    batch = batch_of([row([e]) for e in EXAMPLES])  # 3 rows, one example each
    outputs = model(batch).detach().requires_grad_(True)
    loss = model.loss(outputs, batch)

    # By hand: every position j >= 1 whose token is an answer token (mask 1) is a target of
    # position j - 1; nothing else (prompt tokens, the template's <bos>, padding) is.
    log_probs = F.log_softmax(outputs.detach(), dim=-1)
    terms = [
        -log_probs[r, j - 1, batch["input_ids"][r, j]]
        for r in range(3)
        for j in range(1, 16)
        if batch["loss_mask"][r, j]
    ]
    assert len(terms) == sum(len(a) for _, a in EXAMPLES) == 9  # the id-0 answer tokens count
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)

    loss.backward()
    scored = batch["loss_mask"][:, 1:]
    grad = outputs.grad.abs().sum(-1)  # [B, T]: position t predicts token t + 1
    assert (grad[~scored] == 0).all()  # prompt positions, the last answer token (EOS -> pad), padding
    assert (grad[scored] > 0).all()
    eos_positions = [(r, len(p) + len(a) - 1) for r, (p, a) in enumerate(EXAMPLES)]
    assert all(grad[r, t] == 0 for r, t in eos_positions)  # no EOS -> padding target


def test_baby_llama2s_ignore_index_0_would_drop_real_tokens(model):
    """The same batch scored baby-llama2-chinese's way (ignore_index=0 over every target) differs."""
    batch = batch_of([row([e]) for e in EXAMPLES])
    outputs = model(batch).detach()
    targets = batch["input_ids"][:, 1:]
    theirs = F.cross_entropy(outputs.reshape(-1, CFG.vocab_size), targets.reshape(-1), ignore_index=0)
    assert model.loss(outputs, batch).item() != pytest.approx(theirs.item(), rel=1e-3)


def test_a_packed_sample_scores_each_example_exactly_as_alone(model):
    alone = batch_of([row([e]) for e in EXAMPLES])
    packed = batch_of([row(EXAMPLES[:2]), row(EXAMPLES[2:])])  # two examples share the first row
    assert packed["segments"][0].max() == 2
    with torch.no_grad():
        loss_alone = model.loss(model(alone), alone)
        out = model(packed)
        loss_packed = model.loss(out, packed)
        # The second example's logits inside the packed row equal its logits when alone.
        start, length = len(sum(EXAMPLES[0], [])), len(sum(EXAMPLES[1], []))
        inside = out[0, start : start + length - 1]
        assert torch.allclose(inside, model(alone)[1, : length - 1], atol=1e-5)
    assert loss_packed.item() == pytest.approx(loss_alone.item(), abs=1e-5)


def test_packed_examples_see_only_their_own_example_and_restart_positions():
    documents = segment_documents(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2]]  # the padding is one more document
    mask, positions = document_mask(documents, "sdpa")[:, 0], document_positions(documents)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask[0].int().tolist() == expected


def test_eval_cross_entropy_counts_the_same_tokens_as_the_loss(model):
    batch = batch_of([row(EXAMPLES[:2]), row(EXAMPLES[2:])])
    metric = LanguageCrossEntropy()
    with torch.no_grad():
        outputs = model(batch)
        model.update_metric(batch, outputs, metric)
        loss = model.loss(outputs, batch)
    assert int(metric.total_items) == 9
    assert metric.compute().item() == pytest.approx(loss.item(), rel=1e-6)
    assert math.isfinite(loss.item())


def test_pretraining_batches_are_scored_on_every_token_as_before(model):
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    batch = {"input_ids": tokens}
    with torch.no_grad():
        outputs = model(batch)
        expected = F.cross_entropy(outputs.reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
        assert model.loss(outputs, batch).item() == pytest.approx(expected.item(), rel=1e-6)


def _conversation_losses(
    model: LanguageModel, batch: dict[str, torch.Tensor]
) -> dict[tuple[int, int], torch.Tensor]:
    """(row, segment) -> the mean loss over that conversation's answer tokens."""
    logits = model(batch)
    losses = F.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    scored, segments = batch["loss_mask"][:, 1:], batch["segments"][:, 1:]
    return {
        (r, int(s)): losses[r][scored[r] & (segments[r] == s)].mean()
        for r in range(losses.shape[0])
        for s in segments[r].unique().tolist()
        if s > 0
    }


def test_each_conversation_of_a_packed_sample_trains_as_if_alone():
    """All three conversations in one row: each one's loss and the gradients of that loss equal
    those of the conversation alone in its row."""
    alone = batch_of([row([e], length=24) for e in EXAMPLES])
    packed = batch_of([row(EXAMPLES, length=24)])
    assert packed["segments"][0].max() == 3
    for i in range(3):
        models = [LanguageModel.from_config(CFG, seed=3) for _ in range(2)]
        got = _conversation_losses(models[0], packed)[0, i + 1]
        want = _conversation_losses(models[1], alone)[i, 1]
        assert got.item() == pytest.approx(want.item(), abs=1e-5), i
        got.backward()
        want.backward()
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5), (i, name)
