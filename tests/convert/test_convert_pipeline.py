"""The shard pipeline: split, packing without loss, parallel determinism, meta, summary, resume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import sentencepiece as spm

from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.reading.options import ReadOptions
from convert.records import TokenizedBatch
from convert.run.conversion import batch_documents, digest_of, split_of
from convert.run.jobs import convert_corpus
from convert.run.options import ShardOptions
from shards.errors import ShardsError
from shards.meta import FORMAT_NAME, FORMAT_VERSION
from tests.support.conversion import REPO_ROOT, local_samples, sorted_rows, wait_for_file

SEQ = 64
FORMAT_KEYS = {
    "format", "format_version", "split", "seq_len", "dtype", "vocab_size", "eos_id", "bos_id", "add_bos",
    "tokenizer_sha256", "num_samples", "num_tokens", "num_documents", "dropped", "created_at", "command",
}  # fmt: skip


def options(**overrides) -> ShardOptions:
    base = dict(seq_len=SEQ, val_fraction=0.1, workers=1, min_tokens=20, chunk_chars=20_000, progress=False)
    return ShardOptions(**{**base, **overrides})


def convert(corpus, tokenizer, out, **overrides) -> dict:
    return convert_corpus([corpus], tokenizer=tokenizer, out=str(out), options=options(**overrides))


def expected_streams(docs: list[str], tokenizer: str, val_fraction: float) -> dict[str, list[list[int]]]:
    """Each split's documents as the pipeline must tokenize them: cleaned, deduped, EOS added."""
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    cleaner = Cleaner()
    streams: dict[str, list[list[int]]] = {"train": [], "val": []}
    for doc in docs:
        text = cleaner.clean(doc)
        if text is None:
            continue
        ids = sp.encode(text) + [sp.eos_id()]
        if len(ids) >= 20:
            streams[split_of(digest_of(text), val_fraction)].append(ids)
    return streams


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus, small_tokenizer):
    """One uninterrupted single-worker conversion of the small corpus."""
    out = tmp_path_factory.mktemp("reference") / "shards"
    summary = convert(small_corpus, small_tokenizer, out)
    return out, summary


def test_no_token_lost_but_the_last_partial_sample(reference, small_corpus_docs, small_tokenizer):
    out, summary = reference
    streams = expected_streams(small_corpus_docs, small_tokenizer, 0.1)
    for split, docs in streams.items():
        total = sum(len(d) for d in docs)
        written = summary.splits[split]
        assert written.samples == total // SEQ, split
        assert written.lost_tail_tokens == total % SEQ < SEQ
        assert written.documents == len(docs)
        samples = local_samples(str(out), split)
        assert samples.shape == (total // SEQ, SEQ)
        # Same multiset of tokens as the documents, minus only the final partial sample.
        expected_counts = np.bincount(np.concatenate([np.array(d) for d in docs]), minlength=2000)
        got_counts = np.bincount(samples.ravel(), minlength=2000)
        assert (expected_counts - got_counts).sum() == total % SEQ
        assert (expected_counts >= got_counts).all()
    assert summary.splits["train"].parts > 3  # several chunks, so tails really were merged


def test_samples_across_parts_are_what_format_md_says(reference, small_corpus_docs, small_tokenizer):
    """shards/FORMAT.md: part k holds chunk k's stream but its tail, the final part the tails in
    chunk order; so in index order a document cut at a part's end runs into the next chunk."""
    import zstd

    from tests.support.conversion import _decode_shard

    out, _ = reference
    folder = out / "train"
    index = json.loads((folder / "index.json").read_text())
    rows: dict[str, list[np.ndarray]] = {}
    for shard in index["shards"]:
        part = shard["zip_data"]["basename"].split("/")[0]
        raw = zstd.decompress((folder / shard["zip_data"]["basename"]).read_bytes())
        rows.setdefault(part, []).append(
            _decode_shard(raw, np.dtype(shard["column_encodings"][0].split(":")[1]))
        )
    parts = sorted(rows)
    final, chunks = parts[-1], parts[:-1]
    assert len(chunks) > 3
    eos = spm.SentencePieceProcessor(model_file=small_tokenizer).eos_id()
    streams, tails = [], []
    for part in chunks:
        tail = np.array(json.loads((folder / part / "part.json").read_text())["tail"], dtype=np.int64)
        assert len(tail) < SEQ and tail[-1] == eos  # a chunk ends with a document's EOS
        streams += [np.concatenate(rows[part]).ravel(), tail]
        tails.append(tail)
    expected = np.concatenate(
        [np.array(d) for d in expected_streams(small_corpus_docs, small_tokenizer, 0.1)["train"]]
    )
    assert np.array_equal(np.concatenate(streams), expected)  # every chunk's stream, tail included
    joined = np.concatenate(tails)
    final_rows = np.concatenate(rows[final]).ravel()
    assert np.array_equal(final_rows, joined[: len(joined) // SEQ * SEQ])
    in_index_order = np.concatenate([np.concatenate(rows[p]).ravel() for p in parts])
    assert not np.array_equal(in_index_order, expected[: len(in_index_order)])  # not one stream


def test_one_chunk_is_the_plain_document_stream(tmp_path, small_corpus, small_corpus_docs, small_tokenizer):
    out = tmp_path / "one"
    convert(small_corpus, small_tokenizer, out, val_fraction=0.0, chunk_chars=10**9)
    stream = np.concatenate(
        [np.array(d) for d in expected_streams(small_corpus_docs, small_tokenizer, 0.0)["train"]]
    )
    samples = local_samples(str(out))
    assert np.array_equal(samples.ravel(), stream[: samples.size])
    assert local_samples(str(out), "val").size == 0


def test_a_batch_splits_its_documents_exactly_as_split_of_does():
    rng = np.random.default_rng(0)
    digests = [rng.bytes(16) for _ in range(2000)]
    # Upper halves right at and around the 10 % boundary, where float rounding would show.
    edge = int(0.1 * 2**64)
    digests += [bytes(8) + (edge + d).to_bytes(8, "little") for d in (-2048, -1, 0, 1, 2048)]
    n = len(digests)
    batch = TokenizedBatch(
        digests=b"".join(digests),
        chars=np.ones(n, np.int64),
        lengths=np.ones(n, np.int64),
        tokens=np.arange(n, dtype=np.uint32),
        drops={},
    )
    docs = list(batch_documents(batch, 0.1))
    assert [doc.split for doc in docs] == [split_of(d, 0.1) for d in digests]
    # The one split rule, vectorised, gives what its definition in exact integers gives.
    by_definition = ["val" if int.from_bytes(d[8:], "little") / 2**64 < 0.1 else "train" for d in digests]
    assert [split_of(d, 0.1) for d in digests] == by_definition
    assert [doc.digest for doc in docs] == digests and [int(doc.tokens[0]) for doc in docs] == list(range(n))
    assert 100 < sum(doc.split == "val" for doc in docs) < 300


def test_split_is_by_document_and_stable(tmp_path, reference, small_corpus, small_tokenizer):
    out, summary = reference
    again = convert(small_corpus, small_tokenizer, tmp_path / "again", chunk_chars=7_000)
    assert again.splits["val"].documents == summary.splits["val"].documents > 0
    # Chunking differs, but each document lands in the same split, so each split holds the same tokens.
    for split in ("train", "val"):
        before, after = summary.splits[split], again.splits[split]
        assert before.documents == after.documents
        assert before.tokens + before.lost_tail_tokens == after.tokens + after.lost_tail_tokens


@pytest.mark.slow
def test_same_samples_for_one_and_two_workers(tmp_path, reference, small_corpus, small_tokenizer):
    out, summary = reference
    two = convert(small_corpus, small_tokenizer, tmp_path / "two", workers=2)
    assert two.splits == summary.splits
    for split in ("train", "val"):
        one_rows, two_rows = local_samples(str(out), split), local_samples(str(tmp_path / "two"), split)
        assert sorted_rows(one_rows) == sorted_rows(two_rows)
        assert np.array_equal(one_rows, two_rows)  # even the order is the same


def test_meta_json_follows_format_md(reference, small_tokenizer):
    out, summary = reference
    sha = hashlib.sha256(Path(small_tokenizer).read_bytes()).hexdigest()
    for split in ("train", "val"):
        meta = json.loads((out / split / "meta.json").read_text())
        assert set(meta) == FORMAT_KEYS
        assert meta["format"] == FORMAT_NAME and meta["format_version"] == FORMAT_VERSION
        assert (meta["split"], meta["seq_len"], meta["dtype"]) == (split, SEQ, "uint16")
        assert (meta["vocab_size"], meta["eos_id"], meta["bos_id"], meta["add_bos"]) == (2000, 2, 1, False)
        assert meta["tokenizer_sha256"] == sha
        assert meta["num_samples"] == summary.splits[split].samples
        assert meta["num_tokens"] == meta["num_samples"] * SEQ
        assert meta["num_documents"] == summary.splits[split].documents
        assert meta["dropped"]["too_short_tokens"] == summary.splits[split].too_short_tokens
        index = json.loads((out / split / "index.json").read_text())
        assert sum(shard["samples"] for shard in index["shards"]) == meta["num_samples"]
        assert {shard["compression"] for shard in index["shards"]} == {"zstd"}
        assert index["shards"][0]["hashes"] == ["sha1", "xxh64"]


def test_summary_is_saved(reference):
    out, summary = reference
    saved = json.loads((out / "summary.json").read_text())
    assert saved["read"]["documents"] == 300
    assert saved["tokens_written"] == sum(s["tokens"] for s in saved["splits"].values()) > 0
    assert saved["tokens_per_s"] > 0 and saved["elapsed_s"] > 0
    assert "too_short_tokens" in saved["dropped"]
    assert saved == summary.to_json()  # what convert_corpus returns is what it saved


def test_bos_and_min_tokens_and_uint32(tmp_path, small_corpus, small_tokenizer):
    convert(small_corpus, small_tokenizer, tmp_path / "bos", add_bos=True, dtype="uint32", min_tokens=200)
    samples = local_samples(str(tmp_path / "bos"))
    meta = json.loads((tmp_path / "bos" / "train" / "meta.json").read_text())
    assert samples.dtype == np.uint32 and meta["dtype"] == "uint32" and meta["add_bos"]
    flat = samples.ravel()
    # One BOS per document (the last one's may sit in the lost partial sample); the stream opens with one.
    assert flat[0] == 1
    assert meta["num_documents"] - 1 <= int((flat == 1).sum()) <= meta["num_documents"]
    assert meta["dropped"]["too_short_tokens"] > 0


def test_duplicates_dropped_globally(tmp_path, small_corpus_docs, small_tokenizer):
    from tests.support.corpus import write_jsonl

    docs = small_corpus_docs[:60]
    write_jsonl(tmp_path / "a.jsonl", docs)
    write_jsonl(tmp_path / "b.jsonl", docs[:30])  # every one a duplicate of a document in a.jsonl
    summary = convert_corpus(
        [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
        tokenizer=small_tokenizer,
        out=str(tmp_path / "out"),
        options=options(val_fraction=0.0, chunk_chars=2_000),
    )
    assert summary.dropped["duplicate"] == 30


def test_cleaning_and_writing_in_the_main_process_or_in_the_workers_give_the_same_output(
    tmp_path, small_corpus_docs, small_tokenizer, monkeypatch
):
    from convert.run import conversion
    from tests.support.corpus import write_jsonl

    # Small batches, so that some hold only duplicates or only empty documents.
    monkeypatch.setattr(conversion, "BATCH_CHARS", 1_000)
    docs = small_corpus_docs[:80]
    write_jsonl(tmp_path / "a.jsonl", [*docs, *["  "] * 600, "\x1b[31m\t", docs[3] + "\r\n", *docs[:40]])
    outputs = {}
    for main_works in (True, False):
        out = tmp_path / f"main-{main_works}"
        summary = convert_corpus(
            [str(tmp_path / "a.jsonl")],
            tokenizer=small_tokenizer,
            out=str(out),
            options=options(chunk_chars=3_000, main_works=main_works),
        )
        outputs[main_works] = summary, out
    (main, main_out), (workers, workers_out) = outputs[True], outputs[False]
    assert main.dropped == workers.dropped
    assert main.dropped["duplicate"] == 41 and main.dropped["empty"] == 601
    assert main.splits == workers.splits
    for split in ("train", "val"):
        assert np.array_equal(local_samples(str(main_out), split), local_samples(str(workers_out), split))


def test_existing_complete_output_is_refused(tmp_path, reference, small_corpus, small_tokenizer):
    out, _ = reference
    with pytest.raises(ShardsError, match=rf"{out}.*--overwrite"):
        convert(small_corpus, small_tokenizer, out)
    copy = tmp_path / "copy"
    convert(small_corpus, small_tokenizer, copy)
    (copy / "train" / "part-00000" / "stale").mkdir()
    convert(small_corpus, small_tokenizer, copy, overwrite=True)
    assert not (copy / "train" / "part-00000" / "stale").exists()
    assert np.array_equal(local_samples(str(copy)), local_samples(str(out)))


def test_empty_result_is_an_error(tmp_path, small_corpus, small_tokenizer):
    with pytest.raises(ConvertError, match="nothing to write"):
        convert(small_corpus, small_tokenizer, tmp_path / "out", min_tokens=10**6)
    assert not (tmp_path / "out" / "train" / "index.json").exists()


def test_missing_field_and_strict(tmp_path, small_corpus, small_tokenizer):
    with pytest.raises(ConvertError, match="'content'"):
        convert_corpus(
            [small_corpus], tokenizer=small_tokenizer, out=str(tmp_path / "o"), options=options(),
            read=ReadOptions(text_field="content"),
        )  # fmt: skip


@pytest.mark.slow
def test_killed_run_leaves_no_index_and_resumes(tmp_path, reference, chinese_documents, small_tokenizer):
    from tests.support.corpus import write_jsonl

    corpus = tmp_path / "big.jsonl"
    write_jsonl(corpus, chinese_documents)  # 1.8 M characters: several seconds of work
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "convert", "shards", str(corpus), "--tokenizer", small_tokenizer, "--out", str(out),
        "--seq-len", str(SEQ), "--val-fraction", "0.1", "--workers", "1", "--chunk-chars", "20000", "--no-progress",
    ]  # fmt: skip
    scratch = tmp_path / "tmp"  # the system temp folder of these runs: the spool folders go there
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    marker = out / "train" / "part-00003" / "part.json"
    wait_for_file(marker, proc)
    workers = _workers_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), proc.stderr.read()
    # Its worker processes go with it instead of waiting forever on the pool's pipes.
    assert workers, "no worker process found"
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"worker processes outlived the killed conversion: {alive}"
    assert not (out / "train" / "index.json").exists() and not (out / "val" / "index.json").exists()
    left = sorted(p.name for p in scratch.iterdir())
    assert left and all(name.startswith(f"convert-spool-{proc.pid}-") for name in left), left

    resumed = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "reused from the interrupted run" in resumed.stdout
    assert not list(scratch.iterdir()), "the killed run's spool folder was not removed by the next run"
    fresh = tmp_path / "fresh"
    fresh_args = [a if a != str(out) else str(fresh) for a in args]
    assert subprocess.run(fresh_args, cwd=REPO_ROOT, capture_output=True, timeout=120).returncode == 0
    for split in ("train", "val"):
        assert np.array_equal(local_samples(str(out), split), local_samples(str(fresh), split))


@pytest.mark.slow
def test_a_dead_worker_stops_the_run_with_a_clear_error(tmp_path, chinese_documents, small_tokenizer):
    """A worker killed (e.g. by the OOM killer) must not leave the run waiting forever."""
    from tests.support.corpus import write_jsonl

    corpus = tmp_path / "big.jsonl"
    write_jsonl(corpus, chinese_documents)
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "convert", "shards", str(corpus), "--tokenizer", small_tokenizer, "--out", str(out),
        "--seq-len", str(SEQ), "--workers", "1", "--chunk-chars", "20000", "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = out / "train" / "part-00001" / "part.json"
    wait_for_file(marker, proc)
    workers = _workers_of(proc.pid)
    assert workers, "no worker process found"
    for worker in workers:
        worker.kill()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert "worker process died" in stderr and "re-run the same command" in stderr
    assert not (out / "train" / "index.json").exists()


def _workers_of(pid: int) -> list:
    """The conversion's worker processes (not multiprocessing's resource tracker)."""
    return [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


def test_only_the_scratch_folders_of_processes_that_are_gone_are_removed(tmp_path):
    from convert.scratch import remove_stale_scratch

    mine = tmp_path / f"convert-spool-{os.getpid()}-abc"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"convert-sketches-{dead.pid}-def"
    other = tmp_path / "convert-notes-1-x"  # not a scratch folder's name
    for folder in (mine, gone, other):
        folder.mkdir()
    assert remove_stale_scratch(str(tmp_path)) == [gone]
    assert mine.exists() and other.exists() and not gone.exists()
