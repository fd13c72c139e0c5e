"""Our multiple-choice scores agree with lm-evaluation-harness's on the same exported model and task.

lm-eval scores the `llm export` folder through its Hugging Face backend on YAML tasks written by
`scenarios/lm_eval_compare.py` (the same CSVs and prompts); `llm.eval` scores the same folder with
shared-prompt rows. Cloze and letter (C-Eval) styles, 0 and 2 shots (2-shot prompts pass the
model's 128-token context, so left truncation is compared too). Offline: everything is local.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.export import perturbed_export

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (pip install -e '.[dev]' installs it; or pip install 'lm-eval[hf]')",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, small_tokenizer):
    """A small model with perturbed norms, in the HF layout, and the demo task in both styles."""
    from convert.demo.tasks import write_demo_tasks

    root = tmp_path_factory.mktemp("agree")
    hf = perturbed_export(root / "hf", small_tokenizer, max_seq_len=128, seed=7)
    for style in ("cloze", "letter"):
        write_demo_tasks(str(root / style), style=style, questions=8)
    return str(hf), [str(root / "cloze"), str(root / "letter")]


@pytest.mark.parametrize("shots", [0, 2])
def test_per_question_log_likelihoods_and_answers_agree_with_lm_eval(exported, shots, capsys):
    from scenarios.lm_eval_compare import compare

    hf, tasks = exported
    found = compare(hf, tasks, shots=shots, limit=8, batch_size=4)
    with capsys.disabled():
        print(
            f"\nlm-eval agreement, {shots}-shot: {found.questions} questions, max |ll diff| "
            f"{found.max_abs_diff:.2e}, same answer on {found.same_choices}"
        )
    assert found.questions == 32
    assert found.max_abs_diff < 5e-5
    assert found.same_choices == found.questions
    assert found.ours.keys() == found.theirs.keys()
    for key in found.ours:  # acc and acc_norm per subject
        assert found.ours[key] == pytest.approx(found.theirs[key], abs=1e-9), key


def test_lm_eval_scores_a_fully_merged_option_0_beside_a_one_token_option_and_stops_without_one(
    exported, small_tokenizer, monkeypatch
):
    """What docs/eval.md says lm-eval 0.4.13's hf backend does with an option that merges entirely
    into the prompt's last token (the README said it always stops; issue 36 saw it score 0.0): it
    splits by the context's own token count, so the option gets no tokens; when another option of
    the question is one token, it takes that option's cached logits and scores 0.0 (so it wins);
    otherwise it fails `assert len(continuation_enc) > 0` and the run stops."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from shards.tokenizer import Tokenizer
    from tests.support.tokens import merging_pair

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = HFLM(pretrained=exported[0], device="cpu", batch_size=4, dtype="float32")
    tok = Tokenizer(small_tokenizer)
    context, merged = merging_pair(tok)
    assert lm._encode_pair(context, merged)[1] == []  # no token of its own under lm-eval's split
    own_tokens = {
        text: len(lm._encode_pair(context, text)[1])
        for text in ("北京市经济发展", *map(tok.piece, range(300)))
    }
    one = next(text for text, n in own_tokens.items() if n == 1 and "▁" not in text)
    several = next(text for text, n in own_tokens.items() if n >= 3)

    def loglikelihoods(options: list[str]) -> list[float]:
        requests = [Instance("loglikelihood", {}, (context, o), i) for i, o in enumerate(options)]
        return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]

    scored = loglikelihoods([merged, one, several])
    assert scored[0] == 0.0 and max(scored[1:]) < 0.0  # the empty option wins
    with pytest.raises(AssertionError):
        loglikelihoods([merged, several])
