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
