"""A Hugging Face tokenizer.json behind the one tokenizer interface (shards/tokenizer.py): the same
ids as `transformers.AutoTokenizer`, decoding that gives the text back exactly, special ids read from
the files, and one line for each bad input."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from shards.errors import ShardsError
from shards.tokenizer import HUGGINGFACE, Tokenizer, tokenizer_identity
from tests.support.hf_tokenizer import EOS, MIXED_TEXTS, PAD, WITH_SPECIAL, copy_without_eos


@pytest.fixture(scope="module")
def theirs(hf_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer)


def test_the_encoding_equals_transformers_token_for_token(hf_tokenizer, theirs):
    ours = Tokenizer(hf_tokenizer)
    texts = [*MIXED_TEXTS, WITH_SPECIAL]
    expected = [theirs.encode(text, add_special_tokens=False) for text in texts]
    assert [ours.encode(text) for text in texts] == expected
    assert ours.encode_batch(texts) == expected == ours.encode_batch(texts, num_threads=1)
    assert all(len(ids) > 0 for ids in expected)
    assert ours.encode(WITH_SPECIAL).count(ours.eos_id) == 1  # the special token's text is that token


def test_decoding_gives_the_text_back_exactly(hf_tokenizer, theirs):
    ours = Tokenizer(hf_tokenizer)
    for text in MIXED_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text == theirs.decode(ids), repr(text)
    # One character of several tokens: its first tokens alone are not a whole character yet.
    ids = ours.encode("👨‍👩‍👧‍👦")
    assert len(ids) > 1 and ours.decode(ids[:1]).endswith("\ufffd")


def test_special_ids_and_vocabulary_come_from_the_files(hf_tokenizer, theirs):
    ours = Tokenizer(hf_tokenizer)
    assert ours.kind == HUGGINGFACE and ours.file_name == "tokenizer.json"
    assert ours.eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids(EOS)
    assert ours.pad_id == theirs.pad_token_id == theirs.convert_tokens_to_ids(PAD)
    assert ours.bos_id is theirs.bos_token_id is None and ours.start_id == ours.eos_id
    assert ours.eos_id not in (0, 1, 2)  # added after the vocabulary: not where SentencePiece puts it
    assert ours.vocab_size == len(theirs) == ours.pad_id + 1
    assert ours.piece(ours.eos_id) == EOS
    info = ours.info()
    assert (info.kind, info.eos_id, info.bos_id, info.vocab_size) == (
        HUGGINGFACE,
        ours.eos_id,
        -1,
        len(theirs),
    )
    assert info.meta_fields()["tokenizer_kind"] == HUGGINGFACE
    # The folder and its tokenizer.json are the same tokenizer, and the cheap identity agrees.
    by_file = Tokenizer(hf_tokenizer / "tokenizer.json").info()
    assert by_file.sha256 == info.sha256 and tokenizer_identity(str(hf_tokenizer)) == (
        HUGGINGFACE,
        info.sha256,
    )
    assert ours.encode_batch(["中国"], add_eos=True) == [[*ours.encode("中国"), ours.eos_id]]


def test_special_tokens_map_names_what_the_config_leaves_out(hf_tokenizer, tmp_path):
    shutil.copy(hf_tokenizer / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": PAD, "pad_token": PAD}))
    tok = Tokenizer(tmp_path)
    assert (tok.eos_id, tok.pad_id) == (tok.encode(EOS)[0], tok.encode(PAD)[0])


def test_the_identity_changes_with_the_special_tokens(hf_tokenizer, tmp_path):
    """Another EOS makes other shards from the same tokenizer.json: the trainer must see it."""
    shutil.copy(hf_tokenizer / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": PAD}))
    assert Tokenizer(tmp_path).info().sha256 != Tokenizer(hf_tokenizer).info().sha256


@pytest.mark.s3
def test_a_folder_and_a_file_on_s3(s3_bucket, hf_tokenizer):
    from storage import open_store

    store = open_store(f"s3://{s3_bucket}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        store.upload(hf_tokenizer / name, f"tok/{name}")
    local = Tokenizer(hf_tokenizer).info().sha256
    assert Tokenizer(f"s3://{s3_bucket}/tok").info().sha256 == local
    assert Tokenizer(f"s3://{s3_bucket}/tok/tokenizer.json").info().sha256 == local


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("content", [b"not a tokenizer at all", b'{"eos_token": "</s>"}', b"\x00\x01\x02"])
def test_a_file_of_neither_format_is_one_line(tmp_path, content):
    bad = tmp_path / "tok.json"
    bad.write_bytes(content)
    with pytest.raises(ShardsError) as err:
        Tokenizer(bad)
    assert "is neither a SentencePiece .model file nor a Hugging Face tokenizer.json" in _one_line(err)


def test_a_tokenizer_json_without_eos_is_refused_for_shards(hf_tokenizer, tmp_path):
    tok = Tokenizer(copy_without_eos(hf_tokenizer, tmp_path / "no-eos"))
    assert tok.eos_id is None
    with pytest.raises(ShardsError) as err:
        tok.info()
    assert "names no EOS token: set eos_token in the tokenizer_config.json" in _one_line(err)


def test_a_special_token_the_vocabulary_lacks_is_named(hf_tokenizer, tmp_path):
    shutil.copy(hf_tokenizer / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ShardsError) as err:
        Tokenizer(tmp_path)
    assert "names eos_token '</s>', which its tokenizer.json does not hold" in _one_line(err)


def test_a_folder_without_a_tokenizer_names_a_file_inside(tmp_path):
    (tmp_path / "mine.model").write_bytes(b"x")
    with pytest.raises(ShardsError) as err:
        Tokenizer(tmp_path)
    assert "is a folder with neither tokenizer.json nor tokenizer.model; give the tokenizer's file" in (
        _one_line(err)
    ) and str(tmp_path / "mine.model") in str(err.value)


def test_without_the_tokenizers_library_the_extra_is_named(hf_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ShardsError) as err:
        Tokenizer(hf_tokenizer)
    assert "install the hf extra, pip install -e '.[hf]'" in _one_line(err)
