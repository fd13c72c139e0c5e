"""De-duplication and the merge at scale: `python -m bench.dedup_scale` (or `make bench-dedup-scale`).

Three parts, figures and ratios (not a pass/fail test), and a fourth on its own (`--whole-job`):

  1. memory (synthetic, `--sizes`, default 1 M, 3 M and 10 M documents): tasks are written by the
     converter's own task writer (convert/run/tasks.py `TaskWriter`) from synthetic rows, since
     cleaning and tokenizing 10 M documents would take hours on 2 cores: random 16-byte digests
     (5 % of the documents exact copies of an earlier one), signatures of 256 random 64-bit bins
     with the converter's band keys (`minhash.band_keys`) and 8-bit sketches (10 % of the
     documents near copies of an earlier one, 3-12 % of their bins changed: most above the
     threshold, some under it), 3 % dropped by a filter, 2-6 tokens each. Then the real merge
     (`python -m convert merge`) in a child process, with and without `--memory-budget` (256 MB:
     spilling and many partitions), exact de-duplication alone and with near-duplicates. A sampler
     reads the anonymous memory (Pss_Anon: shared pages split between the processes that map
     them; the sketch files the near stage maps are page cache, reported apart) of the merge and
     its workers every 0.1 s: peak of the whole tree and of the main process, each less the same
     merge's on 20 k documents (the interpreters, numpy, SentencePiece: fixed costs), per
     document; the main process's steady corpus-sized state (its duplicate bitmaps, computed);
     and the tasks' writer the same way. For
     comparison, one machine's in-memory state (the band index and sketches of
     convert/dedup/near_dedup.py, the Python set of exact digests) per document.
  2. the merge's main process against the tasks (real text: People's Daily articles, long, and
     review sentences, short, recombined into more documents, converted as 3 tasks with
     --near-dedup --filters, each task on one worker), at two sizes (`--long-copies`,
     `--short-copies`): what the tasks' CPU and the merge's main process's CPU grow by from the
     small size to the large, per document and per token; "the merge keeps up with N task cores"
     = the tasks' growth over the main process's, its cost per document at scale (the issue
     measured 6-17 before this change). Each merge runs `--merges` times, the sizes in turn, and
     the least CPU is kept: this machine is shared, and a merge's main process takes a few tenths
     of a second.
  3. a projection for 600 M and 6 B documents of 2,000 tokens (1.2 T and 12 T tokens) from the
     measured costs: memory, disk, and hours on M machines of 64 cores (tasks on all of them; the
     merge's stages and part writing on one machine's 64 cores, its ordered pass on one core).
  4. `--whole-job DOCS`: a whole one-machine conversion of DOCS real short documents (review
     sentences recombined) under `--budget`, one command (a task, then the merge): the process
     tree's peak against the budget plus the fixed costs (20 k documents), and the plan line's
     expected peak; then the near rules (`--near-rule any` and `kept`) on `--rule-docs`
     documents: drops, those only through dropped documents, the merge's main process CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_S = 0.1
BASELINE_DOCS = 20_000
BATCH = 10_000
TASKS = 4


# --- synthetic tasks -------------------------------------------------------------------------------


@dataclass
class Pool:
    """Recent passing documents (their digests and signatures), that later ones copy."""

    digests: np.ndarray
    signatures: np.ndarray
    size: int = 0

    def add(self, digests: np.ndarray, signatures: np.ndarray) -> None:
        at = (self.size + np.arange(len(digests))) % len(self.digests)
        self.digests[at], self.signatures[at] = digests, signatures
        self.size += len(digests)

    def pick(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(0, min(self.size, len(self.digests)), size=count)


def synthetic_batch(n: int, options, rng: np.random.Generator, pool: Pool, first_position: int):
    """A `Selected` batch of synthetic rows (module docstring, part 1)."""
    from convert.dedup.minhash import band_keys
    from convert.filters.quality import REASON_CODES
    from convert.records import Selected, TokenizedBatch

    digests = rng.integers(0, 1 << 63, size=(n, 2), dtype=np.uint64)
    reasons = np.where(rng.random(n) < 0.03, REASON_CODES["symbols"], 0).astype(np.int8)
    passing = np.flatnonzero(reasons == 0)
    near = options.near_dedup
    signatures = None
    if near is not None:
        signatures = rng.integers(0, 1 << 63, size=(len(passing), near.bins), dtype=np.uint64)
    if pool.size:
        copies = passing[rng.random(len(passing)) < 0.05]  # exact copies of an earlier document
        source = pool.pick(rng, len(copies))
        digests[copies] = pool.digests[source]
        if signatures is not None:
            among = np.searchsorted(passing, copies)
            signatures[among] = pool.signatures[source]
            near_rows = np.flatnonzero(rng.random(len(passing)) < 0.10)
            near_rows = near_rows[~np.isin(passing[near_rows], copies)]
            originals = pool.signatures[pool.pick(rng, len(near_rows))].copy()
            changed = rng.random(originals.shape) < rng.uniform(0.03, 0.12, size=(len(near_rows), 1))
            originals[changed] = rng.integers(0, 1 << 63, size=int(changed.sum()), dtype=np.uint64)
            signatures[near_rows] = originals
    keys = sketches = None
    if signatures is not None:
        keys = band_keys(signatures, near)
        sketches = (signatures & np.uint64(0xFF)).astype(np.uint8)
        pool.add(digests[passing], signatures)
    lengths = rng.integers(2, 7, size=n).astype(np.int64)
    tokens = rng.integers(3, 1000, size=int(lengths[passing].sum())).astype(np.uint32)
    batch = TokenizedBatch(
        digests=digests.tobytes(), chars=rng.integers(200, 3000, size=n).astype(np.int64), lengths=lengths,
        tokens=tokens, drops={}, reasons=reasons if reasons.any() else None, keys=keys, sketches=sketches,
    )  # fmt: skip
    return Selected(
        batch=batch, indexed=passing, match=np.full(len(passing), -1), filtered=np.flatnonzero(reasons != 0),
        first_position=first_position,
    )  # fmt: skip


def synthesize(out: Path, docs: int, near: bool, budget: int, tokenizer: str, seed: int) -> None:
    """TASKS synthetic tasks of `docs` documents in all under OUT/tasks (as `convert shards --num-tasks`)."""
    from convert.dedup.options import NearDedupOptions
    from convert.reading.options import ReadOptions
    from convert.run.options import ShardOptions
    from convert.run.tasks import MARKER, TaskMarker, TaskWriter, settings_of, task_folder, write_sample
    from shards.output import open_output
    from shards.tokenizer import Tokenizer

    loaded = Tokenizer(tokenizer)
    options = ShardOptions(
        seq_len=64,
        val_fraction=0.01,
        min_tokens=1,
        near_dedup=NearDedupOptions() if near else None,
        memory_budget=budget,
    ).resolve(loaded.info())
    store = open_output(str(out))
    rng = np.random.default_rng(seed)
    bins = options.near_dedup.bins if near else 1
    pool = Pool(np.zeros((8192, 2), dtype=np.uint64), np.zeros((8192, bins), dtype=np.uint64))
    settings = settings_of(options, ReadOptions(), loaded.info().sha256, "synthetic", TASKS)
    for index in range(TASKS):
        count = docs // TASKS + (1 if index < docs % TASKS else 0)
        start = time.monotonic()
        writer = TaskWriter(store, task_folder(index), options, budget)
        with writer:
            for lo in range(0, count, BATCH):
                writer.add(synthetic_batch(min(BATCH, count - lo), options, rng, pool, writer.passing))
            writer.finish()
        for name, data in loaded.files.items():
            store.write_bytes(f"{task_folder(index)}/{name}", data)
        sample = write_sample(store, task_folder(index), None)
        marker = TaskMarker(
            task=index, settings=settings, files=[], dropped_before_selection={}, dropped={}, dropped_tokens={},
            read={"files": 0, "documents": count, "malformed": 0, "malformed_examples": []},
            pieces=writer.pieces, rows=writer.rows, passing=writer.passing, digest_runs=writer.digest_runs,
            key_runs=writer.key_runs, sketches=writer.sketches, sample=sample, elapsed_s=round(time.monotonic() - start, 3),
            finished_at=time.time(), command="python -m bench.dedup_scale (synthetic)",
        )  # fmt: skip
        store.write_json(f"{task_folder(index)}/{MARKER}", marker.to_json())


# --- measuring a child process ---------------------------------------------------------------------


@dataclass
class Measured:
    wall_s: float
    peak_total: int  # anonymous PSS of the process and its children together, at its highest sample
    peak_main: int  # the main process's own anonymous PSS at its highest
    peak_file: int  # mapped files' PSS of them all (page cache: the sketch files), at its highest
    main_cpu_s: float
    children_cpu_s: float
    stdout: str


def rollup(pid: int) -> tuple[int, int]:
    """A process's proportional set size of anonymous memory and of mapped files, in bytes (0, 0
    once it is gone): the first is what it takes from the machine; the second is page cache, mapped
    (the sketch files), that the kernel can take back."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)
    return tuple(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("Pss_Anon", "Pss_File"))


def measure(args: list[str], env: dict | None = None) -> Measured:
    """Run `python ARGS` (a child that prints its rusage as the last line of JSON), sampling its
    and its children's anonymous memory (Pss_Anon) every SAMPLE_S."""
    import psutil

    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    peaks = {"total": 0, "main": 0, "file": 0}
    done = threading.Event()

    def sample() -> None:
        parent = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                pids = [proc.pid] + [child.pid for child in parent.children(recursive=True)]
            except psutil.Error:
                return
            sizes = [rollup(pid) for pid in pids]
            main, total = sizes[0][0], sum(anon for anon, _ in sizes)
            peaks["total"], peaks["main"] = max(peaks["total"], total), max(peaks["main"], main)
            peaks["file"] = max(peaks["file"], sum(file for _, file in sizes))
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{stderr[-3000:]}")
    usage = json.loads(stdout.strip().splitlines()[-1])
    return Measured(
        wall_s=time.monotonic() - start, peak_total=peaks["total"], peak_main=peaks["main"], peak_file=peaks["file"],
        main_cpu_s=usage["self"], children_cpu_s=usage["children"], stdout=stdout,
    )  # fmt: skip


def child(argv: list[str]) -> int:
    """`--child synth OUT DOCS NEAR BUDGET TOKENIZER` or `--child merge OUT WORKERS BUDGET`."""
    import resource

    role = argv[0]
    if role == "synth":
        out, docs, near, budget, tokenizer = argv[1:6]
        synthesize(Path(out), int(docs), near == "1", int(budget), tokenizer, seed=int(docs))
    elif role == "merge":
        from convert.run.merge import merge_tasks

        out, workers, budget = argv[1:4]
        merge_tasks(out, workers=int(workers), progress=False, memory_budget=int(budget))
    elif role == "task":
        from convert.cli import main

        main(argv[1:])
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"self": me.ru_utime + me.ru_stime, "children": children.ru_utime + children.ru_stime}))
    return 0


def _bench(*args) -> list[str]:
    return ["-m", "bench.dedup_scale", "--child", *map(str, args)]


def clear_merge(out: Path) -> None:
    """Everything but the tasks: the next merge starts from its plan."""
    for entry in out.iterdir():
        if entry.name != "tasks":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def stage_cpu(out: Path) -> dict[str, float]:
    """CPU seconds of the merge's stage jobs (their markers), by stage."""
    cpu = {"exact": 0.0, "near": 0.0}
    for marker in (out / "merge").glob("*.json"):
        if marker.name != "plan.json":
            cpu[marker.name.split("-")[0]] += json.loads(marker.read_text())["result"]["cpu_s"]
    return cpu


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


# --- part 1 ----------------------------------------------------------------------------------------


def memory_part(
    root: Path,
    sizes: list[int],
    small_budget: int,
    tokenizer: str,
    workers: int,
    default_budget: int,
    kinds: tuple[bool, ...] = (False, True),
) -> dict:
    from convert.budget import format_size, resolve_budget

    # the runs "without" a small budget: the converter's default, or a large one this machine can spare
    default_label = (
        f"{'default' if not default_budget else 'large'} ({format_size(resolve_budget(default_budget))})"
    )

    rows, figures = [], {}
    for near in kinds:
        kind = "exact + near" if near else "exact only"
        base = {}
        for docs in [BASELINE_DOCS, *sizes]:
            out = root / f"synthetic-{int(near)}-{docs}"
            synth = measure(_bench("synth", out, docs, int(near), small_budget, tokenizer))
            task_bytes = folder_bytes(out / "tasks")
            for label, budget in (
                (default_label, default_budget),
                (f"--memory-budget {format_size(small_budget)}", small_budget),
            ):
                clear_merge(out)
                merged = measure(_bench("merge", out, workers, budget))
                plan = json.loads((out / "merge" / "plan.json").read_text())
                cpu = stage_cpu(out)
                key = (near, label)
                if docs == BASELINE_DOCS:
                    base[key] = merged
                    base[("synth", near)] = synth
                    continue
                fixed, fixed_synth = base[key], base[("synth", near)]
                per = {
                    "total": (merged.peak_total - fixed.peak_total) / docs,
                    "main": (merged.peak_main - fixed.peak_main) / docs,
                    "task": (synth.peak_main - fixed_synth.peak_main) / docs,
                }
                steady = (
                    docs / 8 + 0.97 * docs / 4
                )  # the ordered pass's bitmaps: duplicate rows; pids (stages)
                rows.append(
                    f"| {kind} | {docs / 1e6:.0f} M | {label} | {plan['exact_partitions']}/{plan['near_partitions']} | "
                    f"{steady / docs:.2f} | {per['main']:.1f} | {per['total']:.1f} | "
                    f"{format_size(merged.peak_total)} ({format_size(fixed.peak_total)} fixed) | "
                    f"{format_size(merged.peak_file)} | {per['task']:.1f} | "
                    f"{format_size(task_bytes)} | {merged.wall_s:.0f} s | {cpu['exact']:.1f} / {cpu['near']:.1f} s |"
                )
                summary = json.loads((out / "summary.json").read_text())
                figures[(near, docs, label)] = {
                    "docs": docs, "merge": merged, "cpu": cpu, "task_bytes": task_bytes, "synth": synth,
                    "chunks": sum(split["parts"] for split in summary["splits"].values()),
                    "fixed_main_cpu": fixed.main_cpu_s,
                    "key_entries": sum(json.loads(m.read_text())["result"]["entries"]
                                       for m in (out / "merge").glob("near-*.json")),
                    "digest_entries": sum(json.loads(m.read_text())["result"]["entries"]
                                          for m in (out / "merge").glob("exact-*.json")),
                }  # fmt: skip
                print(rows[-1], flush=True)
            if docs != sizes[-1] and docs != BASELINE_DOCS:
                shutil.rmtree(out)
    header = (
        "| dedup | documents | budget | partitions (exact/near) | main steady B/doc | main peak B/doc | "
        "all processes peak B/doc | all processes peak | mapped files (page cache) | task writer peak B/doc | "
        "task files | merge wall | stage CPU (exact / near) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return {"table": "\n".join([header, *rows]), "figures": figures}


def single_machine_state(docs: int) -> tuple[float, float]:
    """Bytes per document of one machine's in-memory state: the band index and sketches (synthetic
    keys, every one new: the worst case), and the exact-duplicate set (a Python set of digests)."""
    import tracemalloc

    from convert.dedup.near_dedup import NearDuplicates
    from convert.dedup.options import NearDedupOptions

    options = NearDedupOptions().resolve(5)
    rng = np.random.default_rng(0)
    near = NearDuplicates(options)
    for _ in range(0, docs, BATCH):
        near.add(rng.integers(0, 1 << 63, size=(BATCH, options.bands), dtype=np.uint64),
                 rng.integers(0, 256, size=(BATCH, options.bins), dtype=np.uint8))  # fmt: skip
    tracemalloc.start()
    seen = set(np.frombuffer(rng.bytes(16 * 200_000), dtype="S16").tolist())
    exact = tracemalloc.get_traced_memory()[0] / len(seen)
    tracemalloc.stop()
    return near.nbytes / near.size, exact


# --- part 2 ----------------------------------------------------------------------------------------


def write_split(folder: Path, texts: list[str], files: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    per = math.ceil(len(texts) / files)
    for i in range(files):
        with open(folder / f"part-{i}.jsonl", "w", encoding="utf-8") as f:
            for text in texts[i * per : (i + 1) * per]:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def recombined(texts: list[str], copies: int) -> list[str]:
    """`texts`, then `copies - 1` more of them, each document's first half joined to the second half
    of another (neither an exact nor a near duplicate: a Jaccard of about 1/3 with each source)."""
    out = list(texts)
    for copy in range(1, copies):
        for i, text in enumerate(texts):
            other = texts[(i + 7919 * copy) % len(texts)]
            out.append(text[: len(text) // 2] + other[len(other) // 2 :])
    return out


def three_tasks(folder: Path, texts: list[str], tokenizer: str) -> tuple[Path, float]:
    """The texts as 3 tasks, one worker each: the output folder and the tasks' CPU seconds."""
    write_split(folder / "in", texts, 3)
    out, task_cpu = folder / "out", 0.0
    for index in range(3):
        task = measure(_bench(
            "task", "shards", folder / "in", "--tokenizer", tokenizer, "--out", out, "--seq-len", "512",
            "--workers", "1", "--no-progress", "--near-dedup", "--filters", "--num-tasks", "3",
            "--task-index", index,
        ))  # fmt: skip
        task_cpu += task.main_cpu_s + task.children_cpu_s
    return out, task_cpu


def real_text(
    root: Path, tokenizer: str, workers: int, copies: dict[str, tuple[int, int]], merges: int
) -> list[dict]:
    """Per corpus, 3 tasks and their merge at two sizes (`copies`: recombined copies, small and
    large); each merge run `merges` times, the two sizes in turn, and the least CPU of each kept
    (the machine is shared: the least is the run least disturbed). What grows from the small size
    to the large is what the merge costs per document at scale; what the two share (starting the
    process and its workers, imports, the pair sample's texts) is not counted."""
    from convert.demo.corpus import peoples_daily_documents, review_sentences

    corpora = {"long": ("People's Daily articles", peoples_daily_documents()),
               "short": ("review sentences", review_sentences())}  # fmt: skip
    results = []
    for kind, (label, texts) in corpora.items():
        sizes = []
        for n in copies[kind]:
            out, task_cpu = three_tasks(root / f"{kind}-{n}", recombined(texts, n), tokenizer)
            sizes.append(
                {"copies": n, "out": out, "task_cpu": task_cpu, "main_cpu": math.inf, "workers_cpu": math.inf}
            )
        for _ in range(merges):
            for size in sizes:
                clear_merge(size["out"])
                merged = measure(_bench("merge", size["out"], workers, 0))
                if merged.main_cpu_s < size["main_cpu"]:
                    size["main_cpu"], size["workers_cpu"] = merged.main_cpu_s, merged.children_cpu_s
                    size["stage_cpu"] = sum(stage_cpu(size["out"]).values())
        for size in sizes:
            out = size.pop("out")
            summary = json.loads((out / "summary.json").read_text())
            size.update(documents=summary["read"]["documents"], tokens=summary["tokens_written"],
                        task_bytes=folder_bytes(out / "tasks"),
                        shard_bytes=folder_bytes(out / "train") + folder_bytes(out / "val"))  # fmt: skip
            shutil.rmtree(out.parent)
        small, large = sizes
        results.append({
            "kind": kind, "label": f"{kind} ({label}, {small['copies']} -> {large['copies']} recombined copies)",
            "small": small, "large": large,
            **{f"d_{key}": large[key] - small[key] for key in ("documents", "tokens", "task_cpu", "main_cpu", "workers_cpu", "stage_cpu")},
        })  # fmt: skip
    return results


def cpu_table(results: list[dict]) -> str:
    lines = [
        "| corpus | documents | tokens | tasks CPU | merge main CPU | per document | per token | "
        "merge workers CPU (stages) | the merge keeps up with | everything counted, large size |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        small, large = r["small"], r["large"]
        tasks, main = r["d_task_cpu"], r["d_main_cpu"]
        keeps = f"{tasks / main:.0f} task cores" if main > 0 else "(no growth measured: rerun)"
        lines.append(
            f"| {r['label']} | +{r['d_documents']:,} ({small['documents']:,} -> {large['documents']:,}) | "
            f"+{r['d_tokens']:,} | +{tasks:.1f} s | +{main:.3f} s ({small['main_cpu']:.3f} -> {large['main_cpu']:.3f}) | "
            f"{main / r['d_documents'] * 1e6:.2f} µs | {main / r['d_tokens'] * 1e9:.2f} ns | "
            f"+{r['d_workers_cpu']:.1f} s (+{r['d_stage_cpu']:.1f} s) | {keeps} | "
            f"{large['task_cpu'] / large['main_cpu']:.0f} task cores |"
        )
    return "\n".join(lines)


# --- part 4 ----------------------------------------------------------------------------------------


def whole_job(
    root: Path, tokenizer: str, docs: int, rule_docs: int, budget: str, workers: int, merges: int
) -> str:
    """The whole of a one-machine conversion under `--memory-budget`: review sentences recombined
    into `docs` short documents, `shards --near-dedup --filters --memory-budget BUDGET` (its state
    passes the budget: one task, then the merge, in one command); the process tree's peak against
    the budget plus the fixed costs (the same job on 20 k documents, as a task and a merge: the
    peak of the two). Then the near rules on `rule_docs` documents: a task and its merge each, the
    merge's main process CPU (the ordered pass; the least of `merges` runs)."""
    from convert.budget import format_size, parse_size
    from convert.demo.corpus import review_sentences

    sentences = review_sentences()
    common = ["--tokenizer", tokenizer, "--seq-len", "512", "--workers", str(workers), "--no-progress",
              "--near-dedup", "--filters", "--memory-budget", budget]  # fmt: skip
    small = root / "job-small"
    write_split(small / "in", sentences[:BASELINE_DOCS], 3)
    fixed = max(
        measure(_bench("task", "shards", small / "in", "--out", small / "out", *common, "--num-tasks", "1",
                       "--task-index", "0")).peak_total,
        measure(_bench("task", "merge", "--out", small / "out", "--workers", workers, "--no-progress",
                       "--memory-budget", budget)).peak_total,
    )  # fmt: skip
    large = root / "job-large"
    write_split(large / "in", recombined(sentences, math.ceil(docs / len(sentences)))[:docs], 3)
    job = measure(_bench("task", "shards", large / "in", "--out", large / "out", *common))
    summary = json.loads((large / "out" / "summary.json").read_text())
    plan = next(line for line in job.stdout.splitlines() if line.startswith("memory budget"))
    size = parse_size(budget)
    lines = [
        f"{summary['read']['documents']:,} documents, --memory-budget {budget}, {workers} workers: {plan.split('; ')[-1]}",
        "| | peak, all processes | main process | over the budget plus the fixed costs |",
        "|---|---|---|---|",
        f"| 20 k documents (fixed costs) | {format_size(fixed)} | | |",
        f"| {docs / 1e6:g} M documents | {format_size(job.peak_total)} | {format_size(job.peak_main)} | "
        f"{format_size(job.peak_total - size - fixed) if job.peak_total > size + fixed else 'no'} "
        f"({format_size(size + fixed)}) |",
    ]
    shutil.rmtree(large)
    rules = root / "rules"
    write_split(rules / "in", recombined(sentences, math.ceil(rule_docs / len(sentences)))[:rule_docs], 3)
    lines += ["", f"near rules on {rule_docs:,} documents (`--near-rule`):",
              "| rule | near duplicates dropped | of them only through dropped ones | merge main process CPU |",
              "|---|---|---|---|"]  # fmt: skip
    for rule in ("any", "kept"):
        out = rules / rule
        measure(_bench("task", "shards", rules / "in", "--out", out, *common, "--near-rule", rule, "--num-tasks",
                       "1", "--task-index", "0"))  # fmt: skip
        cpu = math.inf
        for _ in range(merges):
            clear_merge(out)
            cpu = min(cpu, measure(_bench("task", "merge", "--out", out, "--workers", workers, "--no-progress",
                                          "--memory-budget", budget)).main_cpu_s)  # fmt: skip
        near = json.loads((out / "summary.json").read_text())
        lines.append(
            f"| {rule} | {near['dropped']['near_duplicate']:,} | {near['near_dedup']['dropped_only_through_dropped']:,} "
            f"| {cpu:.2f} s |"
        )
    return "\n".join(lines)


# --- part 3 ----------------------------------------------------------------------------------------


def main_cost(text: list[dict]) -> tuple[float, float]:
    """The merge's main process, CPU seconds per document and per token at scale:
    `main = a * documents + c * tokens` through the growth of the two corpora (long documents, few
    per token; short ones, many), or the larger per-document figure alone when that has no
    positive solution."""
    (d1, t1, m1), (d2, t2, m2) = [(r["d_documents"], r["d_tokens"], r["d_main_cpu"]) for r in text]
    det = d1 * t2 - d2 * t1
    if det:
        a, c = (m1 * t2 - m2 * t1) / det, (d1 * m2 - d2 * m1) / det
        if a > 0 and c > 0:
            return a, c
    return max(m1 / d1, m2 / d2), 0.0


def projection(memory: dict, text: list[dict], machines: list[int], budget: int = 256 << 30) -> str:
    """Hours and sizes for 600 M and 6 B documents of 2,000 tokens (about 2,800 characters), from the
    measured costs: tasks on all machines; the merge's stages and part writing on one machine's 64
    cores, its ordered pass on one core, overlapping the part writing."""
    from convert.dedup.stages import NEAR_BYTES_PER_ENTRY

    long = next(r for r in text if r["kind"] == "long")
    task_cpu_per_token = long["d_task_cpu"] / long["d_tokens"]
    worker_cpu_per_token = (long["d_workers_cpu"] - long["d_stage_cpu"]) / long["d_tokens"]
    big = max((f for (near, _, label), f in memory["figures"].items() if near and not label.startswith("--")),
              key=lambda f: f["docs"])  # fmt: skip
    per_doc, per_token = main_cost(text)
    near_per_entry = big["cpu"]["near"] / max(1, big["key_entries"])
    exact_per_entry = big["cpu"]["exact"] / max(1, big["digest_entries"])
    dedup_bytes = big["task_bytes"] / big["docs"]  # rows, runs and sketches per document (few tokens)
    large = long["large"]
    token_bytes = (large["task_bytes"] - large["documents"] * dedup_bytes) / large["tokens"]
    shard_bytes = large["shard_bytes"] / large["tokens"]
    lines = [
        f"(per document: tasks {task_cpu_per_token * 2000 * 1e3:.2f} ms of CPU; the ordered pass "
        f"{per_doc * 1e6:.2f} µs + {per_token * 1e9:.2f} ns per token; the stages "
        f"{near_per_entry * 1e9:.0f} ns per band key, {exact_per_entry * 1e9:.0f} ns per digest; part writing "
        f"{worker_cpu_per_token * 1e9:.1f} ns per token; task files {dedup_bytes:.0f} B per document + "
        f"{token_bytes:.2f} B per token; shards {shard_bytes:.2f} B per token)",
        "| documents | tokens | machines x 64 cores | tasks | merge stages | ordered pass (1 core) | part writing "
        "(63 cores) | total wall | task files | shards | merge memory: main; each of 64 stage workers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for documents in (600_000_000, 6_000_000_000):
        tokens = documents * 2000
        entries_near, entries_exact = documents * 26 * 0.97, documents * 0.97
        stages_h = (entries_near * near_per_entry + entries_exact * exact_per_entry) / 64 / 3600
        main_h = (documents * per_doc + tokens * per_token) / 3600
        write_h = tokens * worker_cpu_per_token / 63 / 3600
        files = tokens * token_bytes + documents * dedup_bytes
        bitmaps = documents / 8 + documents / 4
        share = (budget * 7 / 8 - bitmaps) / 64
        partitions = math.ceil(entries_near * NEAR_BYTES_PER_ENTRY / share)
        main_memory = bitmaps + partitions * min(4 << 20, budget / 8 / partitions)
        for m in machines:
            tasks_h = tokens * task_cpu_per_token / (m * 64) / 3600
            total = tasks_h + stages_h + max(main_h, write_h)
            lines.append(
                f"| {documents / 1e9:g} B | {tokens / 1e12:g} T | {m} | {tasks_h:.2f} h | {stages_h:.2f} h | "
                f"{main_h:.2f} h | {write_h:.2f} h | {total:.2f} h | {files / 1e12:.1f} TB | "
                f"{tokens * shard_bytes / 1e12:.1f} TB | {main_memory / 1e9:.1f} GB; {share / 1e9:.1f} GB "
                f"({partitions:,} near partitions) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench.dedup_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="1e6,3e6,1e7", help="synthetic documents, comma-separated")
    parser.add_argument("--budget", default="256MB", help="the small budget that forces spilling")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--machines", default="1,8,64")
    parser.add_argument("--no-text", action="store_true", help="skip part 2 (and the projection)")
    parser.add_argument("--text-only", action="store_true", help="part 2 alone (and no projection)")
    parser.add_argument("--near-only", action="store_true", help="part 1 with near-duplicates only")
    parser.add_argument(
        "--default-budget",
        default=None,
        help="the budget of the runs 'without' one (default: the converter's)",
    )
    parser.add_argument(
        "--long-copies", default="10,80", help="part 2: recombined copies of the articles, small,large"
    )
    parser.add_argument(
        "--short-copies",
        default="10,80",
        help="part 2: recombined copies of the review sentences, small,large",
    )
    parser.add_argument(
        "--merges", type=int, default=5, help="part 2: runs of each merge (the least CPU kept)"
    )
    parser.add_argument(
        "--whole-job", type=float, default=None, metavar="DOCS",
        help="part 4 alone: a whole one-machine conversion of DOCS short documents under --budget, and the near rules",
    )  # fmt: skip
    parser.add_argument("--rule-docs", type=float, default=3e5, help="part 4: documents for the near rules")
    args = parser.parse_args(argv)
    from convert.budget import parse_size
    from convert.demo.corpus import peoples_daily_documents
    from convert.tokens.tokenizer import train_tokenizer

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-dedup-scale-"))
    try:
        tokenizer = str(root / "tok.model")
        train_tokenizer(peoples_daily_documents()[:2000], vocab_size=8000, out=tokenizer)
        default = parse_size(args.default_budget) if args.default_budget else 0
        if args.whole_job:
            print(whole_job(root, tokenizer, int(args.whole_job), int(args.rule_docs), args.budget, args.workers,
                            min(args.merges, 3)))  # fmt: skip
            return 0
        memory = None
        if not args.text_only:
            per_doc, exact = single_machine_state(1_000_000)
            print(f"one machine's in-memory state today: band index + sketches {per_doc:.0f} B/document, "
                  f"exact-duplicate set {exact:.0f} B/document", flush=True)  # fmt: skip
            kinds = (True,) if args.near_only else (False, True)
            memory = memory_part(
                root, sizes, parse_size(args.budget), tokenizer, args.workers, default, kinds
            )
            print(memory["table"])
        if not args.no_text:
            copies = {kind: tuple(int(n) for n in value.split(","))
                      for kind, value in (("long", args.long_copies), ("short", args.short_copies))}  # fmt: skip
            text = real_text(root, tokenizer, args.workers, copies, args.merges)
            print(cpu_table(text))
            if memory is not None:
                print(projection(memory, text, [int(m) for m in args.machines.split(",")]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{os.cpu_count()} CPUs here, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
