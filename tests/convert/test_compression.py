"""Compressed corpus files: gzip, zstd, bzip2 and xz, each written by a real compressor (the standard
library; zstd by pyarrow and by libzstd through the `zstd` module, several members or frames per
file), decompressed on the fly: the golden record's bytes, the format guessed under the suffix,
and a truncated or corrupt stream counted once with the rest of the file skipped."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest

from convert.errors import ConvertError
from convert.reading.readers import ReadStats, read_documents
from tests.support.corpus import write_json_list, write_jsonl, write_txt

pytest.importorskip("pyarrow")  # zstd (the parquet extra)


def _zstd(data: bytes) -> bytes:
    """Two frames: pyarrow's stream writer, then libzstd's one-shot compressor (streaming's `zstd`)."""
    import pyarrow as pa
    import zstd

    half = data.rfind(b"\n", 0, len(data) // 2) + 1
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data[:half])
    return sink.getvalue().to_pybytes() + zstd.compress(data[half:], 3)


def _members(compress):
    """A compressor of two members (how pigz, pbzip2 and parallel xz write), each of half the data."""

    def both(data: bytes) -> bytes:
        half = data.rfind(b"\n", 0, len(data) // 2) + 1
        return compress(data[:half]) + compress(data[half:])

    return both


COMPRESSORS = {
    ".gz": ("gzip", _members(gzip.compress)),
    ".zst": ("zstd", _zstd),
    ".bz2": ("bzip2", _members(bz2.compress)),
    ".xz": ("xz", _members(lzma.compress)),
}


def compressed(path: Path, suffix: str) -> Path:
    target = path.with_name(path.name + suffix)
    target.write_bytes(COMPRESSORS[suffix][1](path.read_bytes()))
    return target


def read(paths, fmt="auto", **kwargs):
    stats = ReadStats()
    return [doc.text for doc in read_documents([str(p) for p in paths], fmt, stats=stats, **kwargs)], stats


@pytest.fixture(scope="module")
def docs(chinese_documents) -> list[str]:
    return chinese_documents[:40]


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_each_compression_gives_the_json_lines_record(chinese_documents, small_tokenizer, tmp_path, suffix):
    from tests.support.golden import RECORD, convert, digests, write_corpus

    inputs = [str(compressed(Path(p), suffix)) for p in write_corpus(tmp_path, chinese_documents)]
    summary = convert(inputs, small_tokenizer, tmp_path / "out", False, (1, False))
    assert digests(tmp_path / "out") == json.loads(RECORD.read_text())["cases"]["plain"]
    assert summary.read["malformed_examples"][0]["line"] == 19  # the line numbers of the plain file


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_the_format_is_guessed_under_the_suffix(tmp_path, docs, suffix):
    lines = write_txt(tmp_path / "a.txt", docs[:5])
    write_json_list(tmp_path / "b.json", docs[5:10])  # a list: `[` first
    write_jsonl(tmp_path / "c.json", docs[10:15])  # JSON lines named .json
    paths = [compressed(tmp_path / name, suffix) for name in ("a.txt", "b.json", "c.json")]
    texts, stats = read(paths)
    assert texts == lines + docs[5:15] and stats.malformed == 0


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_a_truncated_stream_is_one_counted_warning_and_the_documents_before_it(
    tmp_path, docs, monkeypatch, suffix
):
    """What was decompressed before the cut is read, but for a buffer (1 MiB; 4 KiB here)."""
    from convert.reading import compression

    monkeypatch.setattr(compression, "BUFFER_BYTES", 4096)
    name, compress = COMPRESSORS[suffix]
    write_jsonl(tmp_path / "a.jsonl", docs)
    data = compress((tmp_path / "a.jsonl").read_bytes())
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(data[: len(data) * 3 // 4])
    write_jsonl(tmp_path / "b.jsonl", docs[:3])
    texts, stats = read([cut, tmp_path / "b.jsonl"])
    got = texts[:-3]
    assert 0 < len(got) < len(docs) and got == docs[: len(got)] and texts[-3:] == docs[:3]
    assert stats.malformed == 1
    source, line, reason = stats.malformed_examples[0]
    assert (source, line) == (str(cut), 0)
    assert reason.startswith(f"corrupt {name} data (") and reason.endswith(
        "; the rest of the file is skipped"
    )
    with pytest.raises(ConvertError, match=f"cut.jsonl{suffix}:0: corrupt {name} data"):
        read([cut], strict=True)


@pytest.mark.parametrize("where", ["inside the first", "at the start of the second"])
@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_corrupt_bytes_are_one_counted_warning(tmp_path, docs, monkeypatch, suffix, where):
    """Also where the standard library's own bzip2 and xz readers stopped quietly: at the start
    of a member (they take it for trailing garbage)."""
    from convert.reading import compression

    monkeypatch.setattr(compression, "BUFFER_BYTES", 4096)
    name, compress = COMPRESSORS[suffix]
    write_jsonl(tmp_path / "a.jsonl", docs[:20])
    write_jsonl(tmp_path / "b.jsonl", docs[20:])
    first = compress((tmp_path / "a.jsonl").read_bytes())
    data = bytearray(first + compress((tmp_path / "b.jsonl").read_bytes()))
    at = len(first) // 2 if where.startswith("inside") else len(first)
    data[at : at + 16] = b"\x01" * 16
    bad = tmp_path / f"bad.jsonl{suffix}"
    bad.write_bytes(bytes(data))
    write_jsonl(tmp_path / "c.jsonl", docs[:3])
    texts, stats = read([bad, tmp_path / "c.jsonl"])
    assert texts[:-3] == docs[: len(texts) - 3] and len(texts) - 3 < (
        20 if where.startswith("inside") else 40
    )
    assert [reason.split(" (")[0] for _, _, reason in stats.malformed_examples] == [f"corrupt {name} data"]


def test_a_compressed_parquet_file_is_refused_in_one_line(tmp_path, docs):
    from tests.support.corpus import write_parquet

    path = write_parquet(tmp_path / "a.parquet", docs, row_group_size=10)
    packed = tmp_path / "a.parquet.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(ConvertError, match="Parquet compresses its pages itself; decompress the file first"):
        read([packed])
