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


def _documented(program: str) -> list[str]:
    """The command of docs/eval.md's agreement section that runs `program` (on the demo's task)."""
    from tests.support import docs
    from tests.support.paths import REPO

    page = REPO / "docs" / "eval.md"
    found = [
        args
        for snippet in docs.snippets(page)
        if snippet.fenced
        for args in docs.commands(snippet)
        if args[: len(program.split())] == program.split() and any("runs/demo/export" in a for a in args)
    ]
    assert found, f"no `{program} ... runs/demo/export` command in docs/eval.md"
    return found[-1]


def test_the_shipped_demo_task_configs_run_offline_in_lm_eval_to_llm_eval_s_numbers(
    exported, tmp_path, monkeypatch, capsys
):
    """The README showed `lm_eval --model hf --model_args pretrained=runs/demo/export`, which stops
    with "No tasks specified" (issue 39). docs/eval.md's commands, run as written from a folder
    laid out as the repository after `make demo` (the demo task smaller, the export the small model
    of this module): lm_eval on recipes/lm-eval's configs gives llm eval's acc and acc_norm."""
    import json
    import shutil
    import sys

    from lm_eval.__main__ import cli_evaluate

    from convert.demo.tasks import write_demo_tasks
    from llm.commands import main as llm_main
    from scenarios.lm_eval_compare import DEMO_TASK, demo_task_files
    from tests.support.paths import REPO

    monkeypatch.chdir(tmp_path)
    write_demo_tasks(DEMO_TASK, questions=8)
    shutil.copytree(exported[0], "runs/demo/export")
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    # The shipped files are what the generator writes for the demo's task: they cannot drift.
    shipped = {p.name: p.read_text(encoding="utf-8") for p in (REPO / "recipes" / "lm-eval").iterdir()}
    assert shipped == demo_task_files()

    ours = _documented("llm eval")
    assert llm_main(ours[1:]) == 0
    scored = json.loads((tmp_path / ours[ours.index("--out") + 1]).read_text())["tasks"]["zh-demo"]

    theirs = _documented("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # as the command sets them
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", theirs)
    cli_evaluate()
    (results,) = (tmp_path / theirs[theirs.index("--output_path") + 1]).rglob("results_*.json")
    found = json.loads(results.read_text())["results"]
    for subject, figures in scored["subjects"].items():
        assert figures["questions"] == 8
        lm = found[f"zh_demo_{subject}"]
        assert (lm["acc,none"], lm["acc_norm,none"]) == pytest.approx(
            (figures["acc"], figures["acc_norm"])
        ), subject
    group = found["zh_demo"]
    assert (group["acc,none"], group["acc_norm,none"]) == pytest.approx((scored["acc"], scored["acc_norm"]))
    capsys.readouterr()


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
