"""A whole conversion as a function: text corpus -> shards (`convert.reading.bin_files`: token files).

The CLI, the tests and the benchmarks call `convert_corpus`; with a `TaskSpec` it converts one
task's share of a multi-machine conversion instead (convert/run/tasks.py, merged by `merge_tasks`).
"""

from __future__ import annotations

import time
from contextlib import closing

from convert.dedup.selection import Selection
from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.run.conversion import Conversion, tokenize_in_workers
from convert.run.options import ReadOptions, ShardOptions
from convert.run.report import counted_texts, progress_bar
from convert.run.tasks import TaskSpec, merge_tasks, run_task

__all__ = ["ReadOptions", "TaskSpec", "check_read_options", "convert_corpus", "merge_tasks"]


def convert_corpus(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    options: ShardOptions = ShardOptions(),
    read: ReadOptions = ReadOptions(),
    command: str = "",
    task: TaskSpec | None = None,
) -> dict:
    """Read, clean, filter, de-duplicate, tokenize, pack and write `inputs` to `out`; returns the
    summary. With `task`, only that task's share of the files, up to the selected rows."""
    from convert.reading.readers import ReadStats, check_read, read_documents
    from convert.reading.sources import expand_inputs, refuse_output_among_inputs
    from convert.run.ranges import RangeFeed, process_spooled_chunk, range_formats, spool_folder

    refuse_output_among_inputs(inputs, out)  # else a rerun would read the shards' JSON as text
    check_read_options(read, options)
    if task is not None:
        return run_task(
            inputs, tokenizer=tokenizer, out=out, options=options, read=read, task=task, command=command
        )
    conversion = Conversion(tokenizer=tokenizer, out=out, options=options)
    cleaner = read.cleaner()
    paths = expand_inputs(inputs)
    check_read(read.fmt, read.text_field, read.preset)
    formats = range_formats(paths, read)
    conversion.prepare_output()
    stats = ReadStats()
    start = time.monotonic()
    if formats is not None:  # the workers read the files themselves (convert/run/ranges.py)
        selection = Selection(conversion.options, cleaner)
        with (
            closing(selection),
            spool_folder() as spools,
            progress_bar(None, "doc", "reading", enabled=options.progress) as bar,
        ):
            feed = RangeFeed(conversion, selection, read, paths, formats, stats, bar, spools)
            conversion.run(
                chunks=feed.chunks,
                process=process_spooled_chunk,
                done=feed.done,
                write_here=options.main_helps,
                cleaner=read.worker_cleaner(),
            )
        return conversion.finish(
            read=stats.as_dict(),
            dropped=cleaner.drops.as_dict(),
            start=start,
            command=command,
            selection=selection,
        )
    docs = read_documents(
        paths, read.fmt, text_field=read.text_field, preset=read.preset, strict=read.strict, stats=stats
    )
    selection = Selection(conversion.options, cleaner)
    with closing(selection), progress_bar(None, "doc", "reading", enabled=options.progress) as bar:
        texts = counted_texts(docs, bar, documents=True)  # with their file and line
        conversion.run(
            lambda executor: tokenize_in_workers(
                executor,
                texts,
                selection=selection,
                window=4 * options.workers + 4,
                clean_here=options.main_helps,
            ),
            write_here=options.main_helps,
            cleaner=read.worker_cleaner(),
        )
    dropped = cleaner.drops.as_dict()
    return conversion.finish(
        read=stats.as_dict(), dropped=dropped, start=start, command=command, selection=selection
    )


def check_read_options(read: ReadOptions, options: ShardOptions) -> None:
    """Refuse reading options that contradict the shard options, before anything is written."""
    Cleaner(normalization=read.normalization)  # an unknown normalisation is refused here
    if options.near_dedup is not None and not read.dedup:
        raise ConvertError(
            "--near-dedup removes exact duplicates too (their similarity is 1): drop --no-dedup, "
            "or drop --near-dedup to keep every copy"
        )
