"""The converter's output, byte for byte, against a record written by the code before issue 21
moved the per-document work out of the main process (tests/support/golden.py); and the workers'
reading of byte ranges (convert/run/ranges.py) against the main process's reading."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.support.golden import CASES, RECORD, convert, digests, write_corpus

pytestmark = pytest.mark.slow  # worker processes


@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory, chinese_documents, small_tokenizer) -> tuple[list[str], dict]:
    record = json.loads(RECORD.read_text())
    assert hashlib.sha256(Path(small_tokenizer).read_bytes()).hexdigest() == record["tokenizer_sha256"]
    inputs = write_corpus(tmp_path_factory.mktemp("golden"), chinese_documents)
    assert [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in inputs] == record["corpus_sha256"]
    return inputs, record


def test_the_workers_read_these_inputs(golden_inputs):
    from convert.reading.options import ReadOptions
    from convert.run.ranges import range_formats

    assert range_formats(golden_inputs[0], ReadOptions()) == ["jsonl", "jsonl"]
    assert range_formats(golden_inputs[0], ReadOptions(strict=True)) is None


@pytest.mark.parametrize(
    ("label", "near", "run"), [(label, near, run) for label, near, runs in CASES for run in runs]
)
def test_output_is_byte_identical_to_the_record(golden_inputs, small_tokenizer, tmp_path, label, near, run):
    inputs, record = golden_inputs
    convert(inputs, small_tokenizer, tmp_path / "out", near, run)
    assert digests(tmp_path / "out") == record["cases"][label]


def _comparable(summary) -> dict:
    return {k: v for k, v in summary.to_json().items() if k not in ("elapsed_s", "tokens_per_s", "out")}


@pytest.mark.parametrize(("label", "near"), [("plain", False), ("near_filters", True)])
def test_small_ranges_match_the_record_and_the_main_process_reading(
    golden_inputs, small_tokenizer, tmp_path, monkeypatch, label, near
):
    """Ranges of ~700 bytes: many per file, chunks spanning several, a malformed line inside one;
    the summary (counts, malformed lines, near-duplicate pairs) equals the main process's reading."""
    from convert.run import ranges

    inputs, record = golden_inputs
    monkeypatch.setattr(ranges, "RANGE_BYTES", 700)
    ranged = convert(inputs, small_tokenizer, tmp_path / "ranged", near, (3, False))
    assert digests(tmp_path / "ranged") == record["cases"][label]
    monkeypatch.setattr(ranges, "range_formats", lambda paths, read: None)
    whole = convert(inputs, small_tokenizer, tmp_path / "whole", near, (2, False))
    assert digests(tmp_path / "whole") == record["cases"][label]
    assert ranged.read["malformed_examples"][0]["line"] == 19
    assert _comparable(ranged) == _comparable(whole) | {"workers": 3}
    if near:
        report = (tmp_path / "ranged/near_duplicates.json").read_bytes()
        assert report == (tmp_path / "whole/near_duplicates.json").read_bytes()
        _check_places(json.loads(report))


def _check_places(report: dict) -> None:
    """Each document of the report is the record at its file and line."""
    from convert.filters.cleaning import Cleaner

    cleaner = Cleaner()
    lines = {}
    assert report["pairs"]
    for pair in report["pairs"]:
        for side in ("kept", "removed"):
            doc = pair[side]
            if doc["file"] not in lines:
                lines[doc["file"]] = Path(doc["file"]).read_text(encoding="utf-8").split("\n")
            record = json.loads(lines[doc["file"]][doc["line"] - 1])
            assert cleaner.normalize(record["text"]) == doc["text"]
        assert pair["kept"]["position"] < pair["removed"]["position"]


def test_a_near_duplicate_index_split_over_processes_decides_alike(
    golden_inputs, small_tokenizer, tmp_path, monkeypatch
):
    """Three index processes, keys split by value (convert/dedup/near_dedup.py `KeyPartitions`): the same
    bytes, pairs and index size as the main process's one index; on the main process's reading too."""
    import dataclasses

    from convert.run import ranges
    from tests.support import golden as convert_golden

    inputs, record = golden_inputs
    one = convert(inputs, small_tokenizer, tmp_path / "one", True, (2, False))
    plain = convert_golden.options
    monkeypatch.setattr(
        convert_golden, "options", lambda *a: dataclasses.replace(plain(*a), index_processes=3)
    )
    monkeypatch.setattr(ranges, "RANGE_BYTES", 700)
    split = convert(inputs, small_tokenizer, tmp_path / "split", True, (2, False))
    monkeypatch.setattr(ranges, "range_formats", lambda paths, read: None)
    whole = convert(inputs, small_tokenizer, tmp_path / "whole", True, (2, False))
    for out in ("one", "split", "whole"):
        assert digests(tmp_path / out) == record["cases"]["near_filters"], out
        assert (tmp_path / out / "near_duplicates.json").read_bytes() == (
            tmp_path / "one/near_duplicates.json"
        ).read_bytes()
    assert split.near_dedup.index_bytes == whole.near_dedup.index_bytes == one.near_dedup.index_bytes
    assert split.dropped == whole.dropped == one.dropped
    assert split.dropped_tokens == one.dropped_tokens
    # Exact de-duplication alone in the index processes too.
    plain_split = convert(inputs, small_tokenizer, tmp_path / "plain", False, (2, False))
    assert digests(tmp_path / "plain") == record["cases"]["plain"]
    assert plain_split.dropped["duplicate"] == 26


def test_index_processes_with_the_main_process_cleaning_match_the_record(
    golden_inputs, small_tokenizer, tmp_path, monkeypatch
):
    """With a core to spare the main process cleans and de-duplicates the texts itself (the path
    for inputs it reads): the index processes then decide near duplicates only."""
    import dataclasses

    from convert.run import ranges
    from tests.support import golden as convert_golden

    inputs, record = golden_inputs
    plain = convert_golden.options
    monkeypatch.setattr(
        convert_golden, "options", lambda *a: dataclasses.replace(plain(*a), index_processes=3)
    )
    monkeypatch.setattr(ranges, "range_formats", lambda paths, read: None)
    for label, near in (("plain", False), ("near_filters", True)):
        convert(inputs, small_tokenizer, tmp_path / label, near, (1, True))
        assert digests(tmp_path / label) == record["cases"][label], label


def test_a_full_pair_sample_gets_every_text_it_keeps(golden_inputs, small_tokenizer, tmp_path, monkeypatch):
    """A sample of 6 keys fills early: the workers then send only the texts under a bound the
    main process sets from the keys it has received (not from its decisions, which trail them
    through the index processes), and the report is the one the main process's own reading gives."""
    import dataclasses
    import functools

    from convert.dedup import near_dedup, selection
    from convert.dedup.index_processes import DEPTH
    from convert.run import ranges
    from tests.support import golden as convert_golden

    inputs, _ = golden_inputs
    monkeypatch.setattr(selection, "PairSample", functools.partial(near_dedup.PairSample, keys=6))
    monkeypatch.setattr(ranges, "RANGE_BYTES", 700)
    plain = convert_golden.options
    monkeypatch.setattr(
        convert_golden, "options", lambda *a: dataclasses.replace(plain(*a), index_processes=2)
    )
    bounds, bound = [], ranges.RangeFeed._sample_bound
    monkeypatch.setattr(
        ranges.RangeFeed, "_sample_bound", lambda self: bounds.append(bound(self)) or bounds[-1]
    )
    ranged = convert(inputs, small_tokenizer, tmp_path / "ranged", True, (3, False))
    # Every text goes back only for the ranges handed out before the first keys came back (the
    # window of ranges in flight, then a few ranges of one document each), not until the first
    # decisions (the window and the index processes' pipeline, DEPTH messages deep, twice).
    assert len(bounds) > 100 and sum(b >= 1 << 64 for b in bounds) < 4 * 3 + 4 + DEPTH
    monkeypatch.setattr(ranges, "range_formats", lambda paths, read: None)
    whole = convert(inputs, small_tokenizer, tmp_path / "whole", True, (2, False))
    report = (tmp_path / "ranged/near_duplicates.json").read_bytes()
    assert report == (tmp_path / "whole/near_duplicates.json").read_bytes()
    assert ranged.near_dedup.pairs_in_report == whole.near_dedup.pairs_in_report > 0
    _check_places(json.loads(report))


@pytest.mark.parametrize(("label", "near"), [("plain", False), ("near_filters", True)])
def test_a_worker_signing_and_tokenizing_in_sub_batches_matches_the_record(
    golden_inputs, small_tokenizer, tmp_path, monkeypatch, label, near
):
    """Large ranges are filtered, signed and tokenized in runs of texts (worker.SUB_BATCH_CHARS):
    runs of a few documents here, the same bytes."""
    from convert.run import worker

    inputs, record = golden_inputs
    monkeypatch.setattr(worker, "SUB_BATCH_CHARS", 3000)
    convert(inputs, small_tokenizer, tmp_path / "out", near, (2, False))
    assert digests(tmp_path / "out") == record["cases"][label]
