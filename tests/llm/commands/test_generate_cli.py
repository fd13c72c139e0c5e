"""`llm generate`: prompts from arguments, a file or the terminal; one clear message per bad input."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch

from llm.commands import main as llm_main
from llm.model import ModelConfig, Transformer
from llm.weights.composer_layout import save_composer_weights
from llm.weights.hf_export import export_hf
from llm.weights.read import load_model
from tests.support.training import store_checkpoint

VOCAB = 2000
CFG = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=64, tie_embeddings=True)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, chinese_documents) -> str:
    from convert.tokens.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tok.model"
    train_tokenizer(chinese_documents[:60], vocab_size=VOCAB, out=str(out), character_coverage=0.98)
    return str(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt") / "weights.pt"
    return str(save_composer_weights(dict(Transformer(CFG, seed=1).state_dict()), CFG, path))


def generate(*args: str) -> int:
    return llm_main(["generate", *args, "--max-new-tokens", "5", "--seed", "0"])


def test_prompts_from_arguments_and_a_file_are_continued_in_order(
    tmp_path, checkpoint, tokenizer_path, capsys
):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("北京\n\n经济\n", encoding="utf-8")
    assert (
        generate(
            checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国", "--prompts-file", str(prompts_file)
        )
        == 0
    )
    blocks = [b for b in capsys.readouterr().out.split("\n\n") if b.strip()]
    assert [b.strip()[:2] for b in blocks] == ["中国", "北京", "经济"]


def test_an_exported_folder_generates_the_same_text(tmp_path, checkpoint, tokenizer_path, capsys):
    out = export_hf(load_model(checkpoint), tmp_path / "hf", tokenizer_path)
    assert generate(checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国", "--temperature", "0") == 0
    from_checkpoint = capsys.readouterr().out
    assert (
        generate(
            str(out), "--tokenizer", str(out / "tokenizer.model"), "--prompt", "中国", "--temperature", "0"
        )
        == 0
    )
    assert capsys.readouterr().out == from_checkpoint


def test_an_exported_folder_uses_its_own_tokenizer_without_the_flag(
    tmp_path, checkpoint, tokenizer_path, capsys
):
    """Issue 39 item 18: `--tokenizer` was required even for an export that ships tokenizer.model."""
    out = export_hf(load_model(checkpoint), tmp_path / "hf", tokenizer_path)
    assert generate(checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国", "--temperature", "0") == 0
    from_checkpoint = capsys.readouterr().out
    assert generate(str(out), "--prompt", "中国", "--temperature", "0") == 0
    assert capsys.readouterr().out == from_checkpoint
    assert generate(checkpoint, "--prompt", "中国") == 2  # a checkpoint file ships none
    assert (
        "ships no tokenizer (tokenizer.json or tokenizer.model): pass --tokenizer" in capsys.readouterr().err
    )


def test_interactive_mode_reads_prompts_until_an_empty_line(monkeypatch, checkpoint, tokenizer_path, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("中国\n北京\n\n经济\n"))
    assert generate(checkpoint, "--tokenizer", tokenizer_path, "--interactive") == 0
    out, err = capsys.readouterr()
    assert "中国" in out and "北京" in out and "经济" not in out
    assert "> " not in out and err == ""  # piped: no input prompt, no hint


def test_json_gives_one_object_per_prompt_for_scripts(checkpoint, tokenizer_path, capsys, monkeypatch):
    """Plain output separates prompts by blank lines, which a continuation may also hold (issue 36)."""
    from llm.generate import generate as lib_generate
    from shards.tokenizer import Tokenizer

    args = [checkpoint, "--tokenizer", tokenizer_path, "--temperature", "0", "--json"]
    assert generate(*args, "--prompt", "中国", "--prompt", "经济发展") == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    tok, model = Tokenizer(tokenizer_path), load_model(checkpoint)
    expected = [
        tok.decode(
            lib_generate(model, [tok.encode_prompt(p)], max_new_tokens=5, temperature=0, eos_id=tok.eos_id)[0]
        )
        for p in ("中国", "经济发展")
    ]
    assert rows == [
        {"prompt": "中国", "continuation": expected[0]},
        {"prompt": "经济发展", "continuation": expected[1]},
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("中国\n"))
    assert (
        generate(checkpoint, "--tokenizer", tokenizer_path, "--temperature", "0", "--json", "--interactive")
        == 0
    )
    assert capsys.readouterr().out == lines[0] + "\n"


def sampling_defaults(command: str) -> tuple[dict, str]:
    """The sampling flags' defaults of `llm COMMAND` and its --help text."""
    import argparse
    import importlib
    import re

    parser = argparse.ArgumentParser(prog=f"llm {command}")
    importlib.import_module(f"llm.commands.{command}").add_arguments(parser)
    args = vars(parser.parse_args(["ckpt", "--tokenizer", "t.model"]))
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
    return {name: args[name] for name in names}, re.sub(r"\s+", " ", parser.format_help())


def test_chat_and_generate_share_one_set_of_sampling_flags_with_one_default():
    """The flags were copied into both commands, with --max-new-tokens 256 in one and 128 in the other."""
    import dataclasses

    from llm.generate import Sampling

    chat, chat_help = sampling_defaults("chat")
    gen, gen_help = sampling_defaults("generate")
    assert chat == gen == dataclasses.asdict(Sampling())
    for text in (chat_help, gen_help):
        assert "sampling:" in text and "(default 0.8: sampled)" in text and "0 = greedy" in text
        assert "(default 256)" in text and "never past the model's context" in text and "(default 50)" in text


def test_the_default_of_new_tokens_stops_at_the_models_context(tmp_path, tokenizer_path, capsys):
    from llm.generate import generate as lib_generate
    from shards.tokenizer import Tokenizer

    short = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=8, tie_embeddings=True)
    path = save_composer_weights(dict(Transformer(short, seed=1).state_dict()), short, tmp_path / "w.pt")
    args = [str(path), "--tokenizer", tokenizer_path, "--prompt", "中国", "--temperature", "0", "--json"]
    assert llm_main(["generate", *args]) == 0  # 256 new tokens by default: the 8-token context gives the rest
    tok = Tokenizer(tokenizer_path)
    ids = tok.encode_prompt("中国")
    model = load_model(str(path))
    room = lib_generate(model, [ids], max_new_tokens=8 - len(ids), temperature=0, eos_id=tok.eos_id)[0]
    assert json.loads(capsys.readouterr().out)["continuation"] == tok.decode(room)


@pytest.mark.s3
def test_a_checkpoint_from_s3_is_downloaded(s3_bucket, checkpoint, tokenizer_path, capsys):
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    client.upload_file(checkpoint, s3_bucket, "ckpt/weights.pt")
    client.upload_file(tokenizer_path, s3_bucket, "tok/tok.model")
    args = ["--tokenizer", f"s3://{s3_bucket}/tok/tok.model", "--prompt", "中国", "--temperature", "0"]
    assert generate(f"s3://{s3_bucket}/ckpt/weights.pt", *args) == 0
    from_s3 = capsys.readouterr().out
    assert generate(checkpoint, *args) == 0
    assert capsys.readouterr().out == from_s3 and "中国" in from_s3


def _recipe(tmp_path, **model) -> str:
    fields = {
        "vocab_size": VOCAB,
        "dim": 32,
        "n_layers": 1,
        "n_heads": 2,
        "max_seq_len": 64,
        "tie_embeddings": True,
        **model,
    }
    body = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items())
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model: {{{body}}}\ntokenizer: {{path: t.model}}\ndata: {{train: [{{remote: x}}]}}\n")
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty prompt", "empty prompt"),
        ("missing prompts file", "prompts file"),
        ("missing checkpoint", "does not exist"),
        ("missing tokenizer", "tokenizer"),
        ("no prompts", "no prompts"),
        ("tokenizer larger than the model", "2000 pieces but the model's vocabulary is 1000"),
        ("shape mismatch", "layers.0.feed_forward.w1.weight: checkpoint (96, 32) vs model (64, 32)"),
    ],
)
def test_bad_input_gives_one_clear_message(tmp_path, checkpoint, tokenizer_path, capsys, case, message):
    args = [checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国"]
    if case == "empty prompt":
        args = [checkpoint, "--tokenizer", tokenizer_path, "--prompt", "  "]
    elif case == "missing prompts file":
        args += ["--prompts-file", str(tmp_path / "nope.txt")]
    elif case == "missing checkpoint":
        args[0] = str(tmp_path / "nope.pt")
    elif case == "missing tokenizer":
        args[2] = str(tmp_path / "nope.model")
    elif case == "no prompts":
        args = args[:3]
    elif case == "tokenizer larger than the model":
        small = ModelConfig(vocab_size=1000, dim=32, n_layers=1, n_heads=2, max_seq_len=64)
        args[0] = str(save_composer_weights(dict(Transformer(small).state_dict()), small, tmp_path / "s.pt"))
    elif case == "shape mismatch":
        args += ["--recipe", _recipe(tmp_path, hidden_dim=64)]
    assert generate(*args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_greedy_cli_output_matches_the_library(checkpoint, tokenizer_path, capsys):
    from llm.generate import generate as lib_generate
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    model = load_model(checkpoint)
    ids = lib_generate(
        model, [tok.encode_prompt("中国")], max_new_tokens=5, temperature=0, eos_id=tok.eos_id
    )[0]
    assert generate(checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国", "--temperature", "0") == 0
    assert capsys.readouterr().out.strip() == ("中国" + tok.decode(ids)).strip()
    assert torch.is_grad_enabled()


def publish(folder, batch: int, source) -> Path:
    """Store `source` as the run's checkpoint at `batch` with its manifest, as training does."""
    from llm.checkpoint import manifest as cm
    from storage import open_store

    store = open_store(str(folder))
    rel = store_checkpoint(store, batch, source)
    store.write_text(cm.LATEST, json.dumps({"batch": batch, "load_path": rel}))
    return folder / rel


def greedy(checkpoint: str, tokenizer_path: str, capsys) -> str:
    assert generate(checkpoint, "--tokenizer", tokenizer_path, "--prompt", "中国", "--temperature", "0") == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt") / "other.pt"
    return str(save_composer_weights(dict(Transformer(CFG, seed=2).state_dict()), CFG, path))


def test_a_run_checkpoint_folder_means_its_newest_checkpoint(tmp_path, checkpoint, tokenizer_path, capsys):
    folder = tmp_path / "checkpoints"
    old = tmp_path / "old.pt"
    old.write_bytes(b"an older, unreadable checkpoint")
    publish(folder, 10, old)
    publish(folder, 20, checkpoint)
    from_file = greedy(checkpoint, tokenizer_path, capsys)
    assert greedy(str(folder), tokenizer_path, capsys) == from_file


def test_a_corrupt_newest_checkpoint_in_a_run_folder_gives_way_to_the_previous_good_one(
    tmp_path, checkpoint, other_checkpoint, tokenizer_path, capsys, caplog
):
    folder = tmp_path / "checkpoints"
    publish(folder, 10, checkpoint)
    newest = publish(folder, 20, other_checkpoint)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the SHA-256 in the manifest tells
    newest.write_bytes(bytes(data))
    loaded = load_model(str(folder)).state_dict()
    previous, corrupt = load_model(checkpoint).state_dict(), load_model(other_checkpoint).state_dict()
    assert all(torch.equal(loaded[k], previous[k]) for k in loaded)
    assert not all(torch.equal(loaded[k], corrupt[k]) for k in loaded)
    assert "checkpoint at batch 20" in caplog.text and "SHA-256" in caplog.text
    assert greedy(str(folder), tokenizer_path, capsys) == greedy(checkpoint, tokenizer_path, capsys)


def test_a_run_folder_without_a_good_checkpoint_is_refused_in_one_line(
    tmp_path, checkpoint, tokenizer_path, capsys
):
    folder = tmp_path / "checkpoints"
    newest = publish(folder, 10, checkpoint)
    newest.write_bytes(newest.read_bytes()[:-1] + b"x")
    rc = generate(str(folder), "--tokenizer", tokenizer_path, "--prompt", "中国")
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "no usable checkpoint" in err
    assert err.count("\n") == 0 and "Traceback" not in err
