"""Near-duplicate removal, quality filters and the multi-machine split, in real conversions."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from convert.dedup.options import NearDedupOptions
from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.filters.quality import QualityFilters
from convert.reading.options import ReadOptions
from convert.run.jobs import TaskSpec, convert_corpus, merge_tasks
from convert.run.options import ShardOptions
from convert.run.tasks import assign_files
from tests.support.conversion import REPO_ROOT, local_samples, wait_for_file
from tests.support.corpus import edited_copy, write_jsonl

SEQ = 64
NEAR = NearDedupOptions(threshold=0.8)


def options(**overrides) -> ShardOptions:
    base = dict(
        seq_len=SEQ, val_fraction=0.1, workers=1, chunk_chars=20_000, progress=False, near_dedup=NEAR,
        filters=QualityFilters(min_chars=5),
    )  # fmt: skip
    return ShardOptions(**{**base, **overrides})


class Planted:
    """Real documents with copies planted later on: near ones (1 % of the characters edited,
    exact Jaccard about 0.95) and exact ones, in three files."""

    def __init__(self, folder: Path, docs: list[str], seed: int = 5) -> None:
        rng = random.Random(seed)
        rows = [(doc, None, None) for doc in docs]  # (text, the original's text, kind)
        long_enough = [i for i, doc in enumerate(docs) if len(doc) >= 300]
        for n, original in enumerate(rng.sample(long_enough, 36)):
            kind = "exact" if n < 6 else "near"
            text = docs[original] if kind == "exact" else edited_copy(docs[original], 0.01, n)
            after = next(i for i, row in enumerate(rows) if row[0] is docs[original])
            # Every other copy goes last, into the third file: some are in another file than their original.
            place = len(rows) if n % 2 else rng.randint(after + 1, len(rows))
            rows.insert(place, (text, docs[original], kind))
        self.rows = rows
        self.texts = [text for text, _, _ in rows]
        self.files = []
        third = len(rows) // 3
        for i, part in enumerate((rows[:third], rows[third : 2 * third], rows[2 * third :])):
            path = folder / f"part-{i}.jsonl"
            write_jsonl(path, [text for text, _, _ in part])
            self.files.append(str(path))
        self.folder = str(folder)

    def copies(self, kind: str) -> list[tuple[str, str]]:
        """(copy, original) of every planted copy of this kind."""
        return [(text, original) for text, original, k in self.rows if k == kind]


@pytest.fixture(scope="module")
def planted(tmp_path_factory, small_corpus_docs) -> Planted:
    return Planted(tmp_path_factory.mktemp("planted"), small_corpus_docs)


def convert(planted: Planted, tokenizer: str, out, **overrides) -> dict:
    return convert_corpus([planted.folder], tokenizer=tokenizer, out=str(out), options=options(**overrides))


def token_count(sp, text: str) -> int:
    return len(sp.encode(Cleaner().normalize(text))) + 1  # EOS


def test_near_duplicates_are_removed_counted_and_reported(
    tmp_path, planted, small_corpus_docs, small_tokenizer
):
    out = tmp_path / "out"
    summary = convert(planted, small_tokenizer, out, val_fraction=0.0, chunk_chars=10**9)
    near_copies = planted.copies("near")
    assert summary.dropped["near_duplicate"] == len(near_copies) == 30
    assert summary.dropped["duplicate"] == 6
    sp = spm.SentencePieceProcessor(model_file=small_tokenizer)
    assert summary.dropped_tokens["near_duplicate"] == sum(token_count(sp, t) for t, _ in near_copies)
    # What is left is exactly the original documents, in their order: the first of each cluster.
    cleaner = Cleaner()
    originals = [cleaner.normalize(d) for d in small_corpus_docs]
    stream = [sp.encode(t) + [sp.eos_id()] for t in originals if len(t) >= 5]
    flat = np.concatenate([np.array(ids) for ids in stream if len(ids) >= 20])
    samples = local_samples(str(out))
    assert np.array_equal(samples.ravel(), flat[: samples.size])
    # The report beside summary.json: removed copies with the original they repeat.
    report = json.loads((out / "near_duplicates.json").read_text(encoding="utf-8"))
    assert report["threshold"] == 0.8 and summary.near_dedup.pairs_in_report == len(report["pairs"]) > 10
    copy_of = {cleaner.normalize(copy): cleaner.normalize(original) for copy, original in near_copies}
    for pair in report["pairs"]:
        assert copy_of[pair["removed"]["text"]] == pair["kept"]["text"]
        assert pair["jaccard"] > 0.85 and pair["estimated_jaccard"] >= 0.8
        assert pair["kept"]["position"] < pair["removed"]["position"]


def test_quality_filters_count_documents_and_tokens(
    tmp_path, chinese_documents, small_corpus_docs, small_tokenizer
):
    bad = {
        "symbols": next(d for d in chinese_documents if d.startswith("一九九七年股市概览")),
        "long_run": "北京搬家公司北京保洁公司北京装修公司" * 10 + "。" + small_corpus_docs[0][:200],
        "low_cjk": "Xinhua News Agency reported from Beijing on the first day of 1998 (新华社). " * 4,
        "too_short_chars": "新年好",
    }
    cleaner = Cleaner()
    good = [
        d
        for d in small_corpus_docs[:120]
        if not QualityFilters.recommended().min_chars > len(cleaner.normalize(d))
    ]
    good = [d for d in good if not d.startswith("一九九七年股市概览")][:100]
    write_jsonl(tmp_path / "c.jsonl", [*good, *bad.values(), *bad.values()])
    summary = convert_corpus(
        [str(tmp_path / "c.jsonl")], tokenizer=small_tokenizer, out=str(tmp_path / "out"),
        options=options(filters=QualityFilters.recommended(chinese=True), near_dedup=None),
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=small_tokenizer)
    for reason, text in bad.items():
        # The second copy is an exact duplicate, except a too-short one: too short comes first.
        copies = 2 if reason == "too_short_chars" else 1
        assert summary.dropped[reason] == copies, reason
        assert summary.dropped_tokens[reason] == copies * token_count(sp, text), reason
    assert summary.dropped["duplicate"] == 3
    assert summary.filters.min_cjk_share == 0.3
    assert summary.near_dedup is None and not (tmp_path / "out" / "near_duplicates.json").exists()


def test_a_short_duplicate_is_counted_as_too_short_wherever_it_is_decided():
    """The first rule that drops a document counts it: too short (a filter) before duplicate."""
    from convert.dedup.selection import Selection
    from convert.filters.cleaning import text_digest
    from convert.filters.quality import REASON_CODES
    from convert.records import TokenizedBatch

    short, long = "新年好", "中华人民共和国成立五十周年"
    opts = ShardOptions(filters=QualityFilters(min_chars=10))
    # The workers clean and filter; the main process de-duplicates their digests.
    cleaner = Cleaner()
    selection = Selection(opts, cleaner)
    texts = [short, short, long, long]
    batch = TokenizedBatch(
        digests=b"".join(text_digest(t) for t in texts), chars=np.array([len(t) for t in texts]),
        lengths=np.array([3, 3, 9, 9]), tokens=np.zeros(18, dtype=np.uint32), drops={},
        reasons=np.array([REASON_CODES["too_short_chars"]] * 2 + [0, 0], dtype=np.int8),
    )  # fmt: skip
    selected = selection.select(batch, lambda row: None, deduped=False)
    assert selected.indexed.tolist() == [2]
    assert cleaner.drops.as_dict() == {"duplicate": 1, "too_short_chars": 2}
    assert selection.dropped_tokens == {"too_short_chars": 6}
    # The main process cleans and de-duplicates before the workers: a short text goes on to the filter.
    cleaner = Cleaner()
    Selection(opts, cleaner)
    kept = [cleaner.clean_with_digest(t) for t in texts]
    assert [k is not None for k in kept] == [True, True, True, False]
    assert cleaner.drops.as_dict() == {"duplicate": 1}


def test_the_main_process_or_the_workers_decide_alike(tmp_path, planted, small_tokenizer):
    runs = {}
    for main_works in (True, False):
        out = tmp_path / f"main-{main_works}"
        runs[main_works] = convert(
            planted, small_tokenizer, out, main_works=main_works, filters=QualityFilters.recommended()
        )
    assert runs[True].dropped == runs[False].dropped and runs[True].dropped["near_duplicate"] > 0
    assert runs[True].dropped_tokens == runs[False].dropped_tokens
    assert runs[True].splits == runs[False].splits
    for split in ("train", "val"):
        assert np.array_equal(
            local_samples(str(tmp_path / "main-True"), split),
            local_samples(str(tmp_path / "main-False"), split),
        )
    reports = [
        (tmp_path / f"main-{m}" / "near_duplicates.json").read_text(encoding="utf-8") for m in (True, False)
    ]
    assert reports[0] == reports[1]


@pytest.mark.slow
def test_two_workers_keep_what_one_keeps(tmp_path, planted, small_tokenizer):
    one = convert(planted, small_tokenizer, tmp_path / "one")
    two = convert(planted, small_tokenizer, tmp_path / "two", workers=2)
    assert one.dropped == two.dropped and one.splits == two.splits
    for split in ("train", "val"):
        assert np.array_equal(
            local_samples(str(tmp_path / "one"), split), local_samples(str(tmp_path / "two"), split)
        )


# --- chains ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chains(tmp_path_factory, small_corpus_docs) -> str:
    """Real documents and 24 edit chains A -> B -> C -> D (1.5 % of the characters edited at each
    step: exact Jaccard about 0.86 between neighbours, about 0.76 two steps apart), the links
    later in the input, over three files."""
    folder = tmp_path_factory.mktemp("chains")
    rng = random.Random(3)
    rows = list(small_corpus_docs[:150])
    for n, original in enumerate(rng.sample([d for d in small_corpus_docs[:150] if len(d) >= 600], 24)):
        link, at = original, rows.index(original)
        for step in range(3):
            link = edited_copy(link, 0.015, 100 * n + step)
            at = rng.randint(at + 1, len(rows))
            rows.insert(at, link)
    third = len(rows) // 3
    for i, part in enumerate((rows[:third], rows[third : 2 * third], rows[2 * third :])):
        write_jsonl(folder / f"part-{i}.jsonl", part)
    return str(folder)


@pytest.mark.slow
def test_chains_are_counted_and_the_kept_rule_decided_alike_in_memory_in_index_processes_and_merged(
    tmp_path, chains, small_tokenizer
):
    """Under "any" a chain's later links go through links that went too: counted in summary.json
    and the summary's line. Under "kept" a link goes only when near a kept one (A kept, B gone, C
    kept, D gone when C is not near A). Each rule decides alike with the index in this process,
    in two index processes, and as three tasks and a merge."""
    done = {}
    for rule in ("any", "kept"):
        kwargs = dict(near_dedup=NearDedupOptions(threshold=0.8, rule=rule), val_fraction=0.0)
        runs = {
            "here": convert_corpus([chains], tokenizer=small_tokenizer, out=str(tmp_path / f"{rule}-here"),
                                   options=options(**kwargs)),
            "index processes": convert_corpus([chains], tokenizer=small_tokenizer,
                                              out=str(tmp_path / f"{rule}-processes"),
                                              options=options(index_processes=2, **kwargs)),
        }  # fmt: skip
        for index in range(3):
            convert_corpus([chains], tokenizer=small_tokenizer, out=str(tmp_path / f"{rule}-merged"),
                           options=options(**kwargs), task=TaskSpec(3, index))  # fmt: skip
        runs["merged"] = merge_tasks(str(tmp_path / f"{rule}-merged"), workers=1, progress=False)
        here = runs["here"]
        for name, run in runs.items():
            assert run.dropped == here.dropped, name
            assert run.near_dedup.through_removed == here.near_dedup.through_removed, name
            folder = tmp_path / f"{rule}-{dict(here='here', merged='merged').get(name, 'processes')}"
            assert np.array_equal(
                local_samples(str(folder), "train"), local_samples(str(tmp_path / f"{rule}-here"))
            )
            saved = json.loads((folder / "summary.json").read_text())["near_dedup"]
            assert (
                saved["rule"] == rule
                and saved["dropped_only_through_dropped"] == here.near_dedup.through_removed
            )
        done[rule] = here
    near_any, near_kept = done["any"].dropped["near_duplicate"], done["kept"].dropped["near_duplicate"]
    assert 24 * 3 >= near_any > near_kept >= 24  # every B goes under both rules
    # every document "any" drops beyond "kept" went only through a dropped one
    assert done["any"].near_dedup.through_removed >= near_any - near_kept > 12
    assert done["kept"].near_dedup.through_removed == 0


# --- across machines -------------------------------------------------------------------------------


def test_three_tasks_and_a_merge_equal_one_machine(tmp_path, planted, small_tokenizer):
    kwargs = dict(filters=QualityFilters.recommended(), chunk_chars=7_000)
    single = convert(planted, small_tokenizer, tmp_path / "single", **kwargs)
    out = tmp_path / "tasks"
    markers = [
        convert_corpus(
            [planted.folder],
            tokenizer=small_tokenizer,
            out=str(out),
            options=options(**kwargs),
            task=TaskSpec(3, index),
        )  # fmt: skip
        for index in (2, 0, 1)  # any order
    ]
    assert sorted(len(m.files) for m in markers) == [1, 1, 1]
    # Copies planted across files: some duplicates are only found by the merge.
    assert sum(m.dropped.get("duplicate", 0) for m in markers) < single.dropped["duplicate"]
    assert all("near_duplicate" not in m.dropped for m in markers)
    assert not (out / "train" / "index.json").exists()
    merged = merge_tasks(str(out), workers=1, progress=False)

    for key in ("dropped", "dropped_tokens", "splits", "read"):
        assert getattr(merged, key) == getattr(single, key), key
    assert merged.dropped["near_duplicate"] > 0 and merged.tasks == 3
    for split in ("train", "val"):
        assert np.array_equal(local_samples(str(out), split), local_samples(str(tmp_path / "single"), split))
        meta = [
            json.loads((folder / split / "meta.json").read_text()) for folder in (out, tmp_path / "single")
        ]
        for m in meta:
            del m["created_at"], m["command"]
        assert meta[0] == meta[1]
    reports = [
        (folder / "near_duplicates.json").read_text(encoding="utf-8") for folder in (out, tmp_path / "single")
    ]
    assert reports[0] == reports[1]


def test_a_merge_refuses_missing_or_mismatched_tasks(tmp_path, planted, small_corpus_docs, small_tokenizer):
    out = tmp_path / "out"

    def task(index: int, **overrides) -> None:
        convert_corpus(
            [planted.folder], tokenizer=small_tokenizer, out=str(out), options=options(**overrides),
            task=TaskSpec(3, index),
        )  # fmt: skip

    task(0)
    task(1)
    with pytest.raises(ConvertError, match="task 2 of 3 has not finished"):
        merge_tasks(str(out), progress=False)
    task(2, seq_len=128)
    with pytest.raises(ConvertError, match=r"task 2 differs from task 0 in seq_len \(128 vs 64\)"):
        merge_tasks(str(out), progress=False)
    other = tmp_path / "other.model"
    from convert.tokens.tokenizer import train_tokenizer

    train_tokenizer(small_corpus_docs[:200], vocab_size=2200, out=str(other), character_coverage=0.98)
    convert_corpus(
        [planted.folder], tokenizer=str(other), out=str(out), options=options(), task=TaskSpec(3, 2)
    )
    with pytest.raises(ConvertError, match="task 2 differs from task 0 in tokenizer_sha256"):
        merge_tasks(str(out), progress=False)
    with pytest.raises(ConvertError, match="--near-dedup removes exact duplicates too"):
        convert_corpus(
            [planted.folder], tokenizer=small_tokenizer, out=str(out), options=options(),
            read=ReadOptions(dedup=False), task=TaskSpec(3, 2),
        )  # fmt: skip
    assert not (out / "train").exists() and not (out / "summary.json").exists()
    task(2)
    assert merge_tasks(str(out), progress=False).tasks == 3


def test_tasks_get_contiguous_runs_of_files_balanced_by_bytes():
    runs = assign_files([10, 10, 10, 10, 10, 10], 3)
    assert runs == [range(0, 2), range(2, 4), range(4, 6)]
    runs = assign_files([100, 1, 1, 1, 1, 96], 2)
    assert runs == [range(0, 1), range(1, 6)]  # 100 bytes each
    runs = assign_files([5], 4)
    assert sum(len(r) for r in runs) == 1 and [len(r) for r in runs].count(0) == 3
    assert [i for r in assign_files([3, 0, 0, 7, 2, 9, 1], 4) for i in r] == list(range(7))


def test_the_task_comes_from_the_options_or_a_slurm_array():
    assert TaskSpec.from_args(None, None) is None
    assert TaskSpec.from_args(4, 2) == TaskSpec(4, 2)
    assert TaskSpec.from_args(4, None, {"SLURM_ARRAY_TASK_ID": "3"}) == TaskSpec(4, 3)
    assert TaskSpec.from_args(4, None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"}) == TaskSpec(
        4, 3
    )
    with pytest.raises(ConvertError, match="--task-index 1 needs --num-tasks"):
        TaskSpec.from_args(None, 1)
    with pytest.raises(ConvertError, match="SLURM_ARRAY_TASK_ID"):
        TaskSpec.from_args(4, None, {})
    with pytest.raises(ConvertError, match="task index 4 is outside 0..3"):
        TaskSpec.from_args(4, 4)


@pytest.mark.slow
def test_a_killed_run_with_near_dedup_resumes_to_the_fresh_result(
    tmp_path, chinese_documents, small_tokenizer
):
    docs = list(chinese_documents)
    rng = random.Random(1)
    for n, original in enumerate(rng.sample(range(len(docs) // 2), 150)):
        docs.insert(rng.randint(original + 1, len(docs)), edited_copy(docs[original], 0.01, n))
    write_jsonl(tmp_path / "big.jsonl", docs)
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "convert", "shards", str(tmp_path / "big.jsonl"), "--tokenizer", small_tokenizer,
        "--out", str(out), "--seq-len", str(SEQ), "--workers", "1", "--chunk-chars", "20000", "--no-progress",
        "--near-dedup", "--filters",
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = out / "train" / "part-00004" / "part.json"
    wait_for_file(marker, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), proc.stderr.read()
    resumed = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "reused from the interrupted run" in resumed.stdout
    fresh = tmp_path / "fresh"
    done = subprocess.run(
        [a if a != str(out) else str(fresh) for a in args], cwd=REPO_ROOT, capture_output=True, timeout=300
    )
    assert done.returncode == 0
    for split in ("train", "val"):
        assert np.array_equal(local_samples(str(out), split), local_samples(str(fresh), split))
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (out, fresh)]
    assert (
        summaries[0]["dropped"] == summaries[1]["dropped"]
        and summaries[0]["dropped"]["near_duplicate"] >= 140
    )
