"""Conversion benchmark: `python -m bench.convert` (or `make bench-convert`).

Builds a corpus from the demo corpus (real Chinese text) repeated `--copies` times, each copy's
documents given a distinct suffix so de-duplication keeps them, and prints:
  * raw `SentencePieceProcessor.encode` tokens/s, one thread, batched, on the cleaned texts
    already in memory: the limit a worker can reach;
  * end-to-end tokens/s of `convert_corpus` with 1 and with 2 workers: wall time from the call
    to the finished output, so it includes starting the worker processes, reading and parsing
    the JSON lines, cleaning, de-duplication, tokenizing, packing, zstd and writing the shards;
    1 worker runs twice: as by default (with a core to spare, the main process cleans the texts
    and writes the parts, and the worker only tokenizes) and with the worker doing all of it, as
    each worker does with 2 workers on 2 cores;
  * the ratio end-to-end / raw encode for 1 worker (target >= 0.8) for both placements, and
    the 1 -> 2 worker speed-up (target >= 1.6 on 2 cores) against both; the worker start-up
    time, measured on its own, for reference;
  * peak memory of this process (which also holds the benchmark's corpus) and of the largest
    child; Linux carries a process's RSS high-water mark across fork and exec, so the child
    figure cannot read lower than this process's size when the worker was started.
  * the main process's own cost, with the workers' work taken away: each setting (plain, with
    exact de-duplication, with --near-dedup --filters) is converted once with 1 worker while
    every worker result is recorded (pickled), then again with no workers at all: each task
    handed out is pickled (the sending) and answered at once with its recorded result,
    unpickled (the receiving). The main process's CPU seconds in that replay, per document and
    per token, against one worker's CPU seconds per document in the recorded run, give the
    worker count at which the main process saturates ("main process feeds at most N workers");
  * peak memory (high-water RSS) of the main process and of each worker in each conversion,
    reset when the conversion (or the worker) starts, against the batch and chunk sizes.
Each measurement is repeated `--repeat` times, in rounds (raw encode, then each conversion), so
a burst of load on a shared machine hits a round's figures alike: ratios are printed best to
best and per round, with the spread. Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def build_corpus(root: Path, chars: int, copies: int) -> tuple[Path, list[str]]:
    """The demo corpus (up to `chars` characters) `copies` times, each copy with its own suffix."""
    from convert.demo_corpus import write_demo_corpus

    base = root / "base.jsonl"
    write_demo_corpus(base, max_chars=chars)
    texts = [json.loads(line)["text"] for line in base.read_text(encoding="utf-8").splitlines()]
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for copy in range(copies):
            suffix = f"（第{copy + 1}遍）" if copy else ""
            for text in texts:
                f.write(json.dumps({"text": text + suffix}, ensure_ascii=False) + "\n")
    return corpus, texts


def raw_encode_rate(corpus: Path, tokenizer: str) -> tuple[float, int, float]:
    """Tokens/s of one-thread batched encode over the cleaned documents (what a worker can reach),
    the token count and the CPU seconds the encode took."""
    import sentencepiece as spm

    from convert.cleaning import Cleaner

    cleaner = Cleaner()
    lines = corpus.read_text(encoding="utf-8").splitlines()
    texts = [t for t in (cleaner.clean(json.loads(line)["text"]) for line in lines) if t]
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for ids in sp.encode(texts, num_threads=1))
    return tokens / (time.perf_counter() - start), tokens, time.process_time() - cpu


@dataclass
class Run:
    tokens_per_s: float  # wall clock, end to end
    main_cpu_s: float  # CPU seconds of this process during the run (reading, dedup, hand-out)
    worker_cpu_s: float  # CPU seconds of all workers together
    main_peak_mb: float = 0.0  # high-water RSS of this process during the run
    worker_peak_mb: float = 0.0  # the largest worker's high-water RSS, from its start


# --- peak memory -------------------------------------------------------------------------------


def _reset_peak() -> None:
    """Start this process's high-water RSS afresh (Linux: /proc/self/clear_refs, value 5)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


_peaks_dir: str | None = None  # where each worker leaves its peak when it exits


def _measured_init(initializer, *args) -> None:
    """A worker initializer that also resets the worker's peak RSS and, at exit, writes it."""
    from multiprocessing.util import Finalize

    _reset_peak()
    folder = _peaks_dir
    Finalize(None, _write_peak, args=(folder,), exitpriority=100)
    initializer(*args)


def _write_peak(folder: str | None) -> None:
    if folder:
        Path(folder, str(os.getpid())).write_text(str(_peak_mb()))


@contextlib.contextmanager
def measured_workers(folder: Path):
    """Conversions inside start workers whose peak RSS lands in `folder` (one file each)."""
    import convert.conversion as conversion

    global _peaks_dir
    real = conversion.start_workers
    _peaks_dir = str(folder)

    def start(workers, initializer, *initargs):
        return real(workers, _measured_init, initializer, *initargs)

    conversion.start_workers = start
    try:
        yield
    finally:
        conversion.start_workers = real
        _peaks_dir = None


def worker_peaks(folder: Path) -> float:
    peaks = [float(p.read_text()) for p in folder.iterdir()]
    for p in folder.iterdir():
        p.unlink()
    return max(peaks, default=0.0)


# --- the main process's own cost ---------------------------------------------------------------


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


@contextlib.contextmanager
def _patched_executor(make):
    import convert.conversion as conversion

    real = conversion.start_workers

    @contextlib.contextmanager
    def start(workers, initializer, *initargs):
        if make is None:
            initializer(*initargs)  # the replay's worker state lives here (it is never used)
            yield _Replay(results)
        else:
            with real(workers, initializer, *initargs) as executor:
                yield make(executor)

    conversion.start_workers = start
    try:
        yield
    finally:
        conversion.start_workers = real


results: dict = {}

# label -> (ReadOptions changes, ShardOptions changes)
MAIN_SETTINGS = {
    "plain (no de-duplication)": ({"dedup": False}, {}),
    "exact de-duplication": ({}, {}),
    "exact de-duplication, 8 index processes": ({}, {"partitions": 8}),
    "--near-dedup --filters": ({}, {"near": True, "partitions": 1}),
    "--near-dedup --filters, 8 index processes": ({}, {"near": True, "partitions": 8}),
}


@dataclass
class MainCost:
    documents: int
    tokens: int
    main_cpu_s: float  # the replay: this process alone
    worker_cpu_s: float  # the recorded run's one worker
    index_cpu_s: float = 0.0  # the replay's near-duplicate index processes, all together
    partitions: int = 1

    @property
    def feeds(self) -> float:
        return self.worker_cpu_s / self.main_cpu_s


def _replayed(corpus: Path, tokenizer: str, out: Path, seq_len: int, setting: str, repeat: int) -> MainCost:
    """One corpus: the recorded run, then the best of `repeat` replays (see the module docstring)."""
    from convert.jobs import convert_corpus
    from convert.options import NearDedupOptions, QualityFilters, ReadOptions, ShardOptions

    read_changes, shard_changes = MAIN_SETTINGS[setting]
    near = shard_changes.get("near", False)
    supported = "index_processes" in ShardOptions.__dataclass_fields__  # not before issue 21
    extra = {"index_processes": shard_changes.get("partitions", 1)} if supported else {}
    options = ShardOptions(
        seq_len=seq_len, val_fraction=0.01, workers=1, overwrite=True, progress=False, main_works=False,
        filters=QualityFilters.recommended() if near else QualityFilters(),
        near_dedup=NearDedupOptions() if near else None, **extra,
    )  # fmt: skip
    read = ReadOptions(**read_changes)
    results.clear()
    before = os.times()
    with contextlib.redirect_stdout(io.StringIO()), _patched_executor(lambda ex: _Recording(ex, results)):
        summary = convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(out), options=options, read=read)
    after = os.times()
    worker_cpu = after.children_user - before.children_user + after.children_system - before.children_system
    replays, index = [], []
    for _ in range(repeat):
        cpu, before = time.process_time(), os.times()
        with contextlib.redirect_stdout(io.StringIO()), _patched_executor(None):
            convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(out), options=options, read=read)
        replays.append(time.process_time() - cpu)
        after = os.times()  # the index processes are reaped: their CPU time
        index.append(
            after.children_user - before.children_user + after.children_system - before.children_system
        )
    results.clear()
    tokens = sum(s["tokens"] + s["lost_tail_tokens"] for s in summary["splits"].values())
    # The recorded run's children are its worker and its index processes (the same work as the replay's).
    partitions = getattr(options, "index_processes", 1)
    return MainCost(
        summary["read"]["documents"], tokens, min(replays), worker_cpu - min(index), min(index), partitions
    )


def main_cost(corpora: tuple[Path, Path], tokenizer: str, out: Path, seq_len: int, setting: str, repeat: int):
    """The whole run on the full corpus, and the cost of its documents past the half corpus's:
    per document without the run's fixed costs (starting processes, the output's small files)."""
    half, full = (_replayed(c, tokenizer, out, seq_len, setting, repeat) for c in corpora)
    marginal = MainCost(
        full.documents - half.documents, full.tokens - half.tokens, full.main_cpu_s - half.main_cpu_s,
        full.worker_cpu_s - half.worker_cpu_s, full.index_cpu_s - half.index_cpu_s, full.partitions,
    )  # fmt: skip
    return full, marginal


def report_main_costs(costs: dict[str, tuple[MainCost, MainCost]]) -> None:
    for label, (full, cost) in costs.items():
        print(
            f"main process alone, {label}: {full.main_cpu_s:.2f} CPU s for {full.documents:,} documents "
            f"({full.main_cpu_s / full.documents * 1e6:.1f} us each, fixed costs included); past the half "
            f"corpus: {cost.main_cpu_s / cost.documents * 1e6:.2f} us per document, "
            f"{cost.main_cpu_s / cost.tokens * 1e9:.1f} ns per token; one worker: "
            f"{cost.worker_cpu_s / cost.documents * 1e6:.1f} us per document"
        )
        print(f"main process feeds at most {cost.feeds:.0f} workers ({label}; target >= 64)")
        if cost.partitions > 1:
            per_index = cost.worker_cpu_s / (cost.index_cpu_s / cost.partitions)
            print(
                f"  its {cost.partitions} index processes: {cost.index_cpu_s / cost.documents * 1e6:.2f} us "
                f"per document together; each keeps up with {per_index:.0f} workers"
            )


# (label, workers, clean in the main process); None: the default for this machine
SETUPS = {
    "1 worker": (1, None),
    "1 worker doing all": (1, False),
    "2 workers": (2, None),
}


def convert_rate(
    corpus: Path, tokenizer: str, out: Path, workers: int, seq_len: int, main_works: bool | None
) -> Run:
    """One conversion: end-to-end tokens/s (see the module docstring) and CPU seconds by process."""
    from convert.jobs import convert_corpus
    from convert.options import ShardOptions

    options = ShardOptions(
        seq_len=seq_len,
        val_fraction=0.01,
        workers=workers,
        overwrite=True,
        progress=False,
        main_works=main_works,
    )
    _reset_peak()
    before, start = os.times(), time.perf_counter()
    summary = convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(out), options=options)
    elapsed, after = time.perf_counter() - start, os.times()  # the pool's workers are reaped now
    main_peak = _peak_mb()
    # Every kept token was encoded, whether or not it ended in the last partial sample.
    encoded = sum(s["tokens"] + s["lost_tail_tokens"] for s in summary["splits"].values())
    main_cpu = after.user - before.user + after.system - before.system
    worker_cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return Run(encoded / elapsed, main_cpu, worker_cpu, main_peak, 0.0)


def worker_startup_s(tokenizer: str, out: Path, workers: int) -> float:
    """Seconds to start `workers` worker processes and have each answer one task."""
    from convert.cleaning import Cleaner
    from convert.executor import start_workers
    from convert.options import ShardOptions
    from convert.worker import init_worker
    from shards.tokenizer import read_model_bytes

    setup = (ShardOptions(dtype="uint16"), str(out), read_model_bytes(tokenizer), Cleaner(dedup=False))
    start = time.perf_counter()
    with start_workers(workers, init_worker, *setup) as executor:
        [executor.submit(_worker_ready, i).get() for i in range(workers)]
    return time.perf_counter() - start


def _worker_ready(_: int) -> int:
    return os.getpid()


def best_and_spread(values: list[float]) -> str:
    best = max(values)
    return f"{best:,.0f} (runs: {', '.join(f'{v:,.0f}' for v in values)})"


def report(raw: list[float], encode_cpu: float, runs: dict[str, list[Run]], startup: list[float]) -> None:
    from convert.conversion import _BATCH_CHARS
    from convert.options import ShardOptions

    print(f"raw SentencePiece encode (1 thread): {best_and_spread(raw)} tokens/s, {encode_cpu:.2f} CPU s")
    for label, results in runs.items():
        workers, main_works = SETUPS[label]
        helps = ShardOptions(workers=workers, main_works=main_works).main_helps
        where = "main process cleans and writes" if helps else "workers clean and write"
        rates = [run.tokens_per_s for run in results]
        best = min(results, key=lambda run: run.worker_cpu_s + run.main_cpu_s)
        print(
            f"end-to-end, {label} ({where}): {best_and_spread(rates)} tokens/s, "
            f"{max(rates) / workers:,.0f} per worker; CPU s: workers {best.worker_cpu_s:.2f}, "
            f"main process {best.main_cpu_s:.2f}"
        )
        print(
            f"  peak memory ({label}): main process {max(r.main_peak_mb for r in results):,.0f} MB, "
            f"largest worker {max(r.worker_peak_mb for r in results):,.0f} MB"
        )
    print(f"worker start-up (included above): best {min(startup):.2f} s, worst {max(startup):.2f} s")
    two = [run.tokens_per_s for run in runs["2 workers"]]
    ideal = min((run.worker_cpu_s + run.main_cpu_s) / 2 for run in runs["2 workers"])
    for label in ("1 worker", "1 worker doing all"):
        rates = [run.tokens_per_s for run in runs[label]]
        paired = [rate / limit for rate, limit in zip(rates, raw, strict=True)]  # the same round
        cpu_ratio = encode_cpu / min(run.worker_cpu_s for run in runs[label])
        print(
            f"ratio end-to-end ({label}) / raw encode: {max(rates) / max(raw):.2f} best-to-best "
            f"(paired rounds: {', '.join(f'{r:.2f}' for r in paired)}, median {statistics.median(paired):.2f}; "
            f"target >= 0.8); by CPU time, encode / worker: {cpu_ratio:.2f}"
        )
    paired_two = [rate / (2 * limit) for rate, limit in zip(two, raw, strict=True)]
    print(
        f"ratio end-to-end (2 workers) / twice raw encode: {max(two) / (2 * max(raw)):.2f} best-to-best "
        f"(paired rounds: {', '.join(f'{r:.2f}' for r in paired_two)}; target >= 0.85 on 2 idle cores)"
    )
    for label in ("1 worker", "1 worker doing all"):
        one = [run.tokens_per_s for run in runs[label]]
        speedups = [b / a for a, b in zip(one, two, strict=True)]
        # On 2 idle cores: 1 worker takes at least its worker CPU time (the main process runs
        # beside it); 2 workers at least half the CPU time of all three processes.
        bound = min(max(run.worker_cpu_s, run.main_cpu_s) for run in runs[label]) / ideal
        print(
            f"speed-up ({label}) -> 2 workers: {max(two) / max(one):.2f} best-to-best "
            f"(paired runs: {', '.join(f'{s:.2f}' for s in speedups)}; target >= 1.6 on 2 cores); "
            f"bound from CPU time on 2 idle cores: {bound:.2f}"
        )
    print(
        f"(peak memory is reset at each conversion's and each worker's start; a worker starts as a fork of "
        f"the main process and counts the pages it shares with it; batches of {_BATCH_CHARS:,} characters, "
        f"chunks of {ShardOptions().chunk_chars:,} characters)"
    )
    print(f"{os.cpu_count()} CPUs here, load average {os.getloadavg()[0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--chars", type=int, default=3_000_000, help="demo-corpus characters per copy")
    parser.add_argument("--copies", type=int, default=3, help="copies of it in the corpus")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--main-only", action="store_true", help="only the main process's own cost")
    args = parser.parse_args(argv)

    from convert.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        root = Path(tmp)
        (root / "half").mkdir()
        half, _ = build_corpus(root / "half", args.chars // 2, args.copies)
        corpus, base_texts = build_corpus(root, args.chars, args.copies)
        tokenizer = str(root / "tok.model")
        train_tokenizer(base_texts, vocab_size=args.vocab_size, out=tokenizer)
        del base_texts
        _, tokens, _ = raw_encode_rate(corpus, tokenizer)  # a warm-up, not counted
        print(f"corpus: {corpus.stat().st_size / 1e6:,.1f} MB of JSON lines, {tokens:,} tokens")
        from convert.options import ShardOptions

        split = "index_processes" in ShardOptions.__dataclass_fields__
        costs = {
            label: main_cost((half, corpus), tokenizer, root / "out", args.seq_len, label, args.repeat)
            for label, (_, changes) in MAIN_SETTINGS.items()
            if split or changes.get("partitions", 1) == 1
        }
        report_main_costs(costs)
        if args.main_only:
            return 0
        startup = [worker_startup_s(tokenizer, root / "out", 1) for _ in range(args.repeat)]
        raw_runs = []
        runs: dict[str, list[Run]] = {label: [] for label in SETUPS}
        peaks = root / "peaks"
        peaks.mkdir()
        for _ in range(args.repeat):  # rounds: a burst of load hits the limit and the runs alike
            raw_runs.append(raw_encode_rate(corpus, tokenizer))
            for label, (workers, main_works) in SETUPS.items():
                with measured_workers(peaks):
                    run = convert_rate(corpus, tokenizer, root / "out", workers, args.seq_len, main_works)
                run.worker_peak_mb = worker_peaks(peaks)
                runs[label].append(run)
        raw = [rate for rate, _, _ in raw_runs]
        encode_cpu = min(cpu for _, _, cpu in raw_runs)
    report(raw, encode_cpu, runs, startup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
