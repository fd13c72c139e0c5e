"""A whole conversion as a function: text corpus -> shards (`convert_corpus`), token files ->
shards (`import_bin`).

The CLI, the tests and the benchmarks call `convert_corpus`; with a `TaskSpec` it converts one
task's share of a multi-machine conversion instead (convert/run/tasks.py, merged by `merge_tasks`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import closing

import numpy as np

from convert.budget import budget_warning, describe_peak, format_size, resolve_budget
from convert.dedup.selection import Selection
from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.reading.bin_files import bin_documents
from convert.reading.options import ReadOptions
from convert.records import Doc
from convert.run.conversion import Conversion, digest_of, split_of, tokenize_in_workers
from convert.run.merge import MERGE, merge_tasks
from convert.run.options import ShardOptions
from convert.run.report import Summary, counted_texts, progress_bar
from convert.run.tasks import TASKS, TaskMarker, TaskSpec, run_task
from shards.output import open_output

__all__ = ["TaskSpec", "check_read_options", "convert_corpus", "import_bin", "merge_tasks"]


def convert_corpus(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    options: ShardOptions = ShardOptions(),
    read: ReadOptions = ReadOptions(),
    command: str = "",
    task: TaskSpec | None = None,
) -> Summary | TaskMarker:
    """Read, clean, filter, de-duplicate, tokenize, pack and write `inputs` to `out`; returns the
    summary. With `task`, only that task's share of the files, up to the selected rows; returns
    its task.json."""
    from convert.reading.readers import ReadStats, check_inputs, check_read, read_documents
    from convert.reading.sources import expand_corpus, input_sizes, refuse_output_among_inputs
    from convert.run.ranges import RangeFeed, process_spooled_chunk, range_formats, spool_folder

    refuse_output_among_inputs(inputs, out)  # else a rerun would read the shards' JSON as text
    check_read_options(read, options)
    if task is not None:
        return run_task(
            inputs, tokenizer=tokenizer, out=out, options=options, read=read, task=task, command=command
        )
    corpus = expand_corpus(inputs, read.fmt)
    paths = corpus.paths
    for note in corpus.notes:
        print(note, flush=True)
    check_inputs(paths, read.fmt, read.text_field, read.preset)
    in_memory, line = plan_memory(paths, input_sizes(paths), options, read)
    print(line, flush=True)
    warning = budget_warning(resolve_budget(options.memory_budget), options.processes)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if not in_memory:
        return _in_two_passes(
            inputs, tokenizer=tokenizer, out=out, options=options, read=read, command=command
        )
    conversion = Conversion(tokenizer=tokenizer, out=out, options=options)
    cleaner = read.cleaner()
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
                val_fraction=conversion.options.val_fraction,
            ),
            write_here=options.main_helps,
            cleaner=read.worker_cleaner(),
        )
    dropped = cleaner.drops.as_dict()
    return conversion.finish(
        read=stats.as_dict(), dropped=dropped, start=start, command=command, selection=selection
    )


# One machine's de-duplication state per document, in memory (`make bench-dedup`): the Python set
# of exact digests, and with --near-dedup the band index and sketches (convert/dedup/near_dedup.py).
EXACT_BYTES_PER_DOCUMENT = 100
NEAR_BYTES_PER_DOCUMENT = 570 + EXACT_BYTES_PER_DOCUMENT
# Documents are counted from the inputs' bytes at this many a document (short: counts high, so
# a conversion goes to disk early rather than late); a compressed file (Parquet too) counts 4
# times its size.
INPUT_BYTES_PER_DOCUMENT = 400
_COMPRESSED = (".gz", ".zst", ".zstd", ".bz2", ".xz", ".parquet", ".pq")


def plan_memory(
    paths: list[str], sizes: list[int], options: ShardOptions, read: ReadOptions
) -> tuple[bool, str]:
    """Whether the de-duplication state of a one-machine conversion fits its memory budget, and the
    line that says so. When it does not, the conversion runs as one task and a merge on this
    machine (`_in_two_passes`): its state goes to disk as sorted runs, decided by partition."""
    budget = resolve_budget(options.memory_budget)
    size = sum(s * (4 if p.endswith(_COMPRESSED) else 1) for p, s in zip(paths, sizes, strict=True))
    documents = size // INPUT_BYTES_PER_DOCUMENT
    per_document = (
        NEAR_BYTES_PER_DOCUMENT if options.near_dedup is not None
        else EXACT_BYTES_PER_DOCUMENT if read.dedup else 0
    )  # fmt: skip
    need = documents * per_document
    head = (
        f"memory budget {format_size(budget)}: the de-duplication state of up to {documents:,} documents "
        f"({format_size(size)} of input at {INPUT_BYTES_PER_DOCUMENT} bytes a document) needs up to {format_size(need)}"
    )
    peak = describe_peak(budget, options.processes)
    if need <= budget:
        return True, head + f": in memory; {peak}"
    bands = options.near_dedup.bands if options.near_dedup is not None else 0
    bins = options.near_dedup.bins if options.near_dedup is not None else 0
    disk = documents * (41 + 32 + 16 * bands + bins) + 2 * size
    return False, (
        head + f": more than the budget, so it runs in two passes on this machine (one task, then the merge: "
        f"sorted runs decided by partition), with up to {format_size(disk)} of disk under OUT/tasks and OUT/merge, "
        f"removed at the end; {peak}"
    )


def _in_two_passes(
    inputs: list[str], *, tokenizer: str, out: str, options: ShardOptions, read: ReadOptions, command: str
) -> Summary:
    """A conversion whose de-duplication state does not fit its budget: one task, then the merge,
    here; the same output as in memory (convert/run/merge.py). A re-run after a kill reuses the
    finished task (and the merge's finished stages and parts)."""
    run_task(inputs, tokenizer=tokenizer, out=out, options=options, read=read, task=TaskSpec(1, 0),
             command=command, reuse=True)  # fmt: skip
    summary = merge_tasks(
        out, workers=options.workers, progress=options.progress, overwrite=options.overwrite, command=command,
        memory_budget=options.memory_budget,
    )  # fmt: skip
    store = open_output(out)
    store.delete_tree(TASKS)
    store.delete_tree(MERGE)
    return summary


def check_read_options(read: ReadOptions, options: ShardOptions) -> None:
    """Refuse reading options that contradict the shard options, before anything is written."""
    Cleaner(normalization=read.normalization)  # an unknown normalisation is refused here
    if options.near_dedup is not None and not read.dedup:
        raise ConvertError(
            "--near-dedup removes exact duplicates too (their similarity is 1): drop --no-dedup, "
            "or drop --near-dedup to keep every copy"
        )


def import_bin(
    files: list[str], *, tokenizer: str, out: str, options: ShardOptions = ShardOptions(), command: str = ""
) -> Summary:
    """Split .bin token files into documents and write them as shards; returns the summary."""
    from convert.reading.sources import expand_inputs

    conversion = Conversion(tokenizer=tokenizer, out=out, options=options)
    info = conversion.tokenizer
    paths = expand_inputs(files)
    conversion.prepare_output()
    counts = {"files": len(paths), "documents": 0}
    start = time.monotonic()

    eos = np.array([info.eos_id], dtype=np.uint32)
    bos = np.array([info.bos_id] if options.add_bos else [], dtype=np.uint32)

    def documents(_executor) -> Iterator[Doc]:
        with progress_bar(None, "doc", "importing", enabled=options.progress) as bar:
            for path in paths:
                for doc in bin_documents(path, eos_id=info.eos_id, vocab_size=info.vocab_size):
                    counts["documents"] += 1
                    bar.update()
                    digest = digest_of(doc)
                    tokens = np.concatenate([bos, doc, eos], dtype=np.uint32)
                    yield Doc(
                        digest=digest,
                        size=len(doc),
                        tokens=tokens,
                        split=split_of(digest, options.val_fraction),
                    )
        if counts["documents"] == 0:
            raise ConvertError(f"no tokens found in {', '.join(paths[:3])}: the .bin files are empty")

    conversion.run(documents)
    return conversion.finish(read=counts, dropped={}, start=start, command=command)
