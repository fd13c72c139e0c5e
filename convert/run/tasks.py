"""Conversion across many machines: N independent tasks, then one merge that equals a single run.

    task I of N (`shards ... --num-tasks N --task-index I`,      merge (`python -m convert merge --out OUT`,
    any machine, any order, e.g. one SLURM array element)        one machine, once every task is done)
    ------------------------------------------------------       ------------------------------------------
    its share of the inputs: a contiguous run of the file        checks that every task finished, with the
    list (as `expand_inputs` orders it), balanced by bytes       same inputs, tokenizer, options and code
    read, clean, filter, sign, tokenize: the workers of a        feeds the stored rows, task after task (so
    normal conversion; exact de-duplication inside the task      in input order), through one `Selection`:
    stores every row that reached the selection as pieces       exact duplicates across tasks, filter
    under OUT/tasks/task-IIIII/: filtered rows with their        counts, near duplicates over the
    digest and token count, the others with their tokens,        signatures of all tasks; then the chunks,
    band keys and sketch; then task.json LAST                    parts, tails, meta.json, summary.json,
                                                                 near_duplicates.json and index.json

Why the merge equals one machine: a task drops nothing that one machine would keep. Its exact
de-duplication removes a document only after an identical earlier one of the same task, which
comes earlier in the whole input too; everything that depends on other tasks' documents (exact
duplicates across tasks, every near-duplicate decision) is left to the merge, which makes it with
the same code, in the same order, over the same digests and signatures (convert/dedup/selection.py;
its decisions do not depend on how rows are batched). So the kept documents, their order and
tokens are those of a single run, and the same chunk and part steps turn them into the same
samples, shards and index. The counts add up the same way: the tasks' own drops (empty texts,
duplicates inside a task) plus the merge's.

Costs: the tasks do the expensive part (cleaning and tokenizing, about 1 M tokens/s per core,
and the signatures); a task's pieces hold its tokens (zstd) plus about 500 bytes per document
(digest, sizes, band keys, sketch). The merge reads them back, holds the near-duplicate index (as one
machine would) and packs, compresses and writes the shards with its workers. A task that is
re-run starts its share again from scratch; a merge that is re-run reuses the parts it wrote.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np

from convert.dedup.minhash import SIGNATURE_VERSION
from convert.dedup.near_dedup import PairSample
from convert.dedup.options import NearDedupOptions
from convert.dedup.selection import Selection
from convert.errors import ConvertError
from convert.executor import start_workers
from convert.filters.quality import QualityFilters
from convert.reading.options import ReadOptions
from convert.records import DIGEST_BYTES, Doc, Selected, TokenizedBatch, ToSelect
from convert.run.conversion import Conversion, select_in_workers
from convert.run.options import ShardOptions
from convert.run.report import Summary, counted_texts, progress_bar
from convert.run.worker import init_worker
from shards.output import open_output, refuse_complete
from shards.tokenizer import Tokenizer
from storage import Store

TASKS = "tasks"
MARKER = "task.json"
TASK_FORMAT = 1  # bump when the pieces or task.json change
_PIECE_TOKENS = 1 << 24  # tokens per piece file (32 MiB of uint16 before compression)
_ZSTD_LEVEL = 3


@dataclass(frozen=True)
class TaskSpec:
    """Task `index` (0-based) of `count`."""

    count: int
    index: int

    @classmethod
    def from_args(cls, count: int | None, index: int | None, environ=os.environ) -> TaskSpec | None:
        """The task from --num-tasks/--task-index, the index from a SLURM array when not given."""
        if count is None:
            if index is not None:
                raise ConvertError(
                    f"--task-index {index} needs --num-tasks (how many tasks share the inputs)"
                )
            return None
        if count < 1:
            raise ConvertError(f"--num-tasks {count} must be at least 1")
        if index is None:
            slurm = environ.get("SLURM_ARRAY_TASK_ID")
            if slurm is None:
                raise ConvertError(
                    f"--num-tasks {count} needs --task-index I (0..{count - 1}), or a SLURM array task "
                    "(SLURM_ARRAY_TASK_ID)"
                )
            try:
                index = int(slurm) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
            except ValueError:
                raise ConvertError(
                    f"SLURM_ARRAY_TASK_ID {slurm!r} is not a number; pass --task-index"
                ) from None
        if not 0 <= index < count:
            raise ConvertError(f"task index {index} is outside 0..{count - 1} for --num-tasks {count}")
        return cls(count, index)

    @property
    def folder(self) -> str:
        return task_folder(self.index)


def task_folder(index: int) -> str:
    return f"{TASKS}/task-{index:05d}"


def assign_files(sizes: list[int], count: int) -> list[range]:
    """Each task's files: contiguous runs of the file list, balanced by bytes (a file goes to the
    task its middle byte falls in; a task may get none)."""
    weights = sizes if sum(sizes) else [1] * len(sizes)
    total = sum(weights) or 1
    owners, before = [], 0
    for weight in weights:
        owners.append(min(count - 1, int(count * (before + weight / 2) / total)))
        before += weight
    bounds = np.searchsorted(np.array(owners, dtype=np.int64), np.arange(count + 1), side="left")
    return [range(int(bounds[i]), int(bounds[i + 1])) for i in range(count)]


def settings_of(
    options: ShardOptions, read: ReadOptions, tokenizer_sha256: str, inputs: str, count: int
) -> dict:
    """What must be the same in every task of one conversion (the merge checks it)."""
    shaping = {
        key: getattr(options, key)
        for key in (
            "seq_len",
            "val_fraction",
            "add_bos",
            "min_tokens",
            "dtype",
            "shard_size_mb",
            "chunk_chars",
        )
    }
    near = asdict(options.near_dedup) if options.near_dedup is not None else None
    return {
        "num_tasks": count,
        "inputs": inputs,
        "tokenizer_sha256": tokenizer_sha256,
        "options": {**shaping, "filters": asdict(options.filters), "near_dedup": near},
        "read": asdict(read),
        "signature_version": SIGNATURE_VERSION,
        "task_format": TASK_FORMAT,
    }


def _inputs_fingerprint(paths: list[str], sizes: list[int]) -> str:
    listing = "\n".join(f"{path}\t{size}" for path, size in zip(paths, sizes, strict=True))
    return f"{len(paths)} files, sha256 {hashlib.sha256(listing.encode()).hexdigest()[:16]}"


@dataclass(frozen=True, kw_only=True)
class TaskPiece:
    """One piece file of a task's rows."""

    name: str
    rows: int  # rows that reached the selection
    indexed: int  # of them, the rows that passed the filters


@dataclass(frozen=True, kw_only=True)
class TaskMarker:
    """task.json: a finished task (written last), what `run_task` returns and the merge reads back."""

    task: int
    settings: dict  # what every task of the conversion must share (`settings_of`)
    files: list[str]  # this task's share of the inputs
    read: dict  # `ReadStats.as_dict`
    # What never became a row (the merge counts the rest again): empty texts, duplicates in the task.
    dropped_before_selection: dict[str, int]
    dropped: dict[str, int]
    dropped_tokens: dict[str, int]
    pieces: list[TaskPiece]
    elapsed_s: float
    command: str

    def to_json(self) -> dict:
        return {**asdict(self), "pieces": [asdict(piece) for piece in self.pieces]}

    @classmethod
    def from_json(cls, data: dict) -> TaskMarker:
        return cls(**{**data, "pieces": [TaskPiece(**piece) for piece in data["pieces"]]})


# --- one task ------------------------------------------------------------------------------------


def run_task(
    inputs: list[str], *, tokenizer: str, out: str, options: ShardOptions, read: ReadOptions, task: TaskSpec,
    command: str = "",
) -> TaskMarker:  # fmt: skip
    """Convert one task's share of `inputs` into pieces under OUT/tasks/; returns its task.json."""
    from convert.reading.readers import ReadStats, read_documents
    from convert.reading.sources import expand_inputs, input_sizes

    loaded = Tokenizer(tokenizer)
    model_bytes, info = loaded.model_bytes, loaded.info()
    options = options.resolve(info)
    store = open_output(out)
    refuse_complete(store, options.overwrite, again="convert it again")
    paths = expand_inputs(inputs)
    sizes = input_sizes(paths)
    share = assign_files(sizes, task.count)[task.index]
    mine = paths[share.start : share.stop]
    settings = settings_of(options, read, info.sha256, _inputs_fingerprint(paths, sizes), task.count)
    store.delete_tree(task.folder)  # a task is redone from scratch
    start = time.monotonic()
    cleaner = read.cleaner()
    sample = PairSample(per_key=8) if options.near_dedup is not None else None
    selection = Selection(options, cleaner, decide_near=False, sample=sample)
    pieces = PieceWriter(store, task.folder, options.dtype)
    stats = ReadStats()
    if mine:
        docs = read_documents(
            mine, read.fmt, text_field=read.text_field, preset=read.preset, strict=read.strict, stats=stats,
            allow_empty=True,
        )  # fmt: skip
        setup = (options, out, model_bytes, read.worker_cleaner())
        desc = f"task {task.index}/{task.count}"
        with (
            progress_bar(None, "doc", desc, enabled=options.progress) as bar,
            start_workers(options.workers, init_worker, *setup) as executor,
        ):
            texts = counted_texts(docs, bar, documents=True)
            window = 4 * options.workers + 4
            for selected in select_in_workers(
                executor, texts, selection=selection, window=window, clean_here=options.main_helps
            ):
                pieces.add(selected)
    pieces.finish()
    store.write_bytes(f"{task.folder}/tokenizer.model", model_bytes)
    members = sample.texts() if sample is not None else []
    where = sample.where if sample is not None else {}
    store.write_json(
        f"{task.folder}/sample.json",
        [
            {
                "key": str(k),
                "position": p,
                "text": t,
                **({"file": where[p][0], "line": where[p][1]} if p in where else {}),
            }
            for k, p, t in members
        ],
    )
    dropped = cleaner.drops.as_dict()
    marker = TaskMarker(
        task=task.index,
        settings=settings,
        files=mine,
        read=stats.as_dict(),
        dropped_before_selection={k: v for k, v in dropped.items() if k in ("empty", "duplicate")},
        dropped=dropped,
        dropped_tokens=dict(sorted(selection.dropped_tokens.items())),
        pieces=pieces.pieces,
        elapsed_s=round(time.monotonic() - start, 3),
        command=command,
    )
    store.write_json(f"{task.folder}/{MARKER}", marker.to_json())  # last: the task is done
    rows = sum(piece.rows for piece in pieces.pieces)
    print(
        f"task {task.index} of {task.count}: {len(mine)} file(s), {stats.documents} documents read, {rows} rows "
        f"in {len(pieces.pieces)} piece(s) under {store.url(task.folder)} in {marker.elapsed_s:.1f} s; "
        f"merge with `python -m convert merge --out {store.url()}` once all {task.count} tasks are done"
    )
    return marker


class PieceWriter:
    """A task's selected rows, written as pieces: zstd-compressed .npz files of `TokenizedBatch` fields."""

    def __init__(self, store: Store, folder: str, dtype: str) -> None:
        self.store, self.folder, self.dtype = store, folder, np.dtype(dtype)
        self.pieces: list[TaskPiece] = []
        self._parts: list[dict[str, np.ndarray]] = []
        self._tokens = 0
        self._first_position: int | None = None

    def add(self, selected: Selected) -> None:
        part = piece_rows(selected)
        if not len(part["chars"]):
            return
        if self._first_position is None:
            self._first_position = selected.first_position
        self._parts.append(part)
        self._tokens += len(part["tokens"])
        if self._tokens >= _PIECE_TOKENS:
            self._flush()

    def finish(self) -> None:
        if self._parts:
            self._flush()

    def _flush(self) -> None:
        import zstd

        arrays = {key: np.concatenate([part[key] for part in self._parts]) for key in self._parts[0]}
        arrays["tokens"] = arrays["tokens"].astype(self.dtype)
        arrays["first_position"] = np.array([self._first_position], dtype=np.int64)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        name = f"piece-{len(self.pieces):05d}.npz.zst"
        self.store.write_bytes(f"{self.folder}/{name}", zstd.compress(buffer.getvalue(), _ZSTD_LEVEL))
        indexed = int((arrays["reasons"] == 0).sum())
        self.pieces.append(TaskPiece(name=name, rows=len(arrays["chars"]), indexed=indexed))
        self._parts, self._tokens, self._first_position = [], 0, None


def piece_rows(selected: Selected) -> dict[str, np.ndarray]:
    """A batch's rows that reached the selection (first seen: filtered or indexed), as arrays."""
    batch = selected.batch
    rows = np.sort(np.concatenate([selected.indexed, selected.filtered]))
    among_passing = np.cumsum(batch.passing()) - 1
    passing_lengths = batch.lengths[batch.passing()]
    starts = np.cumsum(passing_lengths) - passing_lengths
    indexed = selected.indexed
    lengths = batch.lengths[indexed]
    begin = starts[among_passing[indexed]]
    gather = np.repeat(begin - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    reasons = batch.reasons[rows] if batch.reasons is not None else np.zeros(len(rows), dtype=np.int8)
    digests = np.frombuffer(batch.digests, dtype=np.uint8).reshape(-1, DIGEST_BYTES)[rows]
    part = {
        "digests": digests, "chars": batch.chars[rows], "lengths": batch.lengths[rows], "reasons": reasons,
        "tokens": batch.tokens[gather],
    }  # fmt: skip
    if batch.keys is not None:
        part["keys"] = batch.keys[among_passing[indexed]]
        part["sketches"] = batch.sketches[among_passing[indexed]]
    return part


def load_piece(store: Store, folder: str, name: str) -> tuple[TokenizedBatch, int]:
    """A stored piece as the `TokenizedBatch` it came from, and its first row's task position."""
    import zstd

    data = store.read_bytes(f"{folder}/{name}")
    if data is None:
        raise ConvertError(f"{store.url(folder)}/{name} is missing: run that task again, then merge")
    with np.load(io.BytesIO(zstd.decompress(data))) as arrays:
        fields = {key: arrays[key] for key in arrays.files}
    reasons = fields["reasons"]
    batch = TokenizedBatch(
        digests=fields["digests"].tobytes(),
        chars=fields["chars"],
        lengths=fields["lengths"],
        tokens=fields["tokens"],
        drops={},
        reasons=reasons if reasons.any() else None,
        keys=fields.get("keys"),
        sketches=fields.get("sketches"),
    )
    return batch, int(fields["first_position"][0])


# --- the merge -----------------------------------------------------------------------------------


def read_markers(store: Store) -> list[TaskMarker]:
    """Every task's task.json, checked complete and consistent; refused naming the task that is not."""
    names = [name for name in store.list_dirs(TASKS) if name.startswith("task-") and name[5:].isdigit()]
    if not names:
        raise ConvertError(
            f"{store.url(TASKS)} holds no task output: run `python -m convert shards ... --num-tasks N "
            "--task-index I` for every I first"
        )
    first = store.read_json(f"{TASKS}/{names[0]}/{MARKER}")
    if first is None:
        raise ConvertError(
            f"task {int(names[0][5:])} has not finished (no {MARKER}): run it again, then merge"
        )
    count = first["settings"]["num_tasks"]
    markers = []
    for index in range(count):
        marker = store.read_json(f"{task_folder(index)}/{MARKER}")
        if marker is None:
            raise ConvertError(
                f"task {index} of {count} has not finished (no {task_folder(index)}/{MARKER}): run it "
                "(again), then merge"
            )
        _check_same(index, marker["settings"], first["settings"], int(names[0][5:]))
        markers.append(TaskMarker.from_json(marker))
    extra = [name for name in names if int(name[5:]) >= count]
    if extra:
        raise ConvertError(
            f"{store.url(TASKS)} holds {extra[0]}, beyond the {count} tasks of this conversion: it comes from "
            f"another run; remove it, then merge"
        )
    return markers


def _check_same(index: int, settings: dict, reference: dict, reference_index: int) -> None:
    for key in reference.keys() | settings.keys():
        mine, theirs = settings.get(key), reference.get(key)
        if key == "options" and isinstance(mine, dict) and isinstance(theirs, dict):
            differing = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differing:
                k = differing[0]
                raise ConvertError(
                    f"task {index} differs from task {reference_index} in {k} ({mine.get(k)} vs {theirs.get(k)}): "
                    "re-run it with the same options as the others, then merge"
                )
        elif mine != theirs:
            raise ConvertError(
                f"task {index} differs from task {reference_index} in {key} ({mine} vs {theirs}): re-run it with "
                "the same inputs, tokenizer and options as the others, then merge"
            )


def _options_from(settings: dict, *, workers: int, progress: bool, overwrite: bool) -> ShardOptions:
    saved = dict(settings["options"])
    filters = QualityFilters(**saved.pop("filters"))
    near = saved.pop("near_dedup")
    near_options = NearDedupOptions(**near) if near is not None else None
    return ShardOptions(
        **saved,
        workers=workers,
        progress=progress,
        overwrite=overwrite,
        filters=filters,
        near_dedup=near_options,
    )


def merge_tasks(
    out: str, *, workers: int = 1, progress: bool = True, overwrite: bool = False, command: str = ""
) -> Summary:
    """Merge the finished tasks under OUT/tasks/ into the conversion one machine would have
    written to OUT; returns its summary."""
    store = open_output(out)
    markers = read_markers(store)
    settings = markers[0].settings
    options = _options_from(settings, workers=workers, progress=progress, overwrite=overwrite)
    conversion = Conversion(
        tokenizer=store.url(f"{task_folder(0)}/tokenizer.model"), out=out, options=options
    )
    if conversion.tokenizer.sha256 != settings["tokenizer_sha256"]:
        raise ConvertError(
            f"{store.url(task_folder(0))}/tokenizer.model does not match its task.json: run task 0 again"
        )
    conversion.prepare_output()
    read = ReadOptions(**settings["read"])
    cleaner = read.cleaner()
    for marker in markers:  # what the tasks dropped before their rows
        for reason, count in marker.dropped_before_selection.items():
            cleaner.drops.add(reason, count)
    near = conversion.options.near_dedup
    selection = Selection(conversion.options, cleaner, sample=PairSample() if near is not None else None)
    texts = _sample_texts(store, markers) if near is not None else {}
    start = time.monotonic()
    total = sum(len(marker.pieces) for marker in markers)

    def pieces() -> Iterator[ToSelect]:
        for index, marker in enumerate(markers):
            for piece in marker.pieces:
                batch, first = load_piece(store, task_folder(index), piece.name)
                local = first + np.cumsum(batch.passing()) - 1
                text = partial(_sample_text, texts, index, local)
                yield ToSelect(batch=batch, text=text, deduped=False)

    def documents(_executor) -> Iterator[Doc]:
        with progress_bar(total, "piece", "merging", enabled=progress) as bar:
            for selected in selection.select_all(pieces()):
                yield from selected.documents(conversion.options.val_fraction)
                bar.update()

    with closing(selection):
        conversion.run(documents, write_here=conversion.options.main_helps, cleaner=read.worker_cleaner())
    return conversion.finish(
        read=_merged_read(markers),
        dropped=cleaner.drops.as_dict(),
        start=start,
        command=command or markers[0].command,
        selection=selection,
        tasks=len(markers),
    )


def _sample_text(texts: dict, task: int, local: np.ndarray, row: int) -> str | tuple[str, str, int] | None:
    """A row's text for the pair sample, if its task's sample.json has it (by task and position)."""
    return texts.get((task, int(local[row])))


def _sample_texts(
    store: Store, markers: list[TaskMarker]
) -> dict[tuple[int, int], str | tuple[str, str, int]]:
    texts = {}
    for index in range(len(markers)):
        for member in store.read_json(f"{task_folder(index)}/sample.json") or []:
            text = member["text"]
            texts[(index, member["position"])] = (
                (text, member["file"], member["line"]) if "file" in member else text
            )
    return texts


def _merged_read(markers: list[TaskMarker]) -> dict:
    read = {"files": 0, "documents": 0, "malformed": 0, "malformed_examples": []}
    for marker in markers:
        for key in ("files", "documents", "malformed"):
            read[key] += marker.read[key]
        read["malformed_examples"] += marker.read["malformed_examples"]
    read["malformed_examples"] = read["malformed_examples"][:20]
    return read
