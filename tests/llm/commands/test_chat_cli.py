"""`llm chat`: the chat template, KV-cache generation streamed as it comes, one clear line per bad input."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from llm.commands import main as llm_main
from llm.commands.chat import TextStream
from llm.generate import generate
from llm.model import ModelConfig, Transformer
from llm.weights.composer_layout import save_composer_weights
from llm.weights.keys import MODEL_CONFIG_KEY
from llm.weights.read import load_model, read_weights
from shards.chat_template import CHAT_TEMPLATE_KEY, TEMPLATE_FILE, ChatTemplate
from shards.meta import FORMAT_NAME
from shards.tokenizer import Tokenizer
from storage import open_store
from tests.support.sft import convert_sft, write_jsonl

CFG = ModelConfig(vocab_size=2000, dim=32, n_layers=1, n_heads=2, max_seq_len=64, tie_embeddings=True)
PROMPT = "北京是哪个国家的首都？"
TEMPLATE = {"name": "baby-llama2", "prompt": ["{prompt}", "<bos>"], "answer": ["{answer}", "<eos>"]}


@pytest.fixture(scope="module")
def split(tmp_path_factory, small_tokenizer) -> Path:
    """A real SFT split (its meta.json holds the chat template)."""
    root = tmp_path_factory.mktemp("chat-split")
    records = write_jsonl(root / "p.jsonl", [{"prompt": PROMPT, "answer": "北京是中国的首都。"}])
    assert convert_sft([records], small_tokenizer, root / "out", "--val-fraction", "0").returncode == 0
    return root / "out" / "train"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    """Weights that record their shape but no template (a pretraining checkpoint)."""
    path = tmp_path_factory.mktemp("plain") / "weights.pt"
    return str(save_composer_weights(dict(Transformer(CFG, seed=1).state_dict()), CFG, path))


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> str:
    """Weights that record the template, as an SFT run's checkpoints do."""
    path = tmp_path_factory.mktemp("sft") / "weights.pt"
    state = {f"model.{k}": v for k, v in Transformer(CFG, seed=1).state_dict().items()}
    payload = {
        "state": {"model": state},
        MODEL_CONFIG_KEY: dataclasses.asdict(CFG),
        CHAT_TEMPLATE_KEY: {**TEMPLATE, "normalization": "NFKC"},
    }
    torch.save(payload, path)
    return str(path)


def chat(*args: str) -> int:
    return llm_main(["chat", *args, "--temperature", "0", "--max-new-tokens", "8"])


def expected_answer(checkpoint: str, tokenizer_path: str, prompt: str) -> str:
    tokenizer = Tokenizer(tokenizer_path)
    ids = ChatTemplate.from_dict({**TEMPLATE, "normalization": "NFKC"}, "t").prompt_ids(tokenizer, prompt)
    assert ids == tokenizer.encode("北京是哪个国家的首都?") + [tokenizer.bos_id]  # NFKC: ？ -> ?
    out = generate(load_model(checkpoint), [ids], max_new_tokens=8, temperature=0, eos_id=tokenizer.eos_id)
    return tokenizer.decode(out[0])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_prompt_is_answered_in_the_recorded_template(fine_tuned, small_tokenizer, capsys):
    assert chat(fine_tuned, "--tokenizer", small_tokenizer, "--prompt", PROMPT) == 0
    assert capsys.readouterr().out == expected_answer(fine_tuned, small_tokenizer, PROMPT) + "\n"


def test_a_template_from_an_sft_split_and_json_lines(plain, split, small_tokenizer, capsys):
    args = [plain, "--tokenizer", small_tokenizer, "--template", str(split), "--json"]
    assert chat(*args, "--prompt", PROMPT, "--prompt", "今天天气怎么样？") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == [PROMPT, "今天天气怎么样？"]
    assert lines[0]["answer"] == expected_answer(plain, small_tokenizer, PROMPT)
    assert (
        chat(
            plain, "--tokenizer", small_tokenizer, "--template", str(split / "meta.json"), "--prompt", PROMPT
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == lines[0]["answer"].strip()


class Terminal(io.StringIO):
    """Typed input: what `sys.stdin` is when a person types at a terminal."""

    def isatty(self) -> bool:
        return True


def test_interactive_chat_reads_until_an_empty_line(fine_tuned, small_tokenizer, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", Terminal(f"{PROMPT}\n{PROMPT}\n\nignored\n"))
    assert chat(fine_tuned, "--tokenizer", small_tokenizer) == 0
    answer = expected_answer(fine_tuned, small_tokenizer, PROMPT)
    out, err = capsys.readouterr()
    assert out == f"> {answer}\n> {answer}\n> " and "an empty line or Ctrl-D ends" in err


def test_piped_chat_prints_only_the_answers(fine_tuned, small_tokenizer, monkeypatch, capsys):
    """`llm chat ... < questions.txt`: no `> ` input prompt on stdout, no hint (issue 36)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PROMPT}\n{PROMPT}\n"))
    assert chat(fine_tuned, "--tokenizer", small_tokenizer) == 0
    answer = expected_answer(fine_tuned, small_tokenizer, PROMPT)
    assert capsys.readouterr() == (f"{answer}\n{answer}\n", "")


def test_the_help_says_how_answers_are_sampled(capsys):
    with pytest.raises(SystemExit):
        llm_main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--temperature TEMPERATURE 0 = greedy, the same text every time (default 0.8: sampled)" in text
    assert "--top-k TOP_K sample among the k most likely tokens; 0 = all (default 50)" in text


def test_an_export_carries_the_template(tmp_path, fine_tuned, small_tokenizer, capsys):
    assert (
        llm_main(["export", fine_tuned, "--tokenizer", small_tokenizer, "--out", str(tmp_path / "hf")]) == 0
    )
    assert json.loads((tmp_path / "hf" / TEMPLATE_FILE).read_text())["prompt"] == TEMPLATE["prompt"]
    assert read_weights(str(tmp_path / "hf")).chat_template == read_weights(fine_tuned).chat_template
    capsys.readouterr()
    assert (
        chat(
            str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "hf" / "tokenizer.model"), "--prompt", PROMPT
        )
        == 0
    )
    assert capsys.readouterr().out == expected_answer(fine_tuned, small_tokenizer, PROMPT) + "\n"
    # Issue 39 item 18: the export's own tokenizer.model, without --tokenizer.
    assert chat(str(tmp_path / "hf"), "--prompt", PROMPT) == 0
    assert capsys.readouterr().out == expected_answer(fine_tuned, small_tokenizer, PROMPT) + "\n"


def test_a_checkpoint_and_template_on_s3(s3_bucket, fine_tuned, split, small_tokenizer, capsys):
    store = open_store(f"s3://{s3_bucket}")
    store.upload(fine_tuned, "ckpt/weights.pt")
    store.upload(split / "meta.json", "sft/train/meta.json")
    args = ["--tokenizer", small_tokenizer, "--prompt", PROMPT]
    assert chat(f"s3://{s3_bucket}/ckpt/weights.pt", *args, "--template", f"s3://{s3_bucket}/sft/train") == 0
    assert capsys.readouterr().out == expected_answer(fine_tuned, small_tokenizer, PROMPT) + "\n"


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "no-template",
            "records no chat template (not fine-tuned with data.kind: sft here): pass --template",
        ),
        ("pretraining-shards", "these are pretraining shards"),
        ("too-long", "the model's whole context of 64: shorten it"),
        ("empty", "empty prompt"),
        ("no-such-template", "no chat template there"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, plain, fine_tuned, small_tokenizer, case, message, capsys):
    args = [fine_tuned, "--tokenizer", small_tokenizer, "--prompt", PROMPT]
    if case == "no-template":
        args[0] = plain
    elif case == "pretraining-shards":
        (tmp_path / "meta.json").write_text(json.dumps({"format": FORMAT_NAME, "seq_len": 64}))
        args += ["--template", str(tmp_path)]
    elif case == "too-long":
        args[4] = "很长的问题" * 40
    elif case == "empty":
        args[4] = "   "
    elif case == "no-such-template":
        args += ["--template", str(tmp_path / "nothing")]
    assert chat(*args) == 2
    assert message in one_line_error(capsys)


def test_the_answer_streams_piece_by_piece_and_never_shows_half_a_character(small_tokenizer, capsys):
    """Byte-fallback pieces of one character arrive one step at a time; each is printed once whole."""
    tokenizer = Tokenizer(small_tokenizer)
    rare = "龘"  # not among the 2,000 pieces: encoded as its three UTF-8 bytes
    ids = tokenizer.encode(f"中国{rare}人民")
    assert len(ids) >= 5 and any(tokenizer.piece(i).startswith("<0x") for i in ids)
    stream = TextStream(tokenizer)
    printed = []
    for token in [*ids, tokenizer.eos_id, ids[0]]:  # nothing after EOS is shown
        stream.add(torch.tensor([token]))
        printed.append(capsys.readouterr().out)
    stream.close()
    assert "".join(printed) + capsys.readouterr().out == f"中国{rare}人民\n"
    assert all("\ufffd" not in piece for piece in printed)
    assert sum(1 for piece in printed if piece) >= 3  # shown as it came, not all at the end
