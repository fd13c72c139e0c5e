"""A Hugging Face tokenizer.json from conversion to transformers: shards converted with it, a few
training steps (its folder as the recipe's tokenizer.path, the generation callback on), the export
carrying the same tokenizer.json, and transformers' greedy generation equal to `llm generate
--temperature 0`; `llm generate`, `llm chat` and `llm eval` take the export's own tokenizer."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import yaml

from llm.commands import main as llm_main
from shards.tokenizer import HUGGINGFACE, Tokenizer
from tests.support import forkserver, paths
from tests.support.export import transformers_warnings
from tests.support.hf_tokenizer import MIXED_TEXTS, english_and_code
from tests.support.training import TrainData, load, read_metrics, recipe_dict

pytestmark = pytest.mark.slow  # a conversion process and a training run

PROMPTS = ["中国经济", "def main(", "The "]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory, chinese_documents, hf_tokenizer) -> dict:
    """Convert (the CLI, the tokenizer's folder), train 8 batches, export with the tokenizer."""
    from llm.trainer import train

    root = tmp_path_factory.mktemp("hf-train")
    corpus = root / "corpus.jsonl"
    code = [block for text in english_and_code() for block in text.split("\n\n\n") if block.strip()]
    docs = chinese_documents[:300] + code
    corpus.write_text(
        "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8"
    )
    shards = root / "shards"
    args = ["shards", str(corpus), "--format", "jsonl", "--tokenizer", str(hf_tokenizer), "--seq-len", "64",
            "--val-fraction", "0.1", "--workers", "1", "--out", str(shards), "--no-progress"]  # fmt: skip
    done = forkserver.run(
        [sys.executable, "-m", "convert", *args], cwd=paths.REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((shards / "train" / "meta.json").read_text())
    data = TrainData(
        root, hf_tokenizer, shards / "train", shards / "val", meta["vocab_size"], meta["seq_len"]
    )
    recipe = recipe_dict(data, root / "run")
    recipe["training"].update(max_duration="8ba", eval_interval="8ba")
    recipe["scheduler"]["warmup"] = "2ba"
    recipe["checkpoint"] = {"save_folder": str(root / "ckpt"), "save_interval": "8ba"}
    recipe["callbacks"] = {"generate": {"prompts": PROMPTS[:1], "interval": "8ba", "max_new_tokens": 8}}
    (root / "r.yaml").write_text(yaml.safe_dump(recipe, allow_unicode=True))
    train(load(root / "r.yaml"))
    export = root / "export"
    assert (
        llm_main(["export", str(root / "ckpt"), "--tokenizer", str(hf_tokenizer), "--out", str(export)]) == 0
    )
    return {"root": root, "meta": meta, "export": export, "ckpt": root / "ckpt", "run_dir": root / "run"}


def test_the_run_trained_on_the_shards_and_sampled_with_the_tokenizer(run):
    assert run["meta"]["tokenizer_kind"] == HUGGINGFACE
    losses = [r["loss"] for r in read_metrics(run["run_dir"] / "metrics.jsonl") if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    samples = [json.loads(line) for line in (run["run_dir"] / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"] == PROMPTS[0] for s in samples)


def test_the_export_carries_the_same_tokenizer_json_and_transformers_reads_our_ids(run, hf_tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    export = run["export"]
    assert (export / "tokenizer.json").read_bytes() == (hf_tokenizer / "tokenizer.json").read_bytes()
    assert not (export / "tokenizer.model").exists()
    ours, theirs = Tokenizer(hf_tokenizer), AutoTokenizer.from_pretrained(export)
    for text in MIXED_TEXTS:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), repr(text)
        assert theirs(text).input_ids == ours.encode_prompt(text)  # the start token first, as ours
        assert theirs.decode(ours.encode(text)) == text
    config = AutoConfig.from_pretrained(export)
    assert config.eos_token_id == theirs.eos_token_id == ours.eos_id
    assert config.pad_token_id == theirs.pad_token_id == ours.pad_id != ours.eos_id


def test_transformers_greedy_generation_equals_llm_generate(run, capsys):
    """`llm generate EXPORT --temperature 0` with no --tokenizer (the export's tokenizer.json);
    transformers loads the export and generates from it without a warning."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run["export"]
    logging.Logger.warning_once.cache_clear()  # transformers says some things once per process
    with transformers_warnings() as said:
        hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(export)
        ids = hf_tok(PROMPTS[0], return_tensors="pt").input_ids
        with torch.no_grad():
            hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert said == []
    args = ["generate", str(export), "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--json"]
    assert llm_main([*args, *(a for p in PROMPTS for a in ("--prompt", p))]) == 0
    ours = [json.loads(line)["continuation"] for line in capsys.readouterr().out.splitlines()]
    for prompt, continuation in zip(PROMPTS, ours, strict=True):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            new = hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, ids.shape[1] :].tolist()
        if hf_tok.eos_token_id in new:  # transformers keeps the EOS it stopped at; llm generate does not
            new = new[: new.index(hf_tok.eos_token_id)]
        assert new and hf_tok.decode(new, skip_special_tokens=True) == continuation, prompt


def test_chat_and_eval_take_the_exports_own_tokenizer(run, hf_tokenizer, tmp_path, capsys):
    from convert.demo.tasks import write_demo_tasks

    template = tmp_path / "qa.json"
    template.write_text(
        json.dumps({"prompt": ["问：", "{prompt}", "\n答："], "answer": ["{answer}", "<eos>"]})
    )
    chat = ["chat", str(run["export"]), "--template", str(template), "--prompt", "中国", "--temperature", "0"]
    assert llm_main([*chat, "--max-new-tokens", "6"]) == 0
    assert llm_main([*chat, "--max-new-tokens", "6", "--tokenizer", str(hf_tokenizer)]) == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == 2 and answers[0] == answers[1]
    write_demo_tasks(str(tmp_path / "zh-demo"), questions=3)
    task = ["--tasks", str(tmp_path / "zh-demo")]
    assert llm_main(["eval", str(run["export"]), *task, "--out", str(tmp_path / "a.json")]) == 0
    ckpt = ["eval", str(run["ckpt"]), "--tokenizer", str(hf_tokenizer), *task]
    assert llm_main([*ckpt, "--out", str(tmp_path / "b.json")]) == 0
    results = [json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json")]
    assert [r["questions"] for r in results] == [6, 6]
    a, b = (r["tasks"]["zh-demo"] for r in results)
    assert a["acc"] == b["acc"]
    for subject in a["subjects"]:
        for qa, qb in zip(a["subjects"][subject]["details"], b["subjects"][subject]["details"], strict=True):
            assert qa["loglikelihoods"] == pytest.approx(qb["loglikelihoods"], abs=1e-4)


def test_the_recipe_takes_the_tokenizer_folder_and_checks_its_identity(run, hf_tokenizer, tmp_path):
    """Shards made with this tokenizer.json but another EOS are refused by the trainer's hash check."""
    import shutil

    from llm.data.meta_checks import check_streams
    from llm.errors import ConfigError

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(hf_tokenizer / "tokenizer.json", other / "tokenizer.json")
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    recipe = Path(run["root"]) / "r.yaml"
    check_streams(load(recipe))
    with pytest.raises(ConfigError, match="tokenized with a tokenizer of sha256"):
        check_streams(load(recipe, f"tokenizer.path={other}"))
