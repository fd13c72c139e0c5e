"""Parquet input against the golden record: the same documents as the record's JSON lines, written
by pyarrow as one Parquet file of many row groups, give the same bytes for any worker count, text
column type, record batch size, reading path (workers or main process), task split, interruption,
and from S3; the reader's memory stays bounded on a file larger than the memory it is given."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from convert.reading.options import ReadOptions
from convert.run.jobs import convert_corpus
from convert.run.options import ShardOptions
from tests.support.corpus import write_parquet
from tests.support.golden import CASES, RECORD, digests, options, record_texts

pytest.importorskip("pyarrow")  # the parquet extra (in the dev extra the suite installs)
pytestmark = pytest.mark.slow  # worker processes

ROW_GROUP = 16  # rows: the record's 212 records make 14 row groups
NESTED = ReadOptions(text_field="content.text")


@pytest.fixture(scope="module")
def golden_parquet(tmp_path_factory, chinese_documents, small_tokenizer) -> tuple[str, dict]:
    record = json.loads(RECORD.read_text())
    assert hashlib.sha256(Path(small_tokenizer).read_bytes()).hexdigest() == record["tokenizer_sha256"]
    path = write_parquet(
        tmp_path_factory.mktemp("parquet") / "corpus.parquet", record_texts(chinese_documents),
        row_group_size=ROW_GROUP,
    )  # fmt: skip
    return str(path), record


def convert(inputs, tokenizer, out, near, run, read=NESTED, **kwargs):
    return convert_corpus(
        [str(p) for p in inputs], tokenizer=tokenizer, out=str(out), options=options(near, *run), read=read,
        **kwargs,
    )  # fmt: skip


def test_the_workers_read_a_parquet_file_by_row_groups(golden_parquet):
    import pyarrow.parquet as pq

    from convert.run.ranges import range_formats

    path, _ = golden_parquet
    assert pq.ParquetFile(path).metadata.num_row_groups == 14
    assert range_formats([path], NESTED) == ["parquet"]
    assert range_formats([path], ReadOptions(text_field="content.text", strict=True)) is None


@pytest.mark.parametrize(
    ("label", "near", "run"), [(label, near, run) for label, near, runs in CASES for run in runs]
)
def test_one_parquet_file_gives_the_json_lines_record_for_any_workers(
    golden_parquet, small_tokenizer, tmp_path, label, near, run
):
    path, record = golden_parquet
    convert([path], small_tokenizer, tmp_path / "out", near, run)
    assert digests(tmp_path / "out") == record["cases"][label]


@pytest.mark.parametrize("field", ["text", "dict_text", "large_text"])
def test_each_text_column_type_and_small_record_batches_give_the_record(
    golden_parquet, small_tokenizer, tmp_path, monkeypatch, field
):
    """A dictionary-encoded and a large_string column read as a plain one; batches of ~3 documents
    make every row group several results of one worker task."""
    from convert.reading import parquet

    path, record = golden_parquet
    monkeypatch.setattr(parquet, "BATCH_BYTES", 3000)  # the workers are forked after this
    summary = convert(
        [path], small_tokenizer, tmp_path / "out", True, (2, False), ReadOptions(text_field=field)
    )
    assert digests(tmp_path / "out") == record["cases"]["near_filters"]
    assert (summary.read["documents"], summary.read["malformed"]) == (211, 1)  # 212 rows, one null


def _comparable(summary) -> dict:
    return {k: v for k, v in summary.to_json().items() if k not in ("elapsed_s", "tokens_per_s", "out")}


def test_the_main_process_reading_gives_the_same_bytes_summary_and_counts(
    golden_parquet, small_tokenizer, tmp_path, monkeypatch
):
    """Nulls and empty texts are dropped, counted by reason; the null's row is named."""
    from convert.run import ranges

    path, record = golden_parquet
    ranged = convert([path], small_tokenizer, tmp_path / "ranged", True, (2, False))
    monkeypatch.setattr(ranges, "range_formats", lambda paths, read: None)
    whole = convert([path], small_tokenizer, tmp_path / "whole", True, (2, False))
    assert digests(tmp_path / "whole") == digests(tmp_path / "ranged") == record["cases"]["near_filters"]
    assert _comparable(ranged) == _comparable(whole)
    assert (tmp_path / "ranged/near_duplicates.json").read_bytes() == (
        tmp_path / "whole/near_duplicates.json"
    ).read_bytes()
    assert ranged.dropped["malformed"] == 1 and ranged.dropped["empty"] == 1
    assert ranged.read["malformed_examples"] == [
        {"source": path, "line": 19, "reason": "text field 'content.text' is null"}
    ]


def test_tasks_and_their_merge_give_the_record(golden_parquet, chinese_documents, small_tokenizer, tmp_path):
    """A Spark-style output folder (two part files, _SUCCESS, .crc files) split over two tasks."""
    from convert.run import TaskSpec, merge_tasks

    _, record = golden_parquet
    texts = record_texts(chinese_documents)
    folder = tmp_path / "spark"
    write_parquet(folder / "part-00000-1f3a.snappy.parquet", texts[:100], row_group_size=ROW_GROUP)
    write_parquet(folder / "part-00001-1f3a.snappy.parquet", texts[100:], row_group_size=ROW_GROUP)
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / ".part-00000-1f3a.snappy.parquet.crc").write_bytes(b"crc")
    out = tmp_path / "out"
    for index in (1, 0):
        convert([folder], small_tokenizer, out, False, (1, False), task=TaskSpec(2, index))
    merge_tasks(str(out), workers=2, progress=False)
    assert digests(out) == record["cases"]["plain"]


def test_a_killed_conversion_resumes_to_the_same_output(tmp_path, chinese_documents, small_tokenizer):
    from tests.support.conversion import REPO_ROOT, wait_for_file

    half = chinese_documents[: len(chinese_documents) // 2]  # 0.9 M characters: seconds of work
    corpus = write_parquet(tmp_path / "big.parquet", half, row_group_size=64)
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "convert", "shards", str(corpus), "--tokenizer", small_tokenizer, "--out", str(out),
        "--seq-len", "64", "--val-fraction", "0.1", "--workers", "2", "--chunk-chars", "20000", "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = out / "train" / "part-00003" / "part.json"
    wait_for_file(marker, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), proc.stderr.read()
    assert not (out / "train" / "index.json").exists()
    resumed = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "reused from the interrupted run" in resumed.stdout
    fresh = tmp_path / "fresh"
    uninterrupted = ShardOptions(seq_len=64, val_fraction=0.1, workers=1, chunk_chars=20000, progress=False)
    convert_corpus([str(corpus)], tokenizer=small_tokenizer, out=str(fresh), options=uninterrupted)
    assert digests(out) == digests(fresh)


# --- S3 ------------------------------------------------------------------------------------------


@pytest.mark.s3
def test_parquet_on_s3_gives_the_record(golden_parquet, s3_server, s3_bucket, small_tokenizer, tmp_path):
    path, record = golden_parquet
    s3_server.client().put_object(Bucket=s3_bucket, Key="hub/data/train-00000-of-00001.parquet",
                                  Body=Path(path).read_bytes())  # fmt: skip
    (tmp_path / "README.md").write_text("# a dataset card\n")
    s3_server.client().put_object(Bucket=s3_bucket, Key="hub/README.md", Body=b"# a dataset card\n")
    convert([f"s3://{s3_bucket}/hub/"], small_tokenizer, tmp_path / "out", True, (3, False))
    assert digests(tmp_path / "out") == record["cases"]["near_filters"]


READER = textwrap.dedent(
    """
    import resource, sys
    from convert.reading.readers import ReadStats, read_documents
    from convert.reading.sources import input_sizes
    from storage import s3_client, split_s3_url

    url, headroom = sys.argv[1], int(sys.argv[2])
    size = input_sizes([url])[0]  # the S3 client and pyarrow are made and imported before the limit
    import pyarrow.parquet

    def address_space():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

    limit = address_space() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stats = ReadStats()
    chars = sum(len(doc.text) for doc in read_documents([url], "auto", stats=stats))
    print("read", stats.documents, chars, size > headroom)
    bucket, key = split_s3_url(url)
    try:
        s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        print("whole: read")
    except MemoryError:
        print("whole: MemoryError")
    """
)


@pytest.mark.s3
def test_the_reader_memory_stays_bounded_on_a_file_larger_than_its_memory(s3_server, s3_bucket, tmp_path):
    """66 MB of text read from S3 by a process given 32 MB more address space than it has: the
    whole file does not fit (reading it whole fails), its row groups read a page at a time do (the
    writer's pages: here ~270 KB; Arrow's writer cuts a page every 1024 values past 1 MB)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.support.conversion import REPO_ROOT

    rng = np.random.default_rng(0)
    rows, chars = 2000, 11_000  # 3 bytes of UTF-8 a character: 66 MB
    row = rng.integers(0x4E00, 0x9FA5, size=chars, dtype=np.uint32).tobytes().decode("utf-32-le")
    texts = [row] * rows
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=250, compression="none", use_dictionary=False,
                   write_batch_size=8)  # fmt: skip
    client = s3_server.client()
    client.upload_file(str(path), s3_bucket, "big.parquet")
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}  # its own allocator reserves 64 MB blocks
    result = subprocess.run(
        [sys.executable, "-c", READER, f"s3://{s3_bucket}/big.parquet", str(32 << 20)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == [f"read {rows} {rows * chars} True", "whole: MemoryError"]
