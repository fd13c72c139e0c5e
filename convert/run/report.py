"""What a conversion reports: progress while it runs, and at the end the summary of what was
read, dropped and written, printed and saved as summary.json.

Progress goes to stderr: a live tqdm bar on a terminal; when stderr is a file or a pipe
(`make demo > log 2>&1`), a labelled line every PLAIN_EVERY_S seconds and one at the end instead
(`[progress] reading: 12.3k doc, 4.1k doc/s`): a bar's carriage returns and cursor moves would fill
the file with control sequences. tqdm has no such mode: given a file it still redraws with
carriage returns (only its `disable` drops everything), hence the small PlainProgress here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TextIO

from convert.dedup.options import NearDedupOptions
from convert.filters.quality import QualityFilters

PLAIN_EVERY_S = 10.0


class PlainProgress:
    """tqdm's `update` / context-manager surface, written as labelled lines (no control sequences)."""

    def __init__(self, total: int | None, unit: str, desc: str, file: TextIO, every_s: float = PLAIN_EVERY_S):
        self.total, self.unit, self.desc, self.file, self.every_s = total, unit, desc, file, every_s
        self.n = 0
        self.started = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        done = f"{_short(self.n)}/{_short(self.total)}" if self.total else _short(self.n)
        rate = self.n / max(now - self.started, 1e-9)
        print(
            f"[progress] {self.desc}: {done} {self.unit}, {_short(rate)} {self.unit}/s",
            file=self.file,
            flush=True,
        )

    def close(self) -> None:
        self._line(time.monotonic())

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(n: float) -> str:
    for suffix, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n:.0f}"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress_bar(total: int | None, unit: str, desc: str, *, enabled: bool = True):
    """A tqdm bar on a terminal, labelled lines otherwise, nothing when not `enabled`."""
    from tqdm import tqdm

    if enabled and not is_terminal(sys.stderr):
        return PlainProgress(total, unit, desc, sys.stderr)

    tqdm.monitor_interval = 0  # no monitor thread: worker processes are forked after this
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=True,
        desc=desc,
        file=sys.stderr,
        mininterval=0.5,
        disable=not enabled,
    )


def counted_texts(docs: Iterable, bar, every: int = 256, documents: bool = False) -> Iterator:
    """The documents' texts (the documents themselves when `documents`); the bar moves every
    `every` documents (one update per document costs)."""
    count = 0
    for doc in docs:
        count += 1
        if count % every == 0:
            bar.update(every)
        yield doc if documents else doc.text
    bar.update(count % every)


@dataclass(frozen=True, kw_only=True)
class SplitSummary:
    """One split in summary.json."""

    documents: int
    too_short_tokens: int  # tokens of its documents under --min-tokens
    samples: int
    tokens: int
    shards: int
    parts: int
    lost_tail_tokens: int  # the last partial sample's tokens, not stored


@dataclass(frozen=True, kw_only=True)
class NearDedupSummary:
    """Near-duplicate removal in summary.json: its settings (flat), the pair report's name and size."""

    options: NearDedupOptions
    report: str  # the sample of removed pairs, beside summary.json
    pairs_in_report: int
    # Removed documents whose every near pair is with a removed document (rule "any"; 0 by
    # definition under "kept"): what a chain's later links lose (convert/dedup/pairs.py).
    through_removed: int = 0
    index_bytes: int | None = None  # the band index's and sketches' bytes

    def to_json(self) -> dict:
        out = {**asdict(self.options), "report": self.report, "pairs_in_report": self.pairs_in_report,
               "dropped_only_through_dropped": self.through_removed}  # fmt: skip
        return out if self.index_bytes is None else {**out, "index_bytes": self.index_bytes}


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What a conversion read, dropped and wrote: summary.json, printed at the end, and what
    `convert_corpus`, `merge_tasks` and `import_bin` return."""

    out: str
    read: dict  # files, documents, malformed and its first examples (`ReadStats.as_dict`)
    dropped: dict[str, int]  # documents by reason
    splits: dict[str, SplitSummary]
    seq_len: int
    tokens_written: int
    workers: int
    reused_parts: int  # parts an interrupted run had written, kept
    elapsed_s: float
    tokens_per_s: float | None
    # With a selection (not for token files): the dropped documents' tokens by reason; the active
    # quality filters; near-duplicate removal. A merge: how many tasks it merged.
    dropped_tokens: dict[str, int] | None = None
    filters: QualityFilters | None = None
    near_dedup: NearDedupSummary | None = None
    tasks: int | None = None

    def to_json(self) -> dict:
        """summary.json: the sections that do not apply are left out."""
        out = {
            "out": self.out,
            "read": self.read,
            "dropped": self.dropped,
            "splits": {name: asdict(split) for name, split in self.splits.items()},
            "seq_len": self.seq_len,
            "tokens_written": self.tokens_written,
            "workers": self.workers,
            "reused_parts": self.reused_parts,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
        }
        if self.dropped_tokens is not None:
            out["dropped_tokens"] = self.dropped_tokens
        if self.filters is not None:
            out["filters"] = asdict(self.filters)
        if self.near_dedup is not None:
            out["near_dedup"] = self.near_dedup.to_json()
        if self.tasks is not None:
            out["tasks"] = self.tasks
        return out


def build_summary(
    *,
    out: str,
    read: dict,
    dropped: dict[str, int],
    splits: dict[str, SplitSummary],
    seq_len: int,
    workers: int,
    elapsed: float,
    reused_parts: int,
    dropped_tokens: dict[str, int] | None = None,
    filters: QualityFilters | None = None,
    near_dedup: NearDedupSummary | None = None,
    tasks: int | None = None,
) -> Summary:
    tokens = sum(split.tokens for split in splits.values())
    return Summary(
        out=out, read=read, dropped=dropped, splits=splits, seq_len=seq_len, tokens_written=tokens,
        workers=workers, reused_parts=reused_parts, elapsed_s=round(elapsed, 3),
        tokens_per_s=round(tokens / elapsed, 1) if elapsed > 0 else None, dropped_tokens=dropped_tokens,
        filters=filters, near_dedup=near_dedup, tasks=tasks,
    )  # fmt: skip


def print_summary(summary: Summary, stream: TextIO) -> None:
    read = summary.read
    lines = [f"converted into {summary.out} in {summary.elapsed_s:.1f} s"]
    if "documents" in read:
        lines.append(f"  documents read: {read['documents']} from {read.get('files', '?')} file(s)")
    if read.get("malformed"):
        lines.append(f"  malformed records skipped: {read['malformed']}")
        for example in read.get("malformed_examples", [])[:5]:
            lines.append(f"    {example['source']}:{example['line']}: {example['reason']}")
    dropped, tokens = summary.dropped, summary.dropped_tokens or {}
    parts = [f"{k} {v}" + (f" ({tokens[k]:,} tokens)" if k in tokens else "") for k, v in dropped.items()]
    lines.append("  dropped: " + (", ".join(parts) if parts else "none"))
    near = summary.near_dedup
    if near:
        chains = (
            f"{near.through_removed:,} of them near only documents dropped too (--near-rule kept keeps those)"
            if near.options.rule == "any"
            else "near a kept document each (--near-rule kept)"
        )
        lines.append(
            f"  near-duplicates: Jaccard >= {near.options.threshold} over {near.options.ngram}-character "
            f"shingles; {chains}; {near.pairs_in_report} sampled pair(s) in {near.report}"
        )
    for name, split in summary.splits.items():
        lines.append(
            f"  {name}: {split.documents} documents, {split.samples} samples x {summary.seq_len} "
            f"= {split.tokens} tokens in {split.shards} shards"
            + (f" ({split.lost_tail_tokens} tokens of the last partial sample not stored)")
        )
    rate = summary.tokens_per_s
    lines.append(
        f"  tokens written: {summary.tokens_written}"
        + (f" ({rate:,.0f} tokens/s with {summary.workers} worker(s))" if rate else "")
    )
    if summary.reused_parts:
        lines.append(f"  resumed: {summary.reused_parts} part(s) reused from the interrupted run")
    stream.write("\n".join(lines) + "\n")
