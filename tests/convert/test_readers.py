"""Corpus readers: every format and preset yields the right documents; bad input is counted."""

from __future__ import annotations

import gzip
import json

import pytest

from convert.errors import ConvertError
from convert.reading import readers
from convert.reading.presets import PRESETS, get_preset
from convert.reading.readers import Document, ReadStats, read_documents
from tests.support.corpus import PRESET_WRITERS, write_json_list, write_jsonl, write_txt, write_txt_blank


def read(paths, fmt, **kwargs) -> tuple[list[Document], ReadStats]:
    stats = ReadStats()
    docs = list(read_documents([str(p) for p in paths], fmt, stats=stats, **kwargs))
    return docs, stats


@pytest.fixture(scope="module")
def docs(chinese_documents) -> list[str]:
    return chinese_documents[:12]


# --- formats -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("writer", "fmt", "name"),
    [
        (write_txt, "txt", "corpus.txt"),
        (write_txt_blank, "txt-blank", "corpus.txt"),
        (write_json_list, "json", "corpus.json"),
        (write_jsonl, "jsonl", "corpus.jsonl"),
    ],
)
def test_each_format_reads_the_documents_in_order(tmp_path, docs, writer, fmt, name):
    expected = writer(tmp_path / name, docs)
    out, stats = read([tmp_path / name], fmt)
    assert [d.text for d in out] == expected
    assert stats.documents == len(expected) and stats.files == 1 and stats.malformed == 0
    assert all(d.source == str(tmp_path / name) for d in out)


def test_line_numbers_point_at_the_document(tmp_path, docs):
    write_txt_blank(tmp_path / "a.txt", docs[:3])
    out, _ = read([tmp_path / "a.txt"], "txt-blank")
    lines = (tmp_path / "a.txt").read_text(encoding="utf-8").splitlines()
    for doc in out:
        assert doc.text.startswith(lines[doc.line - 1].rstrip("\r"))
    write_json_list(tmp_path / "b.json", docs[:3])
    assert [d.line for d in read([tmp_path / "b.json"], "json")[0]] == [1, 2, 3]


def test_auto_format_guesses_from_extension_and_first_character(tmp_path, docs):
    expected = []
    expected += write_txt(tmp_path / "a.txt", docs[:2])
    expected += write_jsonl(tmp_path / "b.jsonl", docs[2:4])
    expected += write_json_list(tmp_path / "c.json", docs[4:6])
    expected += write_jsonl(tmp_path / "d.json", docs[6:8])  # JSON lines named .json, as baidubaike
    paths = [tmp_path / n for n in ("a.txt", "b.jsonl", "c.json", "d.json")]
    out, stats = read(paths, "auto")
    assert [d.text for d in out] == expected and stats.malformed == 0


def test_auto_format_refuses_an_unknown_extension(tmp_path, docs):
    write_jsonl(tmp_path / "corpus.data", docs[:2])
    with pytest.raises(ConvertError, match=r"corpus\.data.*--format"):
        read([tmp_path / "corpus.data"], "auto")


def test_gzip_files_are_read_transparently(tmp_path, docs):
    expected = write_jsonl(tmp_path / "c.jsonl", docs[:5])
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress((tmp_path / "c.jsonl").read_bytes()))
    out, _ = read([tmp_path / "c.jsonl.gz"], "auto")
    assert [d.text for d in out] == expected


def test_json_list_is_decoded_incrementally_across_chunk_boundaries(tmp_path, docs, monkeypatch):
    # Tiny reads force every item (multi-byte UTF-8 included) to straddle buffer refills.
    monkeypatch.setattr(readers, "_JSON_CHUNK_BYTES", 7)
    expected = write_json_list(tmp_path / "c.json", docs)
    out, stats = read([tmp_path / "c.json"], "json")
    assert [d.text for d in out] == expected and stats.malformed == 0
    # Non-object items are counted one by one, even numbers cut by a refill.
    (tmp_path / "n.json").write_text('[12345678, {"text": "好"}, 98765432]', encoding="utf-8")
    out, stats = read([tmp_path / "n.json"], "json")
    assert [d.text for d in out] == ["好"] and [line for _, line, _ in stats.malformed_examples] == [1, 3]


def test_bad_options_are_refused_before_reading_starts():
    with pytest.raises(ConvertError, match="unknown format 'csv'"):
        read_documents(["x.csv"], "csv", stats=ReadStats())  # no iteration needed
    with pytest.raises(ConvertError, match="no input files"):
        read_documents([], "jsonl", stats=ReadStats())


# --- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESET_WRITERS))
def test_each_preset_reads_its_real_layout(tmp_path, docs, name):
    expected = PRESET_WRITERS[name](tmp_path / f"{name}.json", docs)
    for fmt in ("auto", get_preset(name).fmt):
        out, stats = read([tmp_path / f"{name}.json"], fmt, preset=name)
        assert [d.text for d in out] == expected, fmt
        assert stats.malformed == 0


def test_wudao_preset_also_reads_json_lines(tmp_path, docs):
    lines = [json.dumps({"title": "标题", "content": d}, ensure_ascii=False) for d in docs[:3]]
    (tmp_path / "wudao.json").write_text("\n".join(lines), encoding="utf-8")
    out, _ = read([tmp_path / "wudao.json"], "auto", preset="wudao")
    assert [d.text for d in out] == [f"标题\n{d}" for d in docs[:3]]


def test_baidubaike_tolerates_missing_and_null_parts():
    extract = PRESETS["baidubaike"].extract
    assert extract({"title": "长城", "summary": None, "sections": None}) == "长城"
    assert extract({"sections": [{"title": None, "content": "内容"}, "bad", {"content": 3}]}) == "内容"
    assert extract({"title": None, "summary": None}) is None


def test_preset_record_without_text_is_counted_as_malformed(tmp_path, docs):
    records = [{"completion": docs[0]}, {"text": "wrong field"}, {"completion": None}]
    (tmp_path / "w.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    out, stats = read([tmp_path / "w.json"], "auto", preset="wiki-cn")
    assert [d.text for d in out] == [docs[0]]
    assert [(line, "wiki-cn" in reason) for _, line, reason in stats.malformed_examples] == [
        (2, True),
        (3, True),
    ]


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(
        ConvertError, match="unknown preset 'wiki'.*wiki-cn, baidubaike, c4-zh, wudao, medical"
    ):
        get_preset("wiki")


def test_preset_and_text_field_together_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="drop --text-field"):
        read([tmp_path / "x.json"], "auto", preset="c4-zh", text_field="body")


# --- malformed input ---------------------------------------------------------------------------


def test_malformed_json_lines_are_counted_with_file_and_line(tmp_path, docs):
    good = [json.dumps({"text": d}, ensure_ascii=False) for d in docs[:3]]
    path = tmp_path / "bad.jsonl"
    lines = [
        good[0],
        '{"text": "unterminated',
        good[1],
        "[1, 2]",
        '{"body": "x"}',
        '{"text": 5}',
        "",
        good[2],
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, stats = read([path], "jsonl")
    assert [d.text for d in out] == docs[:3]
    assert [d.line for d in out] == [1, 3, 8]
    assert stats.malformed == 4
    found = [(source, line) for source, line, _ in stats.malformed_examples]
    assert found == [(str(path), 2), (str(path), 4), (str(path), 5), (str(path), 6)]
    reasons = [reason for _, _, reason in stats.malformed_examples]
    assert "invalid JSON" in reasons[0]
    assert "expected a JSON object, got a list" in reasons[1]
    assert "'text' is missing" in reasons[2]
    assert "not a string" in reasons[3]


def test_json_lines_the_fast_parser_refuses_read_as_json_reads_them(tmp_path):
    """A byte order mark, NaN, a lone surrogate escape, a huge integer, CRLF and blank lines:
    what Python's json accepts is a document, whichever parser took the line."""
    path = tmp_path / "edge.jsonl"
    lines = [
        b'\xef\xbb\xbf{"text": "bom"}',
        b'{"text": "nan", "score": NaN}',
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "big", "id": 123456789012345678901234567890}',
        b'{"text": "crlf"}\r',
        b"   ",
        b'{"text": "plain \xe4\xb8\xad"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    out, stats = read([path], "jsonl")
    assert [d.text for d in out] == ["bom", "nan", "lone \ud800 surrogate", "big", "crlf", "plain 中"]
    assert [d.line for d in out] == [1, 2, 3, 4, 5, 7]
    assert stats.malformed == 0


def test_strict_mode_raises_naming_file_and_line(tmp_path, docs):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": docs[0]}, ensure_ascii=False) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(ConvertError, match=rf"{path}:2: invalid JSON.*fix the line or drop --strict"):
        read([path], "jsonl", strict=True)


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_invalid_utf8_line_is_counted_and_skipped(tmp_path, docs, fmt):
    path = tmp_path / f"c.{fmt}"
    lines = [d.splitlines()[0] for d in docs[:2]]
    good = lines if fmt == "txt" else [json.dumps({"text": d}, ensure_ascii=False) for d in lines]
    broken = "坏行".encode()[:-1]  # a UTF-8 sequence cut in the middle
    path.write_bytes(good[0].encode() + b"\n" + broken + b"\n" + good[1].encode() + b"\n")
    out, stats = read([path], fmt)
    assert [d.text for d in out] == lines and [d.line for d in out] == [1, 3]
    assert stats.malformed == 1 and stats.malformed_examples[0][:2] == (str(path), 2)
    assert "invalid UTF-8" in stats.malformed_examples[0][2]


def test_invalid_utf8_inside_a_json_list_item_skips_only_that_item(tmp_path, docs):
    items = [json.dumps({"text": d}, ensure_ascii=False).encode() for d in docs[:3]]
    items[1] = items[1][:12] + b"\xff" + items[1][12:]
    (tmp_path / "c.json").write_bytes(b"[" + b",\n".join(items) + b"]")
    out, stats = read([tmp_path / "c.json"], "json")
    assert [d.text for d in out] == [docs[0], docs[2]]
    assert stats.malformed_examples[0][1] == 2 and "invalid UTF-8" in stats.malformed_examples[0][2]


def test_broken_json_list_keeps_the_items_before_the_break(tmp_path, docs):
    text = json.dumps([{"text": d} for d in docs[:2]], ensure_ascii=False)[:-1] + ', {"text": oops}]'
    (tmp_path / "c.json").write_text(text, encoding="utf-8")
    out, stats = read([tmp_path / "c.json"], "json")
    assert [d.text for d in out] == docs[:2]
    assert stats.malformed == 1 and "item 3" in stats.malformed_examples[0][2]


def test_json_object_instead_of_list_points_to_jsonl(tmp_path, docs):
    (tmp_path / "c.json").write_text(json.dumps({"text": docs[0]}), encoding="utf-8")
    with pytest.raises(ConvertError, match="expected a JSON list.*--format jsonl"):
        read([tmp_path / "c.json"], "json", strict=True)


def test_malformed_examples_keep_the_first_twenty(tmp_path, docs):
    path = tmp_path / "c.jsonl"
    path.write_text("not json\n" * 30 + json.dumps({"text": docs[0]}) + "\n", encoding="utf-8")
    _, stats = read([path], "jsonl")
    assert stats.malformed == 30 and len(stats.malformed_examples) == 20
    assert stats.as_dict()["malformed_examples"][0] == {
        "source": str(path),
        "line": 1,
        "reason": stats.malformed_examples[0][2],
    }


def test_empty_corpus_is_an_error_naming_the_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n', encoding="utf-8")
    with pytest.raises(ConvertError, match=r"no documents found in .*empty\.jsonl.*first at .*bad\.jsonl:1"):
        read([tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"], "jsonl")
    docs, stats = read([tmp_path / "empty.jsonl"], "jsonl", allow_empty=True)
    assert docs == [] and stats.files == 1


def test_reading_is_lazy(tmp_path, docs):
    # A generator that opens files only as it reaches them keeps memory bounded by one file.
    write_jsonl(tmp_path / "a.jsonl", docs[:2])
    stats = ReadStats()
    stream = read_documents(
        [str(tmp_path / "a.jsonl"), str(tmp_path / "missing.jsonl")], "jsonl", stats=stats
    )
    assert next(stream).text == docs[0] and stats.files == 1
