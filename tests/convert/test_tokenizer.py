"""Tokenizer training (Baichuan-7B settings, deterministic) and loading existing models."""

from __future__ import annotations

import hashlib
import os

import pytest
import sentencepiece as spm

from convert.errors import ConvertError
from convert.tokens.tokenizer import train_tokenizer
from shards.errors import ShardsError
from shards.tokenizer import Tokenizer, TokenizerInfo
from tests.support.conversion import run_convert


def test_training_is_deterministic_and_atomic(tmp_path, chinese_documents):
    texts = chinese_documents[:200]
    first = train_tokenizer(texts, vocab_size=2000, out=str(tmp_path / "a.model"), character_coverage=0.98)
    second = train_tokenizer(texts, vocab_size=2000, out=str(tmp_path / "b.model"), character_coverage=0.98)
    assert first.sha256 == second.sha256
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert first.sha256 == hashlib.sha256((tmp_path / "a.model").read_bytes()).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["a.model", "b.model"]  # no temporary file left behind


def test_baichuan_settings(small_tokenizer):
    sp = spm.SentencePieceProcessor(model_file=small_tokenizer)
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert sp.vocab_size() == 2000
    # Digits are split one per token, even "１９９８", the most frequent year in the corpus.
    assert sp.encode("１９９８年", out_type=str) == ["１", "９", "９", "８", "年"]
    # Byte fallback: a character never seen becomes byte pieces, never <unk>.
    ids = sp.encode("🦙")
    assert sp.unk_id() not in ids and len(ids) == 4
    assert sp.decode(ids) == "🦙"


def test_too_small_vocab_is_one_clear_error(tmp_path, chinese_documents):
    with pytest.raises(ConvertError, match="--vocab-size 600 is too small.*--character-coverage"):
        train_tokenizer(chinese_documents[:100], vocab_size=600, out=str(tmp_path / "t.model"))
    assert not (tmp_path / "t.model").exists()


def test_existing_model_ids_are_read_not_assumed(tmp_path, chinese_documents):
    """A model with other special ids (no BOS, EOS=1) is described by what it holds."""
    path = tmp_path / "other.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(chinese_documents[:100]),
        model_prefix=str(tmp_path / "other"),
        vocab_size=2000,
        character_coverage=0.98,
        model_type="bpe",
        unk_id=0,
        bos_id=-1,
        eos_id=1,
        minloglevel=2,
    )
    info = Tokenizer(str(path)).info()
    assert (info.vocab_size, info.eos_id, info.bos_id) == (2000, 1, -1)


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(ShardsError, match="nope.model does not exist"):
        Tokenizer(str(tmp_path / "nope.model"))


def test_not_a_model_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("hello")
    with pytest.raises(
        ShardsError, match="neither a SentencePiece .model file nor a Hugging Face tokenizer.json"
    ):
        Tokenizer(str(bad))


def test_dtype_choice():
    small = TokenizerInfo("t", "x", 65536, 2, 1)
    big = TokenizerInfo("t", "x", 65537, 2, 1)
    assert small.token_dtype("auto") == "uint16"
    assert big.token_dtype("auto") == "uint32"
    assert big.token_dtype("uint32") == "uint32"
    with pytest.raises(ShardsError, match="--dtype uint16 cannot hold"):
        big.token_dtype("uint16")


def test_cli_trains_and_prints_sha(tmp_path, small_corpus_docs):
    from tests.support.corpus import write_txt

    corpus = tmp_path / "c.txt"
    write_txt(corpus, small_corpus_docs[:200])
    out = tmp_path / "tok.model"
    args = [
        "tokenizer",
        str(corpus),
        "--vocab-size",
        "2000",
        "--character-coverage",
        "0.98",
        "--out",
        str(out),
    ]
    result = run_convert(*args)
    assert result.returncode == 0, result.stderr
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert f"vocab size 2000, sha256 {sha}" in result.stdout
    again = run_convert(*args)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == sha, again.stderr
