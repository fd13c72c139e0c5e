"""The demo corpus: real Chinese articles, no POS tags left, the same every time."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from convert.demo import corpus as demo_corpus
from convert.demo.corpus import (
    group_articles,
    parse_tagged_line,
    peoples_daily_documents,
    review_sentences,
    write_demo_corpus,
)
from convert.errors import ConvertError

CJK = re.compile(r"[\u4e00-\u9fff]")
POS_TAG = re.compile(r"/[A-Za-z]{1,3}\b|\][a-z]{1,3}\b")


def test_peoples_daily_is_real_chinese_without_tags(chinese_documents):
    assert len(chinese_documents) > 2000
    text = "".join(chinese_documents)
    assert 1_500_000 < len(text) < 2_500_000
    assert len(CJK.findall(text)) / len(text) > 0.75
    assert not POS_TAG.search(text)
    assert "  " not in text and " " not in chinese_documents[0]  # words joined without spaces
    assert chinese_documents[0].startswith("迈向充满希望的新世纪——一九九八年新年讲话")


def test_articles_start_at_headlines(chinese_documents):
    titles = [doc.split("\n", 1)[0] for doc in chinese_documents[:4]]
    assert titles == [
        "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）",
        "在十五大精神指引下胜利前进——元旦献辞",
        "北京举行新年音乐会",
        "李鹏在北京考察企业",
    ]
    assert len(set(chinese_documents)) == len(chinese_documents)


def test_parsing_is_deterministic(chinese_documents):
    demo_corpus._peoples_daily.cache_clear()
    assert peoples_daily_documents() == chinese_documents


def test_lines_with_ids_and_bracketed_names_group_by_article():
    lines = [
        "19980101-01-001-001/m  迈向/v  [中央/n  电视台/n]nt  ！/w",
        "19980101-01-001-002/m  ５/m  张/q",
        "19980101-01-002-001/m  北京/ns  音乐会/n",
    ]
    parsed = [parse_tagged_line(line) for line in lines]
    assert parsed[0] == ("19980101-01-001", "迈向中央电视台！")
    assert list(group_articles(parsed)) == [["迈向中央电视台！", "５张"], ["北京音乐会"]]


def test_review_sentences_alternate_and_are_distinct():
    reviews = review_sentences()
    assert len(reviews) > 15_000 and len(set(reviews)) == len(reviews)
    assert review_sentences(3) == reviews[:3]
    assert "杜拉拉" in reviews[2]  # pos line 2, after pos 1 and neg 1


def test_write_demo_corpus_writes_json_lines_atomically(tmp_path, chinese_documents):
    out = tmp_path / "demo" / "corpus.jsonl"
    summary = write_demo_corpus(out, max_chars=200_000)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    texts = [r["text"] for r in records]
    assert summary == {"documents": len(texts), "chars": sum(map(len, texts))}
    assert 150_000 < summary["chars"] <= 200_000
    assert texts == chinese_documents[: len(texts)]
    assert [p.name for p in out.parent.iterdir()] == ["corpus.jsonl"]  # no temp file left


def test_full_demo_corpus_has_articles_then_reviews(tmp_path, chinese_documents):
    out = tmp_path / "corpus.jsonl"
    summary = write_demo_corpus(out)
    texts = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert texts == chinese_documents + review_sentences()
    assert summary["documents"] == len(texts) and summary["chars"] > 3_000_000


def test_cli_subcommand(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo_corpus.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "c.jsonl"), "--max-chars", "5000"])
    assert demo_corpus.run(args) == 0
    assert "documents" in capsys.readouterr().out
    assert (tmp_path / "c.jsonl").exists()
    assert demo_corpus.main(["--out", str(tmp_path / "d.jsonl"), "--max-chars", "0"]) == 2
    assert "--max-chars must be positive" in capsys.readouterr().err


def test_non_positive_max_chars_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="--max-chars"):
        write_demo_corpus(tmp_path / "c.jsonl", max_chars=-5)
    assert not (tmp_path / "c.jsonl").exists()
