"""What a conversion reports: progress bars while it runs, and at the end the summary of what
was read, dropped and written, printed and saved as summary.json."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO


def progress_bar(total: int | None, unit: str, desc: str, *, enabled: bool = True):
    from tqdm import tqdm

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


def counted_texts(docs: Iterable, bar, every: int = 256) -> Iterator[str]:
    """The documents' texts; the bar moves every `every` documents (one update per document costs)."""
    count = 0
    for doc in docs:
        count += 1
        if count % every == 0:
            bar.update(every)
        yield doc.text
    bar.update(count % every)


def build_summary(
    *,
    out: str,
    read: dict,
    dropped: dict[str, int],
    splits: dict[str, dict],
    seq_len: int,
    workers: int,
    elapsed: float,
    reused_parts: int,
) -> dict:
    tokens = sum(split["tokens"] for split in splits.values())
    return {
        "out": out,
        "read": read,
        "dropped": dropped,
        "splits": splits,
        "seq_len": seq_len,
        "tokens_written": tokens,
        "workers": workers,
        "reused_parts": reused_parts,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
    }


def print_summary(summary: dict, stream: TextIO) -> None:
    read = summary["read"]
    lines = [f"converted into {summary['out']} in {summary['elapsed_s']:.1f} s"]
    if "documents" in read:
        lines.append(f"  documents read: {read['documents']} from {read.get('files', '?')} file(s)")
    if read.get("malformed"):
        lines.append(f"  malformed records skipped: {read['malformed']}")
        for example in read.get("malformed_examples", [])[:5]:
            lines.append(f"    {example['source']}:{example['line']}: {example['reason']}")
    dropped, tokens = summary["dropped"], summary.get("dropped_tokens", {})
    parts = [f"{k} {v}" + (f" ({tokens[k]:,} tokens)" if k in tokens else "") for k, v in dropped.items()]
    lines.append("  dropped: " + (", ".join(parts) if parts else "none"))
    near = summary.get("near_dedup")
    if near:
        lines.append(
            f"  near-duplicates: Jaccard >= {near['threshold']} over {near['ngram']}-character shingles; "
            f"{near['pairs_in_report']} sampled pair(s) in {near['report']}"
        )
    for name, split in summary["splits"].items():
        lines.append(
            f"  {name}: {split['documents']} documents, {split['samples']} samples x {summary['seq_len']} "
            f"= {split['tokens']} tokens in {split['shards']} shards"
            + (f" ({split['lost_tail_tokens']} tokens of the last partial sample not stored)")
        )
    rate = summary["tokens_per_s"]
    lines.append(
        f"  tokens written: {summary['tokens_written']}"
        + (f" ({rate:,.0f} tokens/s with {summary['workers']} worker(s))" if rate else "")
    )
    if summary["reused_parts"]:
        lines.append(f"  resumed: {summary['reused_parts']} part(s) reused from the interrupted run")
    stream.write("\n".join(lines) + "\n")
