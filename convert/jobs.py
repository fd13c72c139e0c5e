"""Whole conversions as functions: text corpus -> shards (and the shared finishing steps).

The CLI, the tests and the benchmark call these; `convert.bin_import` reuses `finish`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from convert.errors import ConvertError
from convert.pipeline import (
    SPLITS,
    Conversion,
    ShardOptions,
    open_tokenizer,
    progress_bar,
    tokenize_in_workers,
)
from convert.report import build_summary, print_summary


@dataclass(frozen=True)
class ReadOptions:
    fmt: str = "auto"
    text_field: str | None = None
    preset: str | None = None
    strict: bool = False
    normalization: str = "NFKC"
    min_chars: int = 1
    dedup: bool = True


def convert_corpus(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    options: ShardOptions = ShardOptions(),
    read: ReadOptions = ReadOptions(),
    command: str = "",
) -> dict:
    """Read, clean, tokenize, pack and write `inputs` to `out`; returns the summary."""
    from convert.cleaning import Cleaner
    from convert.readers import ReadStats, read_documents
    from convert.sources import expand_inputs

    model_bytes, info = open_tokenizer(tokenizer)
    conversion = Conversion(
        model_bytes=model_bytes,
        tokenizer=info,
        out=out,
        options=options,
        normalization=read.normalization,
        min_chars=read.min_chars,
    )
    cleaner = Cleaner(normalization=read.normalization, min_chars=read.min_chars, dedup=read.dedup)
    paths = expand_inputs(inputs)
    conversion.prepare_output()
    stats = ReadStats()
    start = time.monotonic()
    docs = read_documents(
        paths, read.fmt, text_field=read.text_field, preset=read.preset, strict=read.strict, stats=stats
    )
    with progress_bar(None, "doc", "reading", enabled=options.progress) as bar:
        texts = _counted(docs, bar)
        conversion.run(
            lambda executor: tokenize_in_workers(
                executor,
                texts,
                cleaner=cleaner,
                val_fraction=options.val_fraction,
                window=4 * options.workers + 4,
                clean_here=options.main_helps,
            ),
            write_here=options.main_helps,
        )
    dropped = cleaner.drops.as_dict()
    return finish(conversion, read=stats.as_dict(), dropped=dropped, start=start, command=command)


def _counted(docs: Iterable, bar, every: int = 256) -> Iterator[str]:
    """The documents' texts; the bar moves every `every` documents (one update per document costs)."""
    count = 0
    for doc in docs:
        count += 1
        if count % every == 0:
            bar.update(every)
        yield doc.text
    bar.update(count % every)


def finish(
    conversion: Conversion, *, read: dict, dropped: dict[str, int], start: float, command: str
) -> dict:
    """Check there is something to write; write meta, summary, then the indexes last."""
    totals = conversion.totals
    options = conversion.options
    if totals["train"].samples == 0:
        read_docs = read.get("documents", "the")
        raise ConvertError(
            f"nothing to write: {read_docs} documents gave no full training sample of {options.seq_len} tokens "
            f"(dropped: {dropped or 'none'}, too short in tokens: {totals['train'].too_short}); "
            "add text, lower --seq-len or --min-tokens"
        )
    malformed = {"malformed": read["malformed"]} if read.get("malformed") else {}
    for split in SPLITS:
        conversion.write_meta(split, {**dropped, **malformed}, command)
    all_dropped = {**dropped, **malformed, "too_short_tokens": sum(t.too_short for t in totals.values())}
    summary = build_summary(
        out=conversion.store.url(),
        read=read,
        dropped=all_dropped,
        splits={split: _split_summary(conversion, split) for split in SPLITS},
        seq_len=options.seq_len,
        workers=options.workers,
        elapsed=time.monotonic() - start,
        reused_parts=conversion.reused_parts,
    )
    conversion.store.write_json("summary.json", summary)
    conversion.write_indexes()
    print_summary(summary, sys.stdout)
    if totals["val"].samples == 0 and options.val_fraction > 0:
        sys.stderr.write(
            f"warning: the val split is empty (too little text for a {options.seq_len}-token sample at "
            f"--val-fraction {options.val_fraction}); raise --val-fraction for a validation set\n"
        )
    return summary


def _split_summary(conversion: Conversion, split: str) -> dict:
    totals = conversion.totals[split]
    return {
        "documents": totals.documents,
        "too_short_tokens": totals.too_short,
        "samples": totals.samples,
        "tokens": totals.samples * conversion.options.seq_len,
        "shards": len(totals.shards),
        "parts": len(totals.parts),
        "lost_tail_tokens": totals.lost_tail_tokens,
    }
