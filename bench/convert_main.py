"""The conversion's main process on its own: how many workers it can feed (part of `make bench-convert`).

Each setting (plain, exact de-duplication, --near-dedup --filters; the duplicate state in the
main process, as with few workers, or in the index processes 64 workers get: 8 for exact
duplicates, 16 with near duplicates) is converted with 1 worker while every worker result is
recorded (pickled), then replayed with no workers at all:
each task handed out is pickled (the sending) and answered at once with its recorded result,
unpickled (the receiving). The index processes are real in the replay, so with them the main
process sends as fast as it can and they decide several batches at once when they fall behind,
as they would with many workers.

Corpora (bench/convert.py `build_corpus`, copies that are neither exact nor near duplicates):
each setting takes a corpus and its first half on its own (with P index processes ranges are P/2
times larger, so those settings take a corpus twice as large: as many ranges with 8, half as
many with 16). Figures
are CPU seconds of one process, not wall time, so a loaded machine changes them less: the main
process's time inside the worker pool's block (the per-batch work: receiving, deciding, routing,
cutting chunks, handing out parts; not the start, the tail part or the output's small files),
each replay `rounds` times, half and whole corpus in turn. Per document of the second half (the
whole corpus less its half; best round against best round, with the range and median round by
round, and the whole corpus's per document beside it):
  * the main process's CPU per document and per token;
  * one worker's, over a whole corpus (nearly all its time is per document), its index
    processes' time taken out; the least over both corpora and the settings whose workers do
    the same work (plain and exact; near-dedup with filters);
  * "main process feeds at most N workers": the worker's CPU per document over the main
    process's;
  * with index processes, the busiest one's per document, and the workers they keep up with;
    the least of these over the settings as for 64 workers: "the ordered selection feeds at most
    N workers".

This module imports nothing of `bench` so that `--before PATH` can run it against an older
checkout of the converter (in a subprocess, with PATH first on sys.path).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

# label -> (ReadOptions changes, ShardOptions changes)
SETTINGS = {
    "plain (no de-duplication)": ({"dedup": False}, {}),
    "exact de-duplication, in the main process (up to 8 workers)": ({}, {}),
    "exact de-duplication, 8 index processes (64 workers)": ({}, {"partitions": 8}),
    "--near-dedup --filters, in the main process (up to 4 workers)": ({}, {"near": True}),
    "--near-dedup --filters, 16 index processes (64 workers)": ({}, {"near": True, "partitions": 16}),
}
TARGET = 64


@dataclass
class Replays:
    """One setting on one corpus: the recorded run and every replay."""

    documents: int
    tokens: int
    worker_cpu_s: float | None  # the recorded run's one worker (its index processes taken out)
    main_cpu_s: list[float] = field(default_factory=list)  # per replay: this process, per-batch work
    index_cpu_s: list[float] = field(default_factory=list)  # per replay: the busiest index process
    partitions: int = 1


# --- recording and replaying the workers --------------------------------------------------------


class _Recording:
    """A real executor whose results are kept, pickled, by function and submission number."""

    def __init__(self, executor, results: dict) -> None:
        self.executor, self.results, self.counts = executor, results, {}

    def submit(self, fn, arg):
        number = self.counts[fn.__name__] = self.counts.get(fn.__name__, 0) + 1
        return _RecordedTask(self.executor.submit(fn, arg), self.results, (fn.__name__, number))

    def check_workers(self) -> None:
        self.executor.check_workers()


class _RecordedTask:
    def __init__(self, task, results: dict, key) -> None:
        self.task, self.results, self.key = task, results, key

    def get(self):
        value = self.task.get()
        self.results[self.key] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return value


class _Replay:
    """No workers: a task is pickled (the sending) and answered by its recorded result, unpickled."""

    def __init__(self, results: dict) -> None:
        self.results, self.counts = results, {}

    def submit(self, fn, arg):
        from convert.executor import Task

        pickle.dumps(arg, protocol=pickle.HIGHEST_PROTOCOL)
        number = self.counts[fn.__name__] = self.counts.get(fn.__name__, 0) + 1
        return Task(value=pickle.loads(self.results[(fn.__name__, number)]))

    def check_workers(self) -> None:
        pass


@dataclass
class _Measured:
    loop_cpu_s: float = 0.0  # this process inside the worker pool's block: the per-batch work
    index_cpu_s: list[float] = field(default_factory=list)  # each index process, at its close


@contextlib.contextmanager
def _patched(results: dict, record: bool):
    """Conversions inside record their worker results into `results`, or replay them (measuring
    this process's CPU time inside the pool's block); the index processes' CPU seconds, per
    process, are collected as each run closes them."""
    conversion = _converter().conversion
    real = conversion.start_workers
    measured = _Measured()

    @contextlib.contextmanager
    def start(workers, initializer, *initargs):
        if not record:
            initializer(*initargs)  # the replay's worker state lives here (it is never used)
            cpu = time.process_time()
            yield _Replay(results)
            measured.loop_cpu_s += time.process_time() - cpu
        else:
            with real(workers, initializer, *initargs) as executor:
                yield _Recording(executor, results)

    conversion.start_workers = start
    try:
        with _index_cpu(measured.index_cpu_s):
            yield measured
    finally:
        conversion.start_workers = real


@contextlib.contextmanager
def _index_cpu(into: list):
    IndexProcesses = _converter().IndexProcesses
    if IndexProcesses is None:  # the code before issue 21's pipelined index processes
        yield
        return
    real = IndexProcesses.close

    def close(self):
        real(self)
        into.extend(self.cpu_s)

    IndexProcesses.close = close
    try:
        yield
    finally:
        IndexProcesses.close = real


def _converter() -> SimpleNamespace:
    """What this benchmark calls of the converter: in the flat modules convert/ had before its
    stage folders (`--before` an older checkout), else in the stage folders. The flat ones are
    tried first: with the editable install, a stage module an older checkout lacks would be
    found in this one."""
    try:
        import convert.conversion as conversion
        from convert.jobs import ReadOptions, convert_corpus
        from convert.options import NearDedupOptions, QualityFilters, ShardOptions

        try:
            from convert.index_processes import IndexProcesses
        except ImportError:
            IndexProcesses = None
    except ImportError:
        import convert.run.conversion as conversion
        from convert.dedup import NearDedupOptions
        from convert.dedup.index_processes import IndexProcesses
        from convert.filters import QualityFilters
        from convert.reading import ReadOptions
        from convert.run import ShardOptions, convert_corpus
    return SimpleNamespace(
        conversion=conversion, convert_corpus=convert_corpus, ReadOptions=ReadOptions, ShardOptions=ShardOptions,
        QualityFilters=QualityFilters, NearDedupOptions=NearDedupOptions, IndexProcesses=IndexProcesses,
    )  # fmt: skip


def _children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def measure(
    corpora: list[Path], tokenizer: str, out: Path, seq_len: int, setting: str, rounds: int, records: int = 1
) -> list[Replays]:
    """One setting on each corpus: `records` recorded runs, then `rounds` replays of each, in turn."""
    converter = _converter()
    read_changes, shard_changes = SETTINGS[setting]
    near = shard_changes.get("near", False)
    partitions = shard_changes.get("partitions", 1)
    filters = converter.QualityFilters
    options = converter.ShardOptions(
        seq_len=seq_len, val_fraction=0.01, workers=1, overwrite=True, progress=False, main_works=False,
        filters=filters.recommended() if near else filters(),
        near_dedup=converter.NearDedupOptions() if near else None, index_processes=partitions,
    )  # fmt: skip
    read = converter.ReadOptions(**read_changes)

    def convert(corpus: Path) -> dict:
        """The conversion's summary.json (what every version of the converter writes)."""
        with contextlib.redirect_stdout(io.StringIO()):
            converter.convert_corpus(
                [str(corpus)], tokenizer=tokenizer, out=str(out), options=options, read=read
            )
        return json.loads((out / "summary.json").read_text(encoding="utf-8"))

    recorded, measured, children_s = [], [], []
    for corpus in corpora:
        results: dict = {}
        children = []
        for _ in range(records):  # the worker's CPU time: the least of `records` recorded runs
            results.clear()
            before = _children_cpu()
            with _patched(results, record=True) as run:
                summary = convert(corpus)
            index = sum(run.index_cpu_s) if run.index_cpu_s else None
            children.append((_children_cpu() - before, index))  # the worker and the index processes
        children_s.append(min(children, key=lambda pair: pair[0] - (pair[1] or 0)))
        recorded.append(results)
        tokens = sum(s["tokens"] + s["lost_tail_tokens"] for s in summary["splits"].values())
        measured.append(Replays(summary["read"]["documents"], tokens, None, partitions=partitions))
    together: list[list[float]] = [[] for _ in corpora]
    for _ in range(rounds):
        for corpus, results, replays, total in zip(corpora, recorded, measured, together, strict=True):
            children = _children_cpu()
            with _patched(results, record=False) as run:
                convert(corpus)
            replays.main_cpu_s.append(run.loop_cpu_s)
            total.append(_children_cpu() - children)  # the index processes are reaped by now
            replays.index_cpu_s.append(max(run.index_cpu_s) if run.index_cpu_s else total[-1] / partitions)
    for replays, (children, index), total in zip(measured, children_s, together, strict=True):
        # The recorded run's index processes; for older code, as the best replay's (the same work).
        replays.worker_cpu_s = children - (index if index is not None else min(total))
    return measured


# --- the figures ------------------------------------------------------------------------------


@dataclass
class Figures:
    """Per document past the half corpus (module docstring)."""

    documents: int
    tokens: int  # kept in the full corpus: per document, as a token count for the plain conversion
    main_us: float  # best round against best round
    main_us_rounds: list[float]  # round by round
    main_us_whole: float  # the whole full corpus, its first batches included
    worker_us: float
    index_us: float | None  # the busiest index process
    partitions: int

    @property
    def feeds(self) -> float:
        return self.worker_us / self.main_us

    @property
    def index_feeds(self) -> float | None:
        return self.worker_us / self.index_us if self.index_us else None


def figures(half: Replays, full: Replays) -> Figures:
    documents = full.documents - half.documents
    per_doc = 1e6 / documents
    rounds = [(f - h) * per_doc for f, h in zip(full.main_cpu_s, half.main_cpu_s, strict=True)]
    index = None
    if full.partitions > 1:
        index = (min(full.index_cpu_s) - min(half.index_cpu_s)) * per_doc
    return Figures(
        documents, full.tokens, (min(full.main_cpu_s) - min(half.main_cpu_s)) * per_doc, rounds,
        min(full.main_cpu_s) / full.documents * 1e6,
        # A worker's time is nearly all per document: over the whole corpus (a difference of two
        # single runs is too noisy on a loaded machine), the lesser of the two corpora.
        min(full.worker_cpu_s / full.documents, half.worker_cpu_s / half.documents) * 1e6, index,
        full.partitions,
    )  # fmt: skip


def report(costs: dict[str, Figures], title: str = "") -> None:
    """The lines `make bench-convert` prints for the main process on its own."""
    print(
        f"main process alone{title}: CPU per document of a corpus's second half, best round against best "
        "round (round by round: the range and median; the whole corpus, its first batches included)"
    )
    plain = next(iter(costs.values()))
    tokens_per_doc = plain.tokens / (2 * plain.documents)  # the full corpus has twice the half's documents
    for label, f in costs.items():
        low, high, median = min(f.main_us_rounds), max(f.main_us_rounds), statistics.median(f.main_us_rounds)
        print(
            f"  {label}: {f.main_us:.2f} us (rounds {low:.2f} to {high:.2f}, median {median:.2f}; whole "
            f"{f.main_us_whole:.2f}), "
            f"{f.main_us / tokens_per_doc * 1e3:.1f} ns per token; one worker {f.worker_us:.1f} us: "
            f"main process feeds at most {f.feeds:.0f} workers"
        )
        if f.index_us is not None:
            print(
                f"    its {f.partitions} index processes: the busiest {f.index_us:.2f} us per document: they keep "
                f"up with {f.index_feeds:.0f} workers"
            )
    many = {label: f for label, f in costs.items() if f.partitions > 1 or label.startswith("plain")}
    worst = min(many, key=lambda label: min(many[label].feeds, many[label].index_feeds or many[label].feeds))
    f = many[worst]
    print(
        f"  with {TARGET} workers (their index processes) the ordered selection feeds at most "
        f"{min(f.feeds, f.index_feeds or f.feeds):.0f} workers ({worst}; target >= {TARGET})"
    )


def measure_all(
    corpora: list[Path], tokenizer: str, out: Path, seq_len: int, rounds: int
) -> dict[str, Figures]:
    """Every setting; `corpora`: C, 2C and 4C copies of the same text. With P index processes a
    range is P/2 times larger (convert/run/ranges.py), so those settings take the two larger corpora
    (as many ranges as the others with 8, half as many with 16)."""
    costs = {}
    for setting, (_, changes) in SETTINGS.items():
        pair = corpora[1:] if changes.get("partitions", 1) > 1 else corpora[:2]
        half, full = measure(pair, tokenizer, out, seq_len, setting, rounds)
        costs[setting] = figures(half, full)
    # A worker does the same work whether the duplicate state is in the main process or in index
    # processes (splitting the keys is a few numpy calls per batch): its least time over them.
    for near in (False, True):
        same = [f for label, (_, changes) in SETTINGS.items() if changes.get("near", False) == near
                for f in [costs[label]]]  # fmt: skip
        least = min(f.worker_us for f in same)
        for f in same:
            f.worker_us = least
    return costs


def measure_before(
    code: str, corpora: list[Path], tokenizer: str, out: Path, seq_len: int, rounds: int
) -> dict[str, Figures]:
    """The same figures for the converter checked out at `code`, in a subprocess."""
    args = [str(c) for c in corpora] + [tokenizer, str(out), str(seq_len), str(rounds)]
    runner = (
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); "
        "spec = importlib.util.spec_from_file_location('convert_main_now', sys.argv[2]); "
        "m = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "m.child(sys.argv[3:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", runner, code, __file__, *args], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": code},
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the converter at {code} could not be measured:\n{done.stderr[-3000:]}")
    return {label: Figures(**values) for label, values in json.loads(done.stdout.splitlines()[-1]).items()}


def child(args: list[str]) -> None:
    *corpora, tokenizer, out, seq_len, rounds = args
    costs = measure_all([Path(c) for c in corpora], tokenizer, Path(out), int(seq_len), int(rounds))
    print(json.dumps({label: asdict(f) for label, f in costs.items()}))
