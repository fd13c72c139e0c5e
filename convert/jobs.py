"""A whole conversion as a function: text corpus -> shards (`convert.bin_import`: token files).

The CLI, the tests and the benchmark call it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from convert.cleaning import Cleaner
from convert.conversion import Conversion, tokenize_in_workers
from convert.options import ShardOptions
from convert.report import progress_bar


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
    from convert.readers import ReadStats, read_documents
    from convert.sources import expand_inputs

    conversion = Conversion(tokenizer=tokenizer, out=out, options=options)
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
            cleaner=Cleaner(normalization=read.normalization, min_chars=read.min_chars, dedup=False),
        )
    dropped = cleaner.drops.as_dict()
    return conversion.finish(read=stats.as_dict(), dropped=dropped, start=start, command=command)


def _counted(docs: Iterable, bar, every: int = 256) -> Iterator[str]:
    """The documents' texts; the bar moves every `every` documents (one update per document costs)."""
    count = 0
    for doc in docs:
        count += 1
        if count % every == 0:
            bar.update(every)
        yield doc.text
    bar.update(count % every)
