"""Log-likelihood scoring: shared-prompt rows equal one row per option and a plain reference."""

from __future__ import annotations

import pytest
import torch

from llm.errors import ConfigError
from llm.eval.harness import load_tasks, prepare, run
from llm.eval.results import QuestionResult, SubjectResult
from llm.eval.scoring import Encoded, encode_question, score
from llm.model import ModelConfig, Transformer
from tests.support.tokens import merging_pair

CFG = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=40)


@pytest.fixture(scope="module")
def model() -> Transformer:
    model = Transformer(CFG, seed=3)
    with torch.no_grad():  # norms away from 1, so a mixed-up position or mask shows in the scores
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def reference(model: Transformer, q: Encoded, max_len: int) -> list[float]:
    """Each option on its own: prompt + option, cut from the left to max_len + 1, plain causal pass."""
    out = []
    for cont in q.continuations:
        seq = (q.context + cont)[-(max_len + 1) :]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0], dim=-1)
        n = len(cont)
        picked = logprobs[-n:].gather(1, torch.tensor(cont)[:, None])
        out.append(float(picked.double().sum()))
    return out


QUESTIONS = [
    Encoded([2, 5, 6, 7], [[10], [11], [12], [13]]),  # letters: one token each
    Encoded([2, 8, 9, 10, 11, 12], [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]),  # cloze options
    Encoded([2, 30], [[40, 41], [42, 43]]),
    Encoded([2] + list(range(50, 85)), [[90, 91, 92, 93, 94, 95], [96]]),  # 36 + 6 > 41: truncated
    Encoded([2] + list(range(100, 145)), [[150], [151], [152]]),  # truncated letters: one shared row
]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_scores_equal_a_plain_forward_per_option(model, shared, batch_size):
    got = score(model, QUESTIONS, max_len=CFG.max_seq_len, batch_size=batch_size, shared=shared)
    for q, values in zip(QUESTIONS, got, strict=True):
        assert values == pytest.approx(reference(model, q, CFG.max_seq_len), abs=1e-4)


def test_shared_rows_and_option_rows_agree_on_real_tasks(model, tmp_path, small_tokenizer):
    from convert.demo.tasks import write_demo_tasks
    from shards.tokenizer import Tokenizer

    write_demo_tasks(str(tmp_path / "cloze"), questions=6)
    write_demo_tasks(str(tmp_path / "letter"), questions=6, style="letter")
    tok = Tokenizer(small_tokenizer)
    big = Transformer(
        ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=96), 1
    )
    tasks = load_tasks([str(tmp_path / "cloze"), str(tmp_path / "letter")])
    prepared = prepare(tasks, tok, 2, tok.start_id)
    shared, single = run(big, prepared, shared=True), run(big, prepared, shared=False)
    a = [q.loglikelihoods for t in shared.tasks for q in t.questions]
    b = [q.loglikelihoods for t in single.tasks for q in t.questions]
    assert len(a) == 24 and all(x == pytest.approx(y, abs=1e-4) for x, y in zip(a, b, strict=True))
    assert shared.truncated == single.truncated > 0  # 2-shot prompts pass 96 tokens: some are cut
    assert shared.metrics()["tasks/cloze/acc"] == single.metrics()["tasks/cloze/acc"]


def test_the_model_is_left_in_its_mode_and_gradients_untouched(model):
    model.train()
    score(model, QUESTIONS[:2], max_len=CFG.max_seq_len)
    assert model.training and all(p.grad is None for p in model.parameters())
    model.eval()


def test_token_split_moves_trailing_space_and_starts_with_eos(small_tokenizer):
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(small_tokenizer)
    q = encode_question(tok, "北京市 ", ["经济", "发展"], tok.start_id)
    assert q.context == [tok.eos_id] + tok.encode("北京市")
    assert q.continuations[0] == tok.encode("北京市 经济")[len(tok.encode("北京市")) :]
    assert q.moved == 0 and not q.emptied


def test_an_option_merging_with_the_prompts_last_token_is_scored_over_the_merged_tokens(small_tokenizer):
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(small_tokenizer)
    context, option = merging_pair(tok)
    other = "北京市经济"
    q = encode_question(tok, context, [option, other], tok.start_id)
    # One boundary for every option; each option's tokens are exactly its own encoding with the prompt.
    assert q.moved >= 1 and q.emptied
    for text, cont in zip([option, other], q.continuations, strict=True):
        assert q.context + cont == [tok.eos_id] + tok.encode(context + text) and cont
    assert q.context == [tok.eos_id] + tok.encode(context)[: -q.moved]


def test_an_option_longer_than_the_context_is_refused(model):
    with pytest.raises(ConfigError, match="longer than the model's context of 40"):
        score(model, [Encoded([2], [list(range(45))])], max_len=CFG.max_seq_len)


def test_accuracy_and_length_normalised_accuracy():
    # Option 1 has the higher total, option 0 the higher per-character log-likelihood.
    q = QuestionResult(answer=0, loglikelihoods=[-10.0, -9.0], lengths=[10, 2])
    assert (q.pred, q.pred_norm) == (1, 0)
    subject = SubjectResult("s", [q, QuestionResult(1, [-1.0, -1.0], [1, 1])])  # a tie goes to option 0
    assert subject.acc == 0.0 and subject.acc_norm == 0.5
