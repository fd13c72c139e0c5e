"""Conversion benchmark: `python -m bench.convert` (or `make bench-convert`).

Builds a corpus from the demo corpus (real Chinese text) repeated `--copies` times, each copy's
documents given a distinct suffix so de-duplication keeps them, and prints:
  * raw `SentencePieceProcessor.encode` tokens/s, one thread, on the cleaned texts already in
    memory, one call per batch of about a range's characters as a worker calls it: the limit a
    worker can reach (one call over all the texts, as measured before, also pays for Python's
    garbage collector walking the growing lists of ids: its CPU time is printed beside);
  * end-to-end tokens/s of `convert_corpus` with 1 and with 2 workers: wall time from the call
    to the finished output, so it includes starting the worker processes, reading and parsing
    the JSON lines, cleaning, de-duplication, tokenizing, packing, zstd and writing the shards;
    1 worker runs twice: as by default (with a core to spare, the main process cleans the texts
    and writes the parts, and the worker only tokenizes) and with the worker doing all of it, as
    each worker does with 2 workers on 2 cores;
  * the ratio end-to-end / raw encode for 1 worker (target >= 0.8) for both placements, the
    ratio of 2 workers to twice raw encode (target >= 0.85) with the load average during the
    runs, and the 1 -> 2 worker speed-up (target >= 1.6 on 2 cores) against both; from CPU
    times, which a loaded machine changes little, the share of the workers' time spent inside
    SentencePiece's encode and the ratio 2 idle cores would give at best (raw encode CPU over
    the workers' and the main process's); the worker start-up time, for reference;
  * peak memory of this process (which also holds the benchmark's corpus) and of the largest
    child; Linux carries a process's RSS high-water mark across fork and exec, so the child
    figure cannot read lower than this process's size when the worker was started.
  * first, the main process's own cost, with the workers' work taken away (bench/convert_main.py):
    per document and per token, for plain conversion, exact de-duplication and --near-dedup
    --filters, and the worker count at which it saturates ("main process feeds at most N
    workers"), in CPU time, best of `--rounds` with the spread; with index processes their
    busiest one too; `--before PATH` prints the same for the converter checked out at PATH first
    (`--main-only`, `--no-main`: that part alone, or all but it);
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
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import convert_main


def build_corpus(
    root: Path, chars: int, copies: int, name: str = "corpus.jsonl", distinct: bool = False
) -> tuple[Path, list[str]]:
    """The demo corpus (up to `chars` characters) `copies` times, each copy with its own suffix
    (exact de-duplication keeps them; near de-duplication removes the copies). `distinct`: each
    copy past the first joins the first half of every document to the second half of another
    instead, so that the copies are neither exact nor near duplicates (a Jaccard similarity of
    about 1/3 with each source), with the documents' lengths as they are."""
    from convert.demo.corpus import write_demo_corpus

    base = root / "base.jsonl"
    write_demo_corpus(base, max_chars=chars)
    texts = [json.loads(line)["text"] for line in base.read_text(encoding="utf-8").splitlines()]
    corpus = root / name
    with open(corpus, "w", encoding="utf-8") as f:
        for copy in range(copies):
            suffix = f"（第{copy + 1}遍）" if copy else ""
            for i, text in enumerate(texts):
                if distinct and copy:
                    other = texts[(i + 7919 * copy) % len(texts)]
                    text = text[: len(text) // 2] + other[len(other) // 2 :]
                f.write(json.dumps({"text": text + suffix}, ensure_ascii=False) + "\n")
    return corpus, texts


def cleaned_texts(corpus: Path) -> list[str]:
    from convert.filters.cleaning import Cleaner

    cleaner = Cleaner()
    lines = corpus.read_text(encoding="utf-8").splitlines()
    return [t for t in (cleaner.clean(json.loads(line)["text"]) for line in lines) if t]


def raw_encode_rate(texts: list[str], tokenizer: str, whole: bool = False) -> tuple[float, int, float]:
    """Tokens/s of one-thread encode over the cleaned documents, one call per batch of about as
    many characters as a worker's range holds (what a worker can reach), the token count and the
    CPU seconds the encode took. `whole`: one call over all the texts instead (Python's garbage
    collector then walks the growing lists of token ids again and again)."""
    import sentencepiece as spm

    from convert.run.conversion import BATCH_CHARS

    batches, batch, size = [], [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS and not whole:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for batch in batches for ids in sp.encode(batch, num_threads=1))
    return tokens / (time.perf_counter() - start), tokens, time.process_time() - cpu


@dataclass
class Run:
    tokens_per_s: float  # wall clock, end to end
    main_cpu_s: float  # CPU seconds of this process during the run (reading, dedup, hand-out)
    worker_cpu_s: float  # CPU seconds of all workers together
    main_peak_mb: float = 0.0  # high-water RSS of this process during the run
    worker_peak_mb: float = 0.0  # the largest worker's high-water RSS, from its start
    encode_cpu_s: float = 0.0  # CPU seconds of the workers inside SentencePiece's encode
    load: float = 0.0  # the load average (1 minute) at the end of the run


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
_encode_cpu = 0.0  # in a worker: CPU seconds inside SentencePiece's encode


def _measured_init(initializer, *args) -> None:
    """A worker initializer that also resets the worker's peak RSS, times its encode calls and,
    at exit, writes both."""
    from multiprocessing.util import Finalize

    from shards.tokenizer import Tokenizer

    _reset_peak()
    folder = _peaks_dir
    Finalize(None, _write_peak, args=(folder,), exitpriority=100)
    Tokenizer.encode_batch = _timed(Tokenizer.encode_batch)
    initializer(*args)


def _timed(encode_batch):
    def timed(self, *args, **kwargs):
        global _encode_cpu
        start = time.process_time()
        try:
            return encode_batch(self, *args, **kwargs)
        finally:
            _encode_cpu += time.process_time() - start

    return timed


def _write_peak(folder: str | None) -> None:
    if folder:
        Path(folder, str(os.getpid())).write_text(f"{_peak_mb()} {_encode_cpu}")


@contextlib.contextmanager
def measured_workers(folder: Path):
    """Conversions inside start workers whose peak RSS lands in `folder` (one file each)."""
    import convert.run.conversion as conversion

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


def worker_peaks(folder: Path) -> tuple[float, float]:
    """The largest worker's peak RSS in MB, and the workers' CPU seconds in encode together."""
    written = [tuple(map(float, p.read_text().split())) for p in folder.iterdir()]
    for p in folder.iterdir():
        p.unlink()
    return max((peak for peak, _ in written), default=0.0), sum(encode for _, encode in written)


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
    from convert.run.jobs import convert_corpus
    from convert.run.options import ShardOptions

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
    with contextlib.redirect_stdout(io.StringIO()):
        summary = convert_corpus([str(corpus)], tokenizer=tokenizer, out=str(out), options=options)
    elapsed, after = time.perf_counter() - start, os.times()  # the pool's workers are reaped now
    main_peak = _peak_mb()
    # Every kept token was encoded, whether or not it ended in the last partial sample.
    encoded = sum(s.tokens + s.lost_tail_tokens for s in summary.splits.values())
    main_cpu = after.user - before.user + after.system - before.system
    worker_cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return Run(encoded / elapsed, main_cpu, worker_cpu, main_peak, load=os.getloadavg()[0])


def worker_startup_s(tokenizer: str, out: Path, workers: int) -> float:
    """Seconds to start `workers` worker processes and have each answer one task."""
    from convert.executor import start_workers
    from convert.filters.cleaning import Cleaner
    from convert.run.options import ShardOptions
    from convert.run.worker import init_worker
    from shards.tokenizer import read_tokenizer_files

    setup = (ShardOptions(dtype="uint16"), str(out), read_tokenizer_files(tokenizer), Cleaner(dedup=False))
    start = time.perf_counter()
    with start_workers(workers, init_worker, *setup) as executor:
        [executor.submit(_worker_ready, i).get() for i in range(workers)]
    return time.perf_counter() - start


def _worker_ready(_: int) -> int:
    return os.getpid()


def best_and_spread(values: list[float]) -> str:
    best = max(values)
    return f"{best:,.0f} (runs: {', '.join(f'{v:,.0f}' for v in values)})"


def report(
    raw: list[float], encode_cpu: float, whole_cpu: float, runs: dict[str, list[Run]], startup: list[float]
) -> None:
    from convert.run.conversion import BATCH_CHARS
    from convert.run.options import ShardOptions

    print(
        f"raw SentencePiece encode (1 thread, one call per {BATCH_CHARS:,} characters, as a worker calls it): "
        f"{best_and_spread(raw)} tokens/s, {encode_cpu:.2f} CPU s (one call over all the texts: {whole_cpu:.2f} "
        "CPU s, Python's garbage collector walking the growing lists of ids)"
    )
    for label, results in runs.items():
        workers, main_works = SETUPS[label]
        helps = ShardOptions(workers=workers, main_works=main_works).main_helps
        where = "main process cleans and writes" if helps else "workers clean and write"
        rates = [run.tokens_per_s for run in results]
        best = min(results, key=lambda run: run.worker_cpu_s + run.main_cpu_s)
        print(
            f"end-to-end, {label} ({where}): {best_and_spread(rates)} tokens/s, "
            f"{max(rates) / workers:,.0f} per worker; CPU s: workers {best.worker_cpu_s:.2f} (in encode "
            f"{best.encode_cpu_s:.2f}, {best.encode_cpu_s / best.worker_cpu_s:.0%}), main process {best.main_cpu_s:.2f}"
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
    loads = [run.load for run in runs["2 workers"]]
    print(
        f"RATIO end-to-end (2 workers) / twice raw encode: {max(two) / (2 * max(raw)):.2f} best-to-best "
        f"(paired rounds: {', '.join(f'{r:.2f}' for r in paired_two)}; target >= 0.85 on 2 idle cores; "
        f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs)"
    )
    best = min(runs["2 workers"], key=lambda run: run.worker_cpu_s + run.main_cpu_s)
    share = best.encode_cpu_s / (best.worker_cpu_s + best.main_cpu_s)
    print(
        f"  by CPU time (the same processes at the same time, so load changes it little), what 2 idle "
        f"cores give at best: the workers' encode / (workers + main process) = {share:.2f}; the workers "
        f"spend {best.encode_cpu_s / best.worker_cpu_s:.0%} of their CPU in encode ({best.encode_cpu_s:.2f} s; "
        f"raw {encode_cpu:.2f} s), the rest reading, cleaning (Unicode NFKC), digesting, packing, zstd, writing"
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
        f"the main process and counts the pages it shares with it; batches of {BATCH_CHARS:,} characters, "
        f"chunks of {ShardOptions().chunk_chars:,} characters)"
    )
    print(f"{os.cpu_count()} CPUs here, load average {os.getloadavg()[0]:.1f}")


def main_cost(root: Path, args, tokenizer: str) -> None:
    """The main process's own cost (bench/convert_main.py) on corpora of `--copies` copies, twice
    and 4 times as many (each the first half of the next), copies that are neither exact nor near
    duplicates of each other."""
    (root / "main").mkdir()
    corpora = [
        build_corpus(root / "main", args.chars, times * args.copies, name=f"{times}.jsonl", distinct=True)[0]
        for times in (1, 2, 4)
    ]
    measured = (corpora, tokenizer, root / "out", args.seq_len, args.rounds)
    if args.before:
        convert_main.report(convert_main.measure_before(args.before, *measured), f" (before: {args.before})")
    convert_main.report(convert_main.measure_all(*measured), " (this code)" if args.before else "")


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
    parser.add_argument("--rounds", type=int, default=7, help="replays of each main-process measurement")
    parser.add_argument("--main-only", action="store_true", help="only the main process's own cost")
    parser.add_argument("--no-main", action="store_true", help="without the main process's own cost")
    parser.add_argument(
        "--before", metavar="PATH", help="also the main process's cost for the converter checked out at PATH"
    )
    args = parser.parse_args(argv)

    from convert.tokens.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        root = Path(tmp)
        corpus, base_texts = build_corpus(root, args.chars, args.copies)
        tokenizer = str(root / "tok.model")
        train_tokenizer(base_texts, vocab_size=args.vocab_size, out=tokenizer)
        del base_texts
        texts = cleaned_texts(corpus)
        _, tokens, _ = raw_encode_rate(texts, tokenizer)  # a warm-up, not counted
        print(f"corpus: {corpus.stat().st_size / 1e6:,.1f} MB of JSON lines, {tokens:,} tokens")
        if not args.no_main:
            main_cost(root, args, tokenizer)
        if args.main_only:
            return 0
        startup = [worker_startup_s(tokenizer, root / "out", 1) for _ in range(args.repeat)]
        raw_runs = []
        runs: dict[str, list[Run]] = {label: [] for label in SETUPS}
        peaks = root / "peaks"
        peaks.mkdir()
        for _ in range(args.repeat):  # rounds: a burst of load hits the limit and the runs alike
            raw_runs.append(raw_encode_rate(texts, tokenizer))
            for label, (workers, main_works) in SETUPS.items():
                with measured_workers(peaks):
                    run = convert_rate(corpus, tokenizer, root / "out", workers, args.seq_len, main_works)
                run.worker_peak_mb, run.encode_cpu_s = worker_peaks(peaks)
                runs[label].append(run)
        raw = [rate for rate, _, _ in raw_runs]
        encode_cpu = min(cpu for _, _, cpu in raw_runs)
        whole_cpu = raw_encode_rate(texts, tokenizer, whole=True)[2]
    report(raw, encode_cpu, whole_cpu, runs, startup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
