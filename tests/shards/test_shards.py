"""shards/: the contract both sides import: meta.json's schema, output preparation, the template."""

from __future__ import annotations

import json

import pytest

from shards.chat_template import ChatTemplate, read_template
from shards.errors import ShardsError
from shards.meta import FORMAT_NAME, SplitMeta, read_meta, write_meta
from shards.output import prepare_output
from storage import open_store

PRETRAIN_KEYS = {
    "format", "format_version", "split", "seq_len", "dtype", "vocab_size", "eos_id", "bos_id", "add_bos",
    "tokenizer_sha256", "num_samples", "num_tokens", "num_documents", "dropped", "created_at", "command",
}  # fmt: skip


def meta(**changes) -> SplitMeta:
    values = dict(
        split="train", seq_len=8, dtype="uint16", vocab_size=300, eos_id=2, bos_id=1, add_bos=False,
        tokenizer_sha256="ab", num_samples=3, num_tokens=24, num_documents=2, dropped={"empty": 1},
        created_at="2026-01-01T00:00:00Z", command="test",
    )  # fmt: skip
    return SplitMeta(**{**values, **changes})


def test_the_format_name_on_disk_is_fixed():
    assert FORMAT_NAME == "llm-pretrain-tokens"  # existing shard folders carry it


def test_pretraining_meta_has_exactly_the_documented_keys_and_reads_back(tmp_path):
    store = open_store(tmp_path)
    write_meta(store, meta())
    written = json.loads((tmp_path / "train" / "meta.json").read_text())
    assert set(written) == PRETRAIN_KEYS and "kind" not in written
    assert read_meta(str(tmp_path / "train")) == meta()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "is not a 'llm-pretrain-tokens' file"),
        ({"format_version": 2}, "format_version 2, this code reads 1"),
        ({"seq_len": None}, "lacks seq_len"),
        ({"dtype": "int8"}, "dtype not as shards/FORMAT.md says"),
        ({"kind": "rl"}, "unknown kind 'rl'"),
    ],
)
def test_a_damaged_meta_json_is_refused_naming_what_is_wrong(tmp_path, change, message):
    data = {**meta().to_dict(), **change}
    data = {k: v for k, v in data.items() if v is not None}
    (tmp_path / "meta.json").write_text(json.dumps(data))
    with pytest.raises(ShardsError, match=message):
        read_meta(str(tmp_path))


def test_prepare_output_resumes_or_clears_and_refuses_a_complete_output(tmp_path):
    store = open_store(tmp_path)
    for split in ("train", "val"):
        store.write_json(f"{split}/part-00000/part.json", {})
        store.write_json(f"{split}/index.json", {})
    store.write_json("summary.json", {})
    with pytest.raises(ShardsError, match="already holds a complete conversion.*--overwrite"):
        prepare_output(store, overwrite=False, resume=True)
    store.delete(["val/index.json"])  # interrupted after one split
    prepare_output(store, overwrite=False, resume=True, files=("summary.json",))
    assert not store.exists("train/index.json") and store.exists("train/part-00000/part.json")
    assert store.exists("summary.json")
    prepare_output(store, overwrite=False, resume=False, files=("summary.json",))
    assert store.list() == {}


def test_one_template_checks_both_placeholders_and_the_normalization(tmp_path):
    template = read_template("baby-llama2").normalized("NFKC")
    assert ChatTemplate.from_dict(template.to_dict(), "meta.json") == template
    with pytest.raises(ShardsError, match="'answer' must hold '{answer}' exactly once"):
        ChatTemplate.from_dict({**template.to_dict(), "answer": ["<eos>"]}, "meta.json")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**template.to_dict(), "name": "", "normalization": "NFX"}))
    with pytest.raises(ShardsError, match="unknown normalization 'NFX'"):
        read_template(str(path))
    path.write_text(json.dumps({"prompt": ["{prompt}"], "answer": ["{answer}", "<eos>"]}))
    assert read_template(str(path)).name == "mine"
    write_meta(open_store(tmp_path), meta(kind="sft", chat_template=template.to_dict()))
    assert read_template(str(tmp_path / "train")) == template
