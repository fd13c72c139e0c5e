"""Conversion with a Hugging Face tokenizer.json (a byte-level BPE built in the session): the same bytes
for any worker count and for tasks merged, the library's own ids in the shards, meta.json naming the
tokenizer, chat templates with the tokenizer's own EOS, and one line for each bad tokenizer."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path

import pytest

from convert.cli import main as convert_main
from convert.run.jobs import TaskSpec, convert_corpus, merge_tasks
from shards.chat_template import DEFAULT_TEMPLATE, TEMPLATES, ChatTemplate, TemplateRenderer
from shards.errors import ShardsError
from shards.tokenizer import HUGGINGFACE, Tokenizer
from tests.support.conversion import local_samples
from tests.support.golden import digests, options, write_corpus
from tests.support.hf_tokenizer import copy_without_eos
from tests.support.sft import convert_sft, write_jsonl

pytestmark = pytest.mark.slow  # worker processes

RUNS = ((1, True), (1, False), (2, False), (3, False))  # (workers, the main process cleans and writes)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, chinese_documents, hf_tokenizer) -> dict:
    """The golden corpus (two files, duplicates, chunks of 12,000 characters) converted with the
    tokenizer.json folder at 1, 2 and 3 workers, and as 2 tasks merged."""
    root = tmp_path_factory.mktemp("hf-convert")
    inputs = write_corpus(root, chinese_documents)
    made = {"inputs": inputs, "digests": {}}
    for run in RUNS:
        out = root / f"w{run[0]}-{run[1]}"
        convert_corpus(inputs, tokenizer=str(hf_tokenizer), out=str(out), options=options(False, *run))
        made["digests"][run] = digests(out)
    made["out"] = root / "w1-True"
    tasks = root / "tasks"
    for index in range(2):
        opts = dataclasses.replace(options(False, 1, False), memory_budget=0)
        convert_corpus(
            inputs, tokenizer=str(hf_tokenizer), out=str(tasks), options=opts, task=TaskSpec(2, index)
        )
    made["task_files"] = sorted(p.name for p in (tasks / "tasks" / "task-00000").iterdir())
    merge_tasks(str(tasks), progress=False, workers=1)
    made["merged"] = digests(tasks)
    return made


def test_any_worker_count_and_merged_tasks_give_the_same_bytes(converted):
    first = converted["digests"][RUNS[0]]
    assert len(first) > 10 and sum(name.endswith(".zstd") for name in first) > 4  # several parts
    assert all(found == first for found in converted["digests"].values())
    assert converted["merged"] == first
    # The tasks' folder carries the tokenizer's files, which the merge read it from.
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(converted["task_files"])


def test_meta_json_names_the_tokenizer_and_its_special_ids(converted, hf_tokenizer):
    tok = Tokenizer(hf_tokenizer)
    meta = json.loads((converted["out"] / "train" / "meta.json").read_text())
    assert meta["tokenizer_kind"] == HUGGINGFACE and meta["tokenizer_sha256"] == tok.info().sha256
    assert (meta["eos_id"], meta["bos_id"], meta["vocab_size"]) == (tok.eos_id, -1, tok.vocab_size)
    assert meta["dtype"] == "uint16"


def _documents(inputs: list[str]) -> set[str]:
    """The inputs' documents as the cleaner leaves them (NFKC), the malformed lines left out."""
    found = set()
    for path in inputs:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                found.add(unicodedata.normalize("NFKC", json.loads(line)["text"]))
            except ValueError:
                continue
    return found


def test_the_shards_hold_the_librarys_ids_each_document_ended_by_eos(converted, hf_tokenizer):
    """The first part's samples are consecutive: whole documents in it are the library's encoding of a
    cleaned (NFKC) input document, followed by the tokenizer's EOS."""
    from tokenizers import Tokenizer as LibraryTokenizer

    library = LibraryTokenizer.from_file(str(hf_tokenizer / "tokenizer.json"))
    eos = Tokenizer(hf_tokenizer).eos_id
    index = json.loads((converted["out"] / "train" / "index.json").read_text())
    first_part = [s for s in index["shards"] if s["raw_data"]["basename"].startswith("part-00000/")]
    rows = local_samples(str(converted["out"]))[: sum(s["samples"] for s in first_part)]
    stream = rows.reshape(-1).tolist()
    ends = [i for i, token in enumerate(stream) if token == eos]
    assert len(ends) >= 4
    corpus = _documents(converted["inputs"])
    for start, end in zip(ends[:3], ends[1:4], strict=True):  # documents after the first EOS: whole
        ids = stream[start + 1 : end]
        text = library.decode(ids)
        assert text in corpus and library.encode(text, add_special_tokens=False).ids == ids


def _run_cli(*args: str, capsys) -> tuple[int, str]:
    rc = convert_main(list(args))
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("neither", "is neither a SentencePiece .model file nor a Hugging Face tokenizer.json"),
        ("no-eos", "names no EOS token: set eos_token in the tokenizer_config.json"),
    ],
)
def test_a_bad_tokenizer_is_one_line_and_exit_2_with_nothing_written(
    converted, hf_tokenizer, tmp_path, capsys, case, message
):
    if case == "neither":
        tokenizer = tmp_path / "tokenizer.json"
        tokenizer.write_text("<html>not found</html>")
    else:
        tokenizer = copy_without_eos(hf_tokenizer, tmp_path / "no-eos")
    out = tmp_path / "out"
    rc, err = _run_cli("shards", converted["inputs"][0], "--tokenizer", str(tokenizer), "--out", str(out),
                       "--no-progress", capsys=capsys)  # fmt: skip
    assert rc == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()


TEMPLATE = {"name": "qa", "prompt": ["问：", "{prompt}", "\n答："], "answer": ["{answer}", "<eos>"]}


def test_sft_conversion_records_the_tokenizer(tmp_path, hf_tokenizer, review_pairs):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", review_pairs[:60])
    template = tmp_path / "qa.json"
    template.write_text(json.dumps(TEMPLATE, ensure_ascii=False), encoding="utf-8")
    done = convert_sft([pairs], str(hf_tokenizer), tmp_path / "sft", "--template", str(template),
                       "--seq-len", "160", "--val-fraction", "0", "--min-answer-chars", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "sft" / "train" / "meta.json").read_text())
    assert meta["tokenizer_kind"] == HUGGINGFACE and meta["eos_id"] == Tokenizer(hf_tokenizer).eos_id
    assert meta["num_examples"] == 60 and meta["chat_template"]["prompt"] == TEMPLATE["prompt"]


def test_chat_templates_take_the_tokenizers_own_special_ids(hf_tokenizer):
    tok = Tokenizer(hf_tokenizer)
    renderer = TemplateRenderer(ChatTemplate.from_dict(TEMPLATE, "qa.json"), tok)
    assert renderer.answer_ids(tok.encode("正面")) == [*tok.encode("正面"), tok.eos_id]
    assert renderer.prompt_ids(tok.encode("好")) == [
        *tok.encode("问："),
        *tok.encode("好"),
        *tok.encode("\n答："),
    ]
    # The built-in templates put BOS between prompt and answer; this tokenizer names none.
    with pytest.raises(ShardsError, match="uses <bos>, which tokenizer .* lacks; choose another --template"):
        TemplateRenderer(ChatTemplate.from_dict(TEMPLATES[DEFAULT_TEMPLATE], DEFAULT_TEMPLATE), tok)
