"""Corpora as they are published: dataset folders (a Hugging Face Hub snapshot, a Spark output,
locally and under an S3 prefix), nested text fields, the Parquet reader's rows; and bad input,
each one line and exit 2 or a counted per-file warning (a missing or non-text column, a truncated
Parquet file, a corrupt row group, a folder with nothing readable, pyarrow not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from convert.cli import main
from convert.errors import ConvertError
from convert.reading.readers import ReadStats, read_documents
from convert.reading.sources import expand_corpus
from tests.support.corpus import write_jsonl, write_parquet

pytest.importorskip("pyarrow")  # the parquet extra


@pytest.fixture(scope="module")
def docs(chinese_documents) -> list[str]:
    return chinese_documents[:30]


def read(paths, fmt="auto", **kwargs):
    stats = ReadStats()
    found = list(read_documents([str(p) for p in paths], fmt, stats=stats, **kwargs))
    return found, stats


def names(paths: list[str], root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p in paths]


# --- folders -------------------------------------------------------------------------------------


def hub_snapshot(root: Path, docs: list[str]) -> Path:
    """A Hub dataset as `huggingface-cli download` leaves it: a card, metadata, two configs."""
    for i in range(3):
        write_parquet(
            root / f"data/train-0000{i}-of-00003.parquet", docs[i * 5 : i * 5 + 5], row_group_size=2
        )
    write_parquet(root / "data/test-00000-of-00001.parquet", docs[15:18], row_group_size=2)
    write_parquet(root / "zh/train/0000.parquet", docs[18:20], row_group_size=2)
    (root / "README.md").write_text("---\nconfigs: ...\n---\n# card\n")
    (root / "dataset_info.json").write_text("{}")
    (root / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (root / ".cache/huggingface/download").mkdir(parents=True)
    (root / ".cache/huggingface/download/data.lock").write_text("")
    return root


def spark_output(root: Path, docs: list[str]) -> Path:
    for i in range(2):
        name = f"part-0000{i}-8c2f-4b1e.c000.snappy.parquet"
        write_parquet(root / name, docs[i * 4 : i * 4 + 4], row_group_size=3)
        (root / f".{name}.crc").write_bytes(b"crc")
    (root / "_SUCCESS").write_bytes(b"")
    (root / "_committed_123").write_text("{}")
    return root


def test_a_hub_snapshot_expands_to_its_parquet_files_sorted_with_the_rest_counted(tmp_path, docs):
    root = hub_snapshot(tmp_path / "hub", docs)
    corpus = expand_corpus([str(root)], "auto")
    assert names(corpus.paths, root) == [
        "data/test-00000-of-00001.parquet", *(f"data/train-0000{i}-of-00003.parquet" for i in range(3)),
        "zh/train/0000.parquet",
    ]  # fmt: skip
    assert corpus.notes == [
        f"input {root}: 5 file(s) to read, 4 skipped: 4 marker or metadata file(s) "
        "(data.lock, .gitattributes, README.md and 1 more)"
    ]
    train = expand_corpus([str(root / "data/train-*")], "auto")
    assert names(train.paths, root) == [f"data/train-0000{i}-of-00003.parquet" for i in range(3)]
    assert train.notes == []
    texts = [doc.text for doc in read(train.paths)[0]]
    assert texts == docs[:15]


def test_a_spark_output_folder_skips_success_and_crc_files(tmp_path, docs):
    root = spark_output(tmp_path / "spark", docs)
    corpus = expand_corpus([str(root)], "parquet")
    assert names(corpus.paths, root) == [f"part-0000{i}-8c2f-4b1e.c000.snappy.parquet" for i in range(2)]
    assert "4 marker or metadata file(s)" in corpus.notes[0]
    assert [doc.text for doc in read(corpus.paths)[0]] == docs[:8]


@pytest.mark.s3
def test_an_s3_prefix_expands_as_the_local_folder(tmp_path, s3_server, s3_bucket, docs):
    root = spark_output(tmp_path / "spark", docs)
    client = s3_server.client()
    for path in sorted(root.rglob("*")):
        client.put_object(Bucket=s3_bucket, Key=f"out/{path.relative_to(root)}", Body=path.read_bytes())
    corpus = expand_corpus([f"s3://{s3_bucket}/out/"], "auto")
    assert [p.split("/out/", 1)[1] for p in corpus.paths] == names(
        expand_corpus([str(root)], "auto").paths, root
    )
    assert [doc.text for doc in read(corpus.paths)[0]] == docs[:8]


def test_a_folder_of_mixed_formats_is_refused_unless_format_chooses(tmp_path, docs):
    write_parquet(tmp_path / "mix/a.parquet", docs[:3], row_group_size=2)
    write_jsonl(tmp_path / "mix/b.jsonl", docs[3:6])
    write_jsonl(tmp_path / "mix/c.json", docs[6:9])
    with pytest.raises(ConvertError) as err:
        expand_corpus([str(tmp_path / "mix")], "auto")
    assert str(err.value) == (
        f"input {tmp_path / 'mix'} mixes formats (1 Parquet, 2 JSON files); "
        "pass --format parquet or --format jsonl to take one of them"
    )
    assert "\n" not in str(err.value)
    parquet = expand_corpus([str(tmp_path / "mix")], "parquet")
    assert names(parquet.paths, tmp_path / "mix") == ["a.parquet"]
    assert parquet.notes == [
        f"input {tmp_path / 'mix'}: 1 file(s) to read, 2 skipped: 2 of another or unknown format (b.jsonl, c.json)"
    ]
    assert names(expand_corpus([str(tmp_path / "mix")], "jsonl").paths, tmp_path / "mix") == [
        "b.jsonl",
        "c.json",
    ]
    # One format and --format given: every file as that format (an extension-less part file too).
    write_jsonl(tmp_path / "one/part-00000", docs[:3])
    write_jsonl(tmp_path / "one/b.jsonl", docs[3:6])
    assert names(expand_corpus([str(tmp_path / "one")], "jsonl").paths, tmp_path / "one") == [
        "b.jsonl",
        "part-00000",
    ]
    assert names(expand_corpus([str(tmp_path / "one")], "auto").paths, tmp_path / "one") == ["b.jsonl"]


def test_a_folder_with_nothing_readable_is_one_line_and_exit_2(tmp_path, capsys, small_tokenizer):
    folder = tmp_path / "done"
    folder.mkdir()
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / "README.md").write_text("# card\n")
    (folder / "notes.bin").write_bytes(b"\x00")
    code = main(
        ["shards", str(folder), "--tokenizer", small_tokenizer, "--out", str(tmp_path / "o"), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        f"error: input {folder} holds nothing readable: 3 skipped: 2 marker or metadata file(s)"
    )
    assert "of another or unknown format (notes.bin)" in err and "or pass --format" in err
    assert not (tmp_path / "o").exists()


# --- text fields ---------------------------------------------------------------------------------


def test_a_nested_json_field_is_a_dotted_path(tmp_path, docs):
    path = tmp_path / "nested.jsonl"
    records = [{"id": 0, "content": {"text": docs[0]}}, {"content": {"title": "x"}}, {"content": "flat"},
               {"content.text": docs[1]}, {"content": {"text": docs[2]}}]  # fmt: skip
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    found, stats = read([path], text_field="content.text")
    assert [(doc.text, doc.line) for doc in found] == [(docs[0], 1), (docs[1], 4), (docs[2], 5)]
    assert [line for _, line, _ in stats.malformed_examples] == [2, 3]
    assert "text field 'content.text' is missing" in stats.malformed_examples[0][2]


def test_parquet_rows_nulls_empties_and_bad_utf8_are_counted_by_row(tmp_path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(bytes([0, 0, 0, 0, 3, 0, 0, 0])),
                                                 pa.py_buffer(b"a\xffb")])  # fmt: skip
    column = pa.chunked_array([pa.array([docs[0], None, "", docs[1]]), bad, pa.array([docs[2]])])
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": column}), path, row_group_size=2)
    found, stats = read([path])
    assert [(doc.text, doc.line) for doc in found] == [(docs[0], 1), ("", 3), (docs[1], 4), (docs[2], 6)]
    assert stats.malformed_examples == [
        (str(path), 2, "text field 'text' is null"),
        (str(path), 5, "invalid UTF-8 (byte 0xff at byte 2 of the text)"),
    ]


def test_only_the_text_column_is_read(tmp_path, docs):
    """A column that pyarrow cannot decode at all (a corrupt page header) does not stop the text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "two.parquet"
    pq.write_table(pa.table({"other": ["x" * 50] * 4, "text": docs[:4]}), path, use_dictionary=False)
    other = pq.ParquetFile(path).metadata.row_group(0).column(0)
    data = bytearray(path.read_bytes())
    data[other.data_page_offset : other.data_page_offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="thrift"):
        pq.read_table(path)
    assert [doc.text for doc in read([path])[0]] == docs[:4]


def test_a_corrupt_row_group_is_counted_and_the_others_read(tmp_path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(
        pa.table({"text": docs[:12]}), path, row_group_size=4, use_dictionary=False, compression="zstd"
    )
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    data[column.data_page_offset : column.data_page_offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    found, stats = read([path])
    assert [doc.text for doc in found] == docs[:4] + docs[8:12]
    ((source, line, reason),) = stats.malformed_examples
    assert (source, line) == (str(path), 5) and reason.startswith("corrupt Parquet data (")
    assert reason.endswith("in row group 1; the rest of the row group is skipped")


def test_a_truncated_parquet_file_is_a_counted_warning(tmp_path, docs):
    whole = write_parquet(tmp_path / "whole.parquet", docs[:6], row_group_size=2)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size - 100])
    found, stats = read([cut, whole])
    assert [doc.text for doc in found] == docs[:6]
    assert stats.malformed_examples == [
        (str(cut), 0, "not a readable Parquet file (Parquet magic bytes not found in footer. Either the file is "
                      "corrupted or this is not a parquet file.); the file is skipped")
    ]  # fmt: skip


# --- one line and exit 2 -------------------------------------------------------------------------


def shards(tmp_path, small_tokenizer, *args: str) -> list[str]:
    out = tmp_path / "out"
    code = main(
        [
            "shards",
            *args,
            "--tokenizer",
            small_tokenizer,
            "--out",
            str(out),
            "--no-progress",
            "--workers",
            "1",
        ]
    )
    return code


def test_a_missing_column_lists_the_columns_there_are(tmp_path, docs, capsys, small_tokenizer):
    path = write_parquet(tmp_path / "a.parquet", docs[:4], row_group_size=2)
    assert shards(tmp_path, small_tokenizer, str(path), "--field", "body") == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {path} has no column 'body'; its columns: id (int64), text (string), content.text (string), "
        "content.lang (string), dict_text (dictionary<values=string, indices=int32, ordered=0>), large_text "
        "(large_string); name the text column with --field (a dotted path for a nested one)\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_column_that_is_not_text_is_one_line(tmp_path, docs, capsys, small_tokenizer):
    path = write_parquet(tmp_path / "a.parquet", docs[:4], row_group_size=2)
    assert shards(tmp_path, small_tokenizer, str(path), "--field", "id") == 2
    assert capsys.readouterr().err == (
        f"error: column 'id' of {path} holds int64, not text; its text columns: text, content.text, "
        "content.lang, dict_text, large_text; name one with --field\n"
    )
    assert shards(tmp_path, small_tokenizer, str(path), "--preset", "c4-zh") == 2
    assert capsys.readouterr().err == (
        f"error: {path} is Parquet, and --preset c4-zh reads JSON records; name its text column with --field\n"
    )


@pytest.mark.slow  # a worker process
def test_a_truncated_parquet_file_alone_is_one_line_and_exit_2(tmp_path, docs, capsys, small_tokenizer):
    whole = write_parquet(tmp_path / "whole.parquet", docs[:6], row_group_size=2)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[:-100])
    assert shards(tmp_path, small_tokenizer, str(cut)) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: no documents found in {cut} (format auto); 1 malformed, first at {cut}:0: "
                          "not a readable Parquet file")  # fmt: skip


WITHOUT_PYARROW = textwrap.dedent(
    """
    import sys
    sys.modules["pyarrow"] = None  # as if it were not installed: `import pyarrow` raises ImportError
    from convert.cli import main
    from convert.reading.readers import ReadStats, read_documents

    stats = ReadStats()
    print(len(list(read_documents(sys.argv[1:5], "auto", stats=stats))))
    for path in sys.argv[5:]:
        print(main(["shards", path, "--tokenizer", "unused.model", "--out", "unused", "--no-progress"]))
    """
)


@pytest.mark.slow  # a process
def test_without_pyarrow_other_formats_read_and_parquet_and_zstd_are_one_line(tmp_path, docs):
    import bz2
    import gzip
    import lzma

    from tests.support.conversion import REPO_ROOT

    plain = tmp_path / "a.jsonl"
    write_jsonl(plain, docs[:5])
    packed = []
    for suffix, compress in ((".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)):
        packed.append(tmp_path / f"a.jsonl{suffix}")
        packed[-1].write_bytes(compress(plain.read_bytes()))
    parquet = write_parquet(tmp_path / "b.parquet", docs[:5], row_group_size=2)
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(b"(\xb5/\xfd")  # never opened: pyarrow is asked for first
    args = [str(p) for p in (plain, *packed, parquet, zst)]
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYARROW, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["20", "2", "2"]
    assert result.stderr.splitlines() == [
        f"error: reading Parquet ({parquet}) needs pyarrow, which is not installed: add the parquet extra, "
        "pip install -e '.[parquet]'",
        f"error: reading zstd-compressed files ({zst}) needs pyarrow, which is not installed: add the parquet "
        "extra, pip install -e '.[parquet]'",
    ]
