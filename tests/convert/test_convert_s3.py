"""Conversion from and to S3 (the loopback server), read back with streaming's StreamingDataset."""

from __future__ import annotations

import numpy as np
import pytest

from convert.run.jobs import convert_corpus
from convert.run.options import ShardOptions
from shards.errors import ShardsError
from tests.support.conversion import local_samples

pytestmark = pytest.mark.s3

OPTIONS = ShardOptions(seq_len=64, val_fraction=0.1, workers=1, chunk_chars=40_000, progress=False)


def streaming_samples(remote: str | None, local: str) -> np.ndarray:
    from streaming import StreamingDataset

    dataset = StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=1)
    try:
        return np.stack([dataset[i]["tokens"] for i in range(len(dataset))])
    finally:
        del dataset


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, small_corpus, small_tokenizer):
    out = tmp_path_factory.mktemp("s3ref") / "shards"
    convert_corpus([small_corpus], tokenizer=small_tokenizer, out=str(out), options=OPTIONS)
    return str(out)


def test_local_shards_read_by_streaming(tmp_path, local_reference):
    # (Not streaming's clean_stale_shared_memory(): it unlinks every live dataset's memory on the
    # machine, those of the suite's other workers too.)
    samples = streaming_samples(None, f"{local_reference}/train")
    assert samples.dtype == np.uint16 and samples.shape[1] == 64
    assert np.array_equal(samples, local_samples(local_reference))


def test_s3_in_and_out_equal_local(
    tmp_path,
    s3_server,
    s3_bucket,
    small_corpus,
    small_tokenizer,
    local_reference,
):
    client = s3_server.client()
    with open(small_corpus, "rb") as stream:
        client.put_object(Bucket=s3_bucket, Key="corpus/part-0.jsonl", Body=stream.read())
    remote = f"s3://{s3_bucket}/shards/run1"
    summary = convert_corpus(
        [f"s3://{s3_bucket}/corpus/"], tokenizer=small_tokenizer, out=remote, options=OPTIONS
    )
    assert summary.splits["train"].samples > 0
    keys = s3_server.keys(s3_bucket, "shards/run1/")
    assert "shards/run1/train/index.json" in keys and "shards/run1/val/meta.json" in keys
    for split in ("train", "val"):
        got = streaming_samples(f"{remote}/{split}", str(tmp_path / f"cache-{split}"))
        assert np.array_equal(got, local_samples(local_reference, split))
    with pytest.raises(ShardsError, match="--overwrite"):
        convert_corpus([small_corpus], tokenizer=small_tokenizer, out=remote, options=OPTIONS)


def test_missing_bucket_names_endpoint_and_bucket(s3_server, small_corpus, small_tokenizer):
    with pytest.raises(ShardsError) as err:
        convert_corpus(
            [small_corpus], tokenizer=small_tokenizer, out="s3://no-such-bucket-x/p", options=OPTIONS
        )
    assert "no-such-bucket-x" in str(err.value) and s3_server.endpoint in str(err.value)


def test_tasks_on_s3_merge_into_the_local_single_run(
    tmp_path, s3_server, s3_bucket, small_corpus_docs, small_tokenizer
):
    """Inputs sized and read on S3, task pieces and the merged shards written there."""
    from dataclasses import replace

    from convert.dedup.options import NearDedupOptions
    from convert.run.jobs import TaskSpec, merge_tasks
    from tests.support.corpus import write_jsonl

    client = s3_server.client()
    for i in range(3):
        path = tmp_path / f"{i}.jsonl"
        write_jsonl(path, small_corpus_docs[i * 60 : (i + 1) * 60] + small_corpus_docs[:5])
        client.put_object(Bucket=s3_bucket, Key=f"in/{i}.jsonl", Body=path.read_bytes())
    options = replace(OPTIONS, near_dedup=NearDedupOptions())
    inputs = [f"s3://{s3_bucket}/in/"]
    single = convert_corpus(inputs, tokenizer=small_tokenizer, out=str(tmp_path / "single"), options=options)
    remote = f"s3://{s3_bucket}/multi"
    for index in range(3):
        convert_corpus(
            inputs, tokenizer=small_tokenizer, out=remote, options=options, task=TaskSpec(3, index)
        )
    merged = merge_tasks(remote, workers=1, progress=False)
    assert merged.dropped == single.dropped and single.dropped["duplicate"] == 15
    for split in ("train", "val"):
        got = streaming_samples(f"{remote}/{split}", str(tmp_path / f"cache-{split}"))
        assert np.array_equal(got, local_samples(str(tmp_path / "single"), split))
