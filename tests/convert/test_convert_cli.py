"""`python -m convert`: fast help, one-line errors (exit 2), bad input reported, .bin import."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import sentencepiece as spm

from tests.support.conversion import REPO_ROOT, local_samples, run_convert
from tests.support.corpus import english_documents, write_jsonl


def shards_args(inputs, tokenizer, out, *extra) -> list[str]:
    return ["shards", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out), "--seq-len", "64",
            "--workers", "1", "--no-progress", *extra]  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys; from convert.cli import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'streaming', 'sentencepiece', 'boto3', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr
    assert run_convert("--help").returncode == 0


def test_malformed_lines_are_counted_with_file_and_line(tmp_path, small_corpus_docs, small_tokenizer):
    corpus = tmp_path / "c.jsonl"
    write_jsonl(corpus, small_corpus_docs[:80])
    lines = corpus.read_bytes().splitlines(keepends=True)
    lines.insert(4, b'{"text": "broken\n')  # line 5: invalid JSON
    lines.insert(9, b'{"text": "\xff\xfe bad bytes"}\n')  # line 10: invalid UTF-8
    lines.insert(14, b'{"body": "no text field"}\n')  # line 15: missing field
    corpus.write_bytes(b"".join(lines))
    result = run_convert(*shards_args([corpus], small_tokenizer, tmp_path / "out", "--val-fraction", "0"))
    assert result.returncode == 0, result.stderr
    assert "malformed records skipped: 3" in result.stdout
    for line in (5, 10, 15):
        assert f"{corpus}:{line}:" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["read"]["malformed"] == 3 and summary["read"]["documents"] == 80
    assert [e["line"] for e in summary["read"]["malformed_examples"]] == [5, 10, 15]

    strict = run_convert(*shards_args([corpus], small_tokenizer, tmp_path / "strict", "--strict"))
    assert_one_line_error(strict, f"{corpus}:5", "--strict")
    assert not (tmp_path / "strict" / "train" / "index.json").exists()


def test_missing_text_field(tmp_path, small_corpus, small_tokenizer):
    result = run_convert(*shards_args([small_corpus], small_tokenizer, tmp_path / "o", "--field", "content"))
    assert_one_line_error(result, "no documents found", "'content'")


def test_empty_corpus(tmp_path, small_tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(
        run_convert(*shards_args([empty], small_tokenizer, tmp_path / "o")), "no documents found"
    )


def test_tokenizer_path_that_does_not_exist(tmp_path, small_corpus):
    missing = tmp_path / "missing.model"
    result = run_convert(*shards_args([small_corpus], str(missing), tmp_path / "o"))
    assert_one_line_error(result, f"tokenizer {missing} does not exist")
    assert not (tmp_path / "o").exists()


def test_output_already_exists(tmp_path, small_corpus, small_tokenizer):
    out = tmp_path / "o"
    assert run_convert(*shards_args([small_corpus], small_tokenizer, out)).returncode == 0
    before = (out / "train" / "index.json").read_bytes()
    result = run_convert(*shards_args([small_corpus], small_tokenizer, out))
    assert_one_line_error(result, str(out), "--overwrite")
    assert (out / "train" / "index.json").read_bytes() == before


def test_bad_option_is_one_line_error(tmp_path, small_corpus, small_tokenizer):
    result = run_convert(*shards_args([small_corpus], small_tokenizer, tmp_path / "o", "--seq-len", "1"))
    assert_one_line_error(result, "--seq-len 1")


def test_import_bin_matches_text_conversion(tmp_path, small_corpus_docs, small_tokenizer):
    """baby-llama2-chinese's layout (uint16 ids, EOS after each document) gives the text path's samples."""
    from convert.filters.cleaning import Cleaner

    docs = [t for t in (Cleaner().clean(d) for d in small_corpus_docs[:120]) if t]
    sp = spm.SentencePieceProcessor(model_file=small_tokenizer)
    ids = [np.array(sp.encode(d) + [sp.eos_id()], dtype=np.uint16) for d in docs]
    half = len(ids) // 2
    (tmp_path / "a.bin").write_bytes(np.concatenate(ids[:half]).tobytes())
    (tmp_path / "b.bin").write_bytes(np.concatenate(ids[half:]).tobytes())
    write_jsonl(tmp_path / "c.jsonl", docs)

    args = [
        "--tokenizer",
        small_tokenizer,
        "--seq-len",
        "64",
        "--val-fraction",
        "0",
        "--workers",
        "1",
        "--no-progress",
    ]
    bin_run = run_convert("import-bin", str(tmp_path / "a.bin"), str(tmp_path / "b.bin"), "--out",
                          str(tmp_path / "from_bin"), *args)  # fmt: skip
    assert bin_run.returncode == 0, bin_run.stderr
    text_run = run_convert("shards", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "from_text"), *args)
    assert text_run.returncode == 0, text_run.stderr
    from_bin = local_samples(str(tmp_path / "from_bin"))
    assert len(from_bin) > 100
    assert np.array_equal(from_bin, local_samples(str(tmp_path / "from_text")))

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    odd = run_convert("import-bin", str(tmp_path / "odd.bin"), "--out", str(tmp_path / "odd"), *args)
    assert_one_line_error(odd, "odd number of bytes")
    (tmp_path / "big.bin").write_bytes(np.array([5, 60000, 2], dtype=np.uint16).tobytes())
    wrong = run_convert("import-bin", str(tmp_path / "big.bin"), "--out", str(tmp_path / "w"), *args)
    assert_one_line_error(wrong, "60000", "outside the tokenizer's vocabulary (2000)")


def test_demo_corpus_subcommand(tmp_path):
    out = tmp_path / "demo.jsonl"
    result = run_convert("demo-corpus", "--out", str(out), "--max-chars", "20000")
    assert result.returncode == 0, result.stderr
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert isinstance(first["text"], str) and first["text"]


def test_bad_near_dedup_filter_and_task_options_are_one_line_errors(tmp_path, small_corpus, small_tokenizer):
    out = tmp_path / "o"
    cases = [
        (["--near-dedup", "0"], "--near-dedup threshold 0.0 must be in (0, 1]"),
        (["--near-dedup", "1.5"], "must be in (0, 1]"),
        (
            ["--near-dedup", "--shingle", "8", "--min-chars", "5"],
            "--shingle 8 is longer than the shortest document",
        ),
        (["--near-dedup", "--no-dedup"], "drop --no-dedup"),
        (["--shingle", "3"], "--shingle only applies to near-duplicate removal"),
        (["--max-symbol-share", "2"], "--max-symbol-share 2.0 must be a share in [0, 1]"),
        (["--task-index", "1"], "--task-index 1 needs --num-tasks"),
        (["--num-tasks", "3", "--task-index", "3"], "task index 3 is outside 0..2"),
    ]
    for extra, fragment in cases:
        assert_one_line_error(
            run_convert(*shards_args([small_corpus], small_tokenizer, out, *extra)), fragment
        )
        assert not out.exists(), extra  # nothing written


def test_slurm_array_tasks_then_merge_equal_one_run(tmp_path, small_corpus_docs, small_tokenizer):
    for i in range(3):
        write_jsonl(
            tmp_path / "in" / f"{i}.jsonl",
            small_corpus_docs[i * 100 : (i + 1) * 100] + small_corpus_docs[:10],
        )
    inputs = [tmp_path / "in"]
    extra = ("--near-dedup", "--filters", "--val-fraction", "0.1")
    single = run_convert(*shards_args(inputs, small_tokenizer, tmp_path / "single", *extra))
    assert single.returncode == 0, single.stderr
    for array_id in (1, 2, 3):  # sbatch --array=1-3
        env = {"SLURM_ARRAY_TASK_ID": str(array_id), "SLURM_ARRAY_TASK_MIN": "1"}
        task = run_convert(
            *shards_args(inputs, small_tokenizer, tmp_path / "multi", *extra, "--num-tasks", "3"), env=env
        )
        assert task.returncode == 0, task.stderr
        assert f"task {array_id - 1} of 3" in task.stdout
    merged = run_convert("merge", "--out", str(tmp_path / "multi"), "--workers", "1", "--no-progress")
    assert merged.returncode == 0, merged.stderr
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("single", "multi")]
    assert summaries[0]["dropped"] == summaries[1]["dropped"]
    assert summaries[0]["dropped"]["duplicate"] == 30  # 10 inside each file: 20 of them across tasks
    for split in ("train", "val"):
        assert np.array_equal(
            local_samples(str(tmp_path / "single"), split), local_samples(str(tmp_path / "multi"), split)
        )
    again = run_convert("merge", "--out", str(tmp_path / "multi"), "--no-progress")
    assert_one_line_error(again, "already holds a complete conversion", "--overwrite")


def test_filters_fit_any_language_and_a_filter_that_drops_nearly_everything_is_named(
    tmp_path, small_tokenizer, small_corpus_docs
):
    """The README's command (`--filters --near-dedup 0.8`) on an English corpus keeps it: the CJK
    share, which dropped every document, comes only with a Chinese corpus's preset (or when given).
    With such a preset on a mostly English corpus, one warning line names the filter and its
    share of the documents read."""
    english = english_documents(100)
    corpus = tmp_path / "english.jsonl"
    write_jsonl(corpus, english)
    result = run_convert(
        *shards_args(
            [corpus],
            small_tokenizer,
            tmp_path / "en",
            "--format",
            "jsonl",
            "--filters",
            "--near-dedup",
            "0.8",
        )
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "en" / "summary.json").read_text())
    assert summary["filters"]["min_cjk_share"] == 0.0 and "low_cjk" not in summary["dropped"]
    kept = sum(split["documents"] for split in summary["splits"].values())
    assert kept > 0.9 * len(english), summary["dropped"]
    assert "warning: " not in result.stderr

    mixed = tmp_path / "mixed.jsonl"
    write_jsonl(mixed, english + small_corpus_docs[:5])
    chinese = run_convert(
        *shards_args(
            [mixed], small_tokenizer, tmp_path / "zh", "--preset", "c4-zh", "--filters", "--val-fraction", "0"
        )
    )
    assert chinese.returncode == 0, chinese.stderr
    summary = json.loads((tmp_path / "zh" / "summary.json").read_text())
    assert summary["filters"]["min_cjk_share"] == 0.3 and summary["dropped"]["low_cjk"] >= len(english)
    warnings = [line for line in chinese.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: --min-cjk-share 0.3 (low_cjk) dropped {summary['dropped']['low_cjk']:,} of the "
        f"{len(english) + 5:,} documents read ({100 * summary['dropped']['low_cjk'] / (len(english) + 5):.1f} %): "
        "check that it fits this corpus (its language, its kind of text), and lower it or leave it out"
    ]


def test_the_plan_line_names_the_expected_peak_and_a_budget_past_the_machine_is_warned(
    tmp_path, small_corpus, small_tokenizer
):
    """The plan line says what the job's processes peak within (the budget and each process's own
    memory); a budget that with them passes this machine's memory (or its container's limit) is
    one warning line naming the budget that fits, and the conversion goes on."""
    from convert.budget import PROCESS_BYTES, budget_warning, format_size, machine_memory

    result = run_convert(
        *shards_args([small_corpus], small_tokenizer, tmp_path / "big", "--memory-budget", "64TB")
    )
    assert result.returncode == 0, result.stderr
    peak = format_size((64 << 40) + 2 * PROCESS_BYTES)
    plan = next(line for line in result.stdout.splitlines() if line.startswith("memory budget 64.0 TiB"))
    assert plan.endswith(
        f"in memory; the job's 2 processes peak within about {peak} (the budget and {format_size(PROCESS_BYTES)} each)"
    )
    machine = machine_memory()
    assert result.stderr.splitlines() == [
        f"warning: --memory-budget 64.0 TiB and 2 processes (about {peak} at the peak) are more than this machine's "
        f"memory or its container's limit ({format_size(machine)}): the job may be killed; give --memory-budget "
        f"{format_size(machine - 2 * PROCESS_BYTES)} or less"
    ]
    assert budget_warning(8 << 30, 17, machine=16 << 30) is None
    assert "use fewer --workers" in budget_warning(1 << 30, 64, machine=2 << 30)
