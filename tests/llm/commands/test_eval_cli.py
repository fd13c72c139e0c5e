"""`llm eval`: our checkpoints (local, S3) and HF exports; a table, a JSON file, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llm.commands import main as llm_main
from llm.model import ModelConfig, Transformer
from tests.support.tokens import merging_pair

CFG = ModelConfig(vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=128, tie_embeddings=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, small_tokenizer):
    from convert.demo.tasks import write_demo_tasks
    from llm.weights.composer_layout import save_composer_weights
    from llm.weights.hf_export import export_hf

    root = tmp_path_factory.mktemp("cli")
    model = Transformer(CFG, seed=2)
    ckpt = save_composer_weights(dict(model.state_dict()), CFG, root / "w.pt")
    hf = export_hf(model, root / "hf", small_tokenizer)
    write_demo_tasks(str(root / "zh-demo"), questions=5)
    return root, ckpt, hf


def test_an_export_and_its_checkpoint_score_alike_and_write_json(setup, small_tokenizer, capsys):
    root, ckpt, hf = setup
    task = str(root / "zh-demo")
    assert llm_main(["eval", str(hf), "--tasks", task, "--shots", "1", "--out", str(root / "hf.json")]) == 0
    table = capsys.readouterr().out
    assert (
        "zh-demo (val, cloze, 1-shot, protocol cloze)" in table
        and "news_next_sentence" in table
        and "questions/s" in table
    )
    args = ["eval", str(ckpt), "--tokenizer", small_tokenizer, "--tasks", task, "--shots", "1"]
    assert llm_main([*args, "--no-shared-prompt", "--out", str(root / "ckpt.json")]) == 0
    ours, exported = (json.loads((root / n).read_text()) for n in ("ckpt.json", "hf.json"))
    a, b = ours["tasks"]["zh-demo"], exported["tasks"]["zh-demo"]
    assert ours["questions"] == 10 and ours["shared_prompt"] is False and exported["shared_prompt"] is True
    assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    for subject in a["subjects"]:
        for qa, qb in zip(a["subjects"][subject]["details"], b["subjects"][subject]["details"], strict=True):
            assert qa["loglikelihoods"] == pytest.approx(qb["loglikelihoods"], abs=1e-4)


@pytest.mark.s3
def test_a_checkpoint_and_a_task_on_s3(setup, small_tokenizer, s3_bucket, capsys):
    from convert.demo.tasks import write_demo_tasks
    from storage import open_store

    root, ckpt, _ = setup
    store = open_store(f"s3://{s3_bucket}/run")
    store.upload(ckpt, "ckpt/ep0-ba10-rank0.pt")
    write_demo_tasks(f"s3://{s3_bucket}/run/zh-demo", questions=3)
    out = f"s3://{s3_bucket}/run/results.json"
    args = ["eval", f"s3://{s3_bucket}/run/ckpt/ep0-ba10-rank0.pt", "--tokenizer", small_tokenizer]
    assert llm_main([*args, "--tasks", f"s3://{s3_bucket}/run/zh-demo", "--out", out]) == 0
    results = store.read_json("results.json")
    assert results["questions"] == 6 and set(results["tasks"]["zh-demo"]["subjects"]) == {
        "news_next_sentence",
        "review_sentiment",
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "NOWHERE"], "task folder NOWHERE does not exist"),
        (["--tasks", "TASK", "--shots", "6"], "6 shots asked but it has 5 dev examples"),
        (["--tasks", "TASK", "--tokenizer", "missing.model"], "tokenizer missing.model does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(setup, extra, message, capsys):
    root, _, hf = setup
    extra = [str(root / "zh-demo") if a == "TASK" else a for a in extra]
    assert llm_main(["eval", str(hf), *extra, "--out", str(root / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_checkpoint_without_a_tokenizer_is_refused(setup, capsys):
    root, ckpt, _ = setup
    assert llm_main(["eval", str(ckpt), "--tasks", str(root / "zh-demo")]) == 2
    assert (
        "ships no tokenizer (tokenizer.json or tokenizer.model): pass --tokenizer" in capsys.readouterr().err
    )


def test_a_prompt_longer_than_the_context_is_cut_and_counted(setup, small_tokenizer, capsys, tmp_path):
    from llm.weights.hf_export import export_hf

    root, _, _ = setup
    short = export_hf(Transformer(ModelConfig(**{**CFG.__dict__, "max_seq_len": 48}), seed=2), tmp_path / "s")
    args = [
        "eval",
        str(short),
        "--tokenizer",
        small_tokenizer,
        "--tasks",
        str(root / "zh-demo"),
        "--shots",
        "2",
    ]
    assert llm_main([*args, "--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    truncated = json.loads((tmp_path / "r.json").read_text())["truncated"]
    assert (
        truncated > 0
        and f"warning: {truncated} of 10 prompts were longer than the model's context of 48" in out
    )
    assert torch.isfinite(
        torch.tensor(json.loads((tmp_path / "r.json").read_text())["tasks"]["zh-demo"]["acc"])
    )


def test_a_question_whose_option_merges_with_the_prompt_is_scored_counted_and_matched(
    setup, small_tokenizer, capsys, tmp_path
):
    """Before: exit 2 naming the first such option. Now: scored over the merged tokens, counted, and
    every question carries its id (and, with --prompts, the prompt) for matching with other tools."""
    from shards.tokenizer import Tokenizer

    root, ckpt, _ = setup
    tok = Tokenizer(small_tokenizer)
    context, option = merging_pair(tok)
    task = tmp_path / "merge"
    (task / "val").mkdir(parents=True)
    (task / "task.json").write_text(json.dumps({"style": "cloze"}))
    rows = ["id,question,A,B,answer", f"q1,{context},{option},北京市经济,A", "q2,今天天气,很好,不好,A"]
    (task / "val" / "s.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "r.json"
    args = ["eval", str(ckpt), "--tokenizer", small_tokenizer, "--tasks", str(task), "--prompts"]
    assert llm_main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note: in 1 of 2 questions an option tokenizes together with the prompt's last token" in printed
    assert "(1 of them would have no token of their own)" in printed
    result = json.loads(out.read_text())
    assert result["merged"] == 1 and result["tasks"]["merge"]["protocol"] == "cloze"
    details = result["tasks"]["merge"]["subjects"]["s"]["details"]
    assert [d["id"] for d in details] == ["q1", "q2"] and [d["merged"] > 0 for d in details] == [True, False]
    assert details[0]["prompt"] == context and details[0]["continuations"] == [option, "北京市经济"]
    # The merged option's score is log p(its whole encoding's tail | the shared head), as a plain pass gives.
    model = Transformer(CFG, seed=2).eval()
    whole = [tok.eos_id] + tok.encode(context + option)
    head = len(whole) - len(tok.encode(context + option)) + len(tok.encode(context)) - details[0]["merged"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].double(), dim=-1)
    expected = sum(float(logprobs[i - 1, whole[i]]) for i in range(head, len(whole)))
    assert details[0]["loglikelihoods"][0] == pytest.approx(expected, abs=1e-4)
    assert all(ll < 0 for ll in details[0]["loglikelihoods"])  # never lm-eval's free 0.0


def test_without_out_the_results_go_under_runs_never_into_the_working_folder(
    setup, small_tokenizer, tmp_path, monkeypatch, capsys
):
    """`llm eval` once wrote eval_results.json into the working folder (the repository's root)."""
    root, ckpt, hf = setup
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf, tmp_path / "runs" / "demo" / "export")
    tasks = ["--tasks", str(root / "zh-demo"), "--max-questions", "1"]
    assert llm_main(["eval", "runs/demo/export", *tasks]) == 0  # in a run folder: beside the run
    assert "results: runs/demo/eval_results.json" in capsys.readouterr().out
    assert llm_main(["eval", str(ckpt), "--tokenizer", small_tokenizer, *tasks]) == 0  # elsewhere
    assert "results: runs/eval/w.json" in capsys.readouterr().out
    written = sorted(
        str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json") if "export" not in p.parts
    )
    assert written == ["runs/demo/eval_results.json", "runs/eval/w.json"]
    assert json.loads((tmp_path / "runs/eval/w.json").read_text())["checkpoint"] == str(ckpt)
