"""Conversion across many machines, the task side: N independent tasks, each storing what it
read, selected, signed and tokenized, for one merge (convert/run/merge.py) that equals a single run.

    task I of N (`shards ... --num-tasks N --task-index I`, any machine, any order, e.g. one
    SLURM array element): its share of the inputs, a contiguous run of the file list (as
    `expand_corpus` orders it) balanced by bytes; read, clean, filter, sign, tokenize with the
    workers of a normal conversion; exact de-duplication inside the task; then, under
    OUT/tasks/task-IIIII/:

      piece-PPPPP.rows     zstd .npz of the piece's rows (every row that reached the selection):
                           digest, characters, tokens, filter reason, the first band key of each
                           passing row (the pair sample), and the table of the token frames
      piece-PPPPP.tokens   the passing rows' tokens as independent zstd frames of about
                           FRAME_TOKENS tokens each (a merge worker reads only the frames it needs)
      digests-RRRRR.run    sorted runs (convert/dedup/runs.py) of (digest, row, pid) for every
                           row but the too-short ones, spilled as the memory budget requires
      keys-RRRRR.run       sorted runs of (band key, pid) for every band of every passing row
      sketches.u8          the passing rows' sketches in order (bins bytes each)
      sample.json          the texts of the task's pair-sample members (size and checksum in
                           task.json)
      tokenizer.model      the tokenizer the task used (`Tokenizer.files`: a tokenizer.json instead,
                           with the tokenizer_config.json / special_tokens_map.json beside it)
      task.json            LAST: settings, counts, every file's size (the rows files' checksums;
                           the runs and frames check themselves), when it finished

Rows count from 0 in each task, and pids over the task's passing rows; the merge numbers both over
all tasks in input order. Why the merge equals one machine: a task drops nothing that one machine
would keep. Its exact de-duplication removes a document only after an identical earlier one of
the same task, which comes earlier in the whole input too (when its set of digests reaches its
share of the memory budget it stops growing, and the later copies it no longer recognises are
left to the merge); everything that depends on other tasks' documents (exact duplicates across
tasks, every near-duplicate decision) is left to the merge, which decides by the same rules over
the same digests and signatures. The counts add up the same way: the tasks' own drops (empty
texts, duplicates inside a task) plus the merge's.

Costs: the tasks do the expensive part (cleaning and tokenizing, about 1 M tokens/s per core, and
the signatures); a task's files hold its tokens (zstd) plus, per document, about 41 bytes of row,
32 of digest run, 16 per band of key runs and `bins` of sketch (about 750 bytes with the default
26 bands and 256 bins). A task that is re-run starts its share again from scratch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from convert.budget import budget_warning, describe_peak, format_size, resolve_budget
from convert.dedup.minhash import SIGNATURE_VERSION
from convert.dedup.near_dedup import PairSample
from convert.dedup.pairs import NONE
from convert.dedup.runs import RunInfo, RunSpiller
from convert.dedup.selection import Selection
from convert.errors import ConvertError, DamagedFile
from convert.executor import start_workers
from convert.filters.quality import REASON_CODES, dominant_drop
from convert.reading.options import ReadOptions
from convert.records import DIGEST_BYTES, Selected
from convert.run.conversion import select_in_workers
from convert.run.options import ShardOptions
from convert.run.report import counted_texts, progress_bar
from convert.run.worker import init_worker
from convert.scratch import make_scratch
from shards.output import open_output, refuse_complete
from shards.tokenizer import Tokenizer
from storage import Store

TASKS = "tasks"
MARKER = "task.json"
TASK_FORMAT = 3  # bump when the task's files or task.json change
_PIECE_TOKENS = 1 << 24  # tokens per piece (32 MiB of uint16 before compression)
PIECE_ROWS = 1 << 16  # rows per piece at most: the merge holds a few pieces' rows at a time
# Tokens per independently compressed frame of a piece's tokens: a chunk reads the frames its
# documents lie in (a val chunk, a frame for each of its few documents of a piece).
FRAME_TOKENS = 1 << 16
_ZSTD_LEVEL = 3
_TOO_SHORT = REASON_CODES["too_short_chars"]
# Shares of the memory budget in a task: the exact-duplicate set (about 100 bytes per digest:
# a Python set of bytes), and the buffers of the digest and key runs before each is sorted and
# written (a run is written with about three times its entries' bytes at hand).
_SEEN_SHARE, _DIGEST_RUN_SHARE, _KEY_RUN_SHARE = 4, 24, 12
_SEEN_BYTES_PER_DIGEST = 100


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
    """One piece of a task's rows: `<name>.rows` and `<name>.tokens`."""

    name: str
    rows: int  # rows that reached the selection
    passing: int  # of them, the rows that passed the filters (they have tokens and a signature)
    rows_bytes: int
    rows_xxh3: str  # of the rows file (the token frames carry their own checksums)
    tokens_bytes: int


@dataclass(frozen=True, kw_only=True)
class SketchInfo:
    """A task's sketch file: `count` sketches of `bins` bytes."""

    name: str
    count: int
    bytes: int
    xxh3: str


@dataclass(frozen=True, kw_only=True)
class SampleInfo:
    """A task's sample.json: its size and checksum (the merge checks them before it parses it)."""

    name: str
    bytes: int
    xxh3: str


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
    rows: int
    passing: int
    digest_runs: list[RunInfo]
    key_runs: list[RunInfo]
    sketches: SketchInfo | None
    sample: SampleInfo
    elapsed_s: float
    finished_at: float  # time.time() when task.json was written
    command: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TaskMarker:
        return cls(**{
            **data,
            "pieces": [TaskPiece(**piece) for piece in data["pieces"]],
            "digest_runs": [RunInfo(**run) for run in data["digest_runs"]],
            "key_runs": [RunInfo(**run) for run in data["key_runs"]],
            "sketches": SketchInfo(**data["sketches"]) if data["sketches"] is not None else None,
            "sample": SampleInfo(**data["sample"]),
        })  # fmt: skip


# --- one task ------------------------------------------------------------------------------------


def run_task(
    inputs: list[str], *, tokenizer: str, out: str, options: ShardOptions, read: ReadOptions, task: TaskSpec,
    command: str = "", reuse: bool = False,
) -> TaskMarker:  # fmt: skip
    """Convert one task's share of `inputs` into pieces under OUT/tasks/; returns its task.json.
    `reuse`: a finished task with the same settings is kept (a one-machine conversion in two passes)."""
    from convert.reading.readers import ReadStats, check_inputs, read_documents
    from convert.reading.sources import expand_corpus, input_sizes

    loaded = Tokenizer(tokenizer)
    info = loaded.info()
    options = options.resolve(info)
    store = open_output(out)
    refuse_complete(store, options.overwrite, again="convert it again")
    corpus = expand_corpus(inputs, read.fmt)
    paths = corpus.paths
    for note in corpus.notes if not reuse else []:  # a conversion in two passes printed them
        print(note, flush=True)
    check_inputs(paths, read.fmt, read.text_field, read.preset)
    sizes = input_sizes(paths)
    share = assign_files(sizes, task.count)[task.index]
    mine = paths[share.start : share.stop]
    settings = settings_of(options, read, info.sha256, _inputs_fingerprint(paths, sizes), task.count)
    if reuse:
        done = store.read_json(f"{task.folder}/{MARKER}")
        if done is not None and done.get("settings") == settings:
            print(f"task {task.index} of {task.count}: finished by an earlier run, reused", flush=True)
            return TaskMarker.from_json(done)
    store.delete_tree(task.folder)  # a task is redone from scratch
    start = time.monotonic()
    budget = resolve_budget(options.memory_budget)
    cleaner = read.cleaner()
    cleaner.seen_limit = budget // _SEEN_SHARE // _SEEN_BYTES_PER_DIGEST
    sample = PairSample(per_key=8) if options.near_dedup is not None else None
    selection = Selection(options, cleaner, decide_near=False, sample=sample)
    writer = TaskWriter(store, task.folder, options, budget)
    stats = ReadStats()
    print(
        f"task {task.index} of {task.count}: {len(mine)} file(s), {format_size(sum(sizes[share.start : share.stop]))}; "
        f"memory budget {format_size(budget)}: {writer.describe()}; {describe_peak(budget, options.processes)}",
        flush=True,
    )
    warning = budget_warning(budget, options.processes)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    with writer:
        if mine:
            docs = read_documents(
                mine, read.fmt, text_field=read.text_field, preset=read.preset, strict=read.strict, stats=stats,
                allow_empty=True,
            )  # fmt: skip
            setup = (options, out, loaded.files, read.worker_cleaner())
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
                    writer.add(selected)
        writer.finish()
    for name, data in loaded.files.items():  # the merge reads the tokenizer from here
        store.write_bytes(f"{task.folder}/{name}", data)
    sample_info = write_sample(store, task.folder, sample)
    dropped = cleaner.drops.as_dict()
    marker = TaskMarker(
        task=task.index, settings=settings, files=mine, read=stats.as_dict(),
        dropped_before_selection={k: v for k, v in dropped.items() if k in ("empty", "duplicate")},
        dropped=dropped, dropped_tokens=dict(sorted(selection.dropped_tokens.items())), pieces=writer.pieces,
        rows=writer.rows, passing=writer.passing, digest_runs=writer.digest_runs, key_runs=writer.key_runs,
        sketches=writer.sketches, sample=sample_info, elapsed_s=round(time.monotonic() - start, 3), finished_at=time.time(),
        command=command,
    )  # fmt: skip
    store.write_json(f"{task.folder}/{MARKER}", marker.to_json())  # last: the task is done
    print(
        f"task {task.index} of {task.count}: {stats.documents} documents read, {writer.rows} rows "
        f"in {len(writer.pieces)} piece(s) under {store.url(task.folder)} in {marker.elapsed_s:.1f} s; "
        f"merge with `python -m convert merge --out {store.url()}` once all {task.count} tasks are done"
    )
    warning = dominant_drop(dropped, stats.documents, options.filters)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return marker


SAMPLE = "sample.json"


def write_sample(store: Store, folder: str, sample: PairSample | None) -> SampleInfo:
    """The texts of the pair sample's members (`PairSample.texts`), as `folder`/sample.json."""
    members = sample.texts() if sample is not None else []
    where = sample.where if sample is not None else {}
    records = [
        {
            "key": str(k),
            "position": p,
            "text": t,
            **({"file": where[p][0], "line": where[p][1]} if p in where else {}),
        }
        for k, p, t in members
    ]
    data = (json.dumps(records, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    store.write_bytes(f"{folder}/{SAMPLE}", data)
    return SampleInfo(name=SAMPLE, bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))


def read_sample(store: Store, folder: str, info: SampleInfo) -> list[dict]:
    """A task's sample.json, checked against task.json; `DamagedFile` when it does not match."""
    rel = f"{folder}/{info.name}"
    data = store.read_bytes(rel)
    if data is None:
        raise DamagedFile(store.url(rel), "missing")
    if len(data) != info.bytes:
        raise DamagedFile(store.url(rel), f"{len(data)} bytes where task.json says {info.bytes}")
    if xxhash.xxh3_64_hexdigest(data) != info.xxh3:
        raise DamagedFile(store.url(rel), "its checksum differs from task.json's")
    return json.loads(data)


class TaskWriter:
    """A task's selected rows, written as pieces (rows and token frames), sorted runs of digests and
    band keys, and the sketch file (module docstring)."""

    def __init__(self, store: Store, folder: str, options: ShardOptions, budget: int) -> None:
        self.store, self.folder, self.dtype = store, folder, np.dtype(options.dtype)
        self.near = options.near_dedup
        self.pieces: list[TaskPiece] = []
        self.rows = self.passing = 0  # so far: the next row's number and the next pid
        self._parts: list[dict[str, np.ndarray]] = []
        self._tokens = self._rows = 0  # in the piece being gathered
        self._digest_spiller = RunSpiller(store, f"{folder}/digests", 4, budget // _DIGEST_RUN_SHARE)
        self._key_spiller = (
            RunSpiller(store, f"{folder}/keys", 2, budget // _KEY_RUN_SHARE)
            if self.near is not None
            else None
        )
        self.digest_runs: list[RunInfo] = []
        self.key_runs: list[RunInfo] = []
        self.sketches: SketchInfo | None = None
        self._scratch = make_scratch("spool") if self.near is not None else None
        self._sketch_path = os.path.join(self._scratch, "sketches.u8") if self._scratch else None
        self._sketch_file = open(self._sketch_path, "wb") if self._sketch_path else None  # noqa: SIM115
        self._sketch_hash = xxhash.xxh3_64()
        self._sketch_count = 0

    def describe(self) -> str:
        limits = [f"digest runs spilled every {format_size(self._digest_spiller.limit)}"]
        if self._key_spiller is not None:
            limits.append(f"band-key runs every {format_size(self._key_spiller.limit)}")
        bands = self.near.bands if self.near is not None else 0
        per_doc = 41 + 32 + 16 * bands + (self.near.bins if self.near is not None else 0)
        return ", ".join(limits) + f"; disk: about {per_doc} bytes per document beside the tokens"

    def __enter__(self) -> TaskWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._sketch_file is not None:
            self._sketch_file.close()
        if self._scratch is not None:
            import shutil

            shutil.rmtree(self._scratch, ignore_errors=True)

    def add(self, selected: Selected) -> None:
        part = piece_rows(selected)
        count = len(part["chars"])
        if not count:
            return
        rows = np.arange(self.rows, self.rows + count, dtype=np.uint64)
        passing = part["reasons"] == 0
        pids = np.full(count, NONE, dtype=np.uint64)
        pids[passing] = np.arange(self.passing, self.passing + int(passing.sum()), dtype=np.uint64)
        digests = part["digests"].view("<u8").reshape(-1, 2)
        counted = part["reasons"] != _TOO_SHORT  # too-short rows are never duplicates (selection.py)
        self._digest_spiller.add(digests[counted, 0], digests[counted, 1], rows[counted], pids[counted])
        if self._key_spiller is not None:
            keys = part.pop("keys")
            bands = keys.shape[1]
            self._key_spiller.add(keys.ravel(), np.repeat(pids[passing], bands))
            part["first_keys"] = np.ascontiguousarray(keys[:, 0])
            sketches = np.ascontiguousarray(part.pop("sketches"))
            self._sketch_file.write(memoryview(sketches).cast("B"))
            self._sketch_hash.update(memoryview(sketches).cast("B"))
            self._sketch_count += len(sketches)
        self.rows += count
        self.passing += int(passing.sum())
        self._parts.append(part)
        self._tokens += len(part["tokens"])
        self._rows += count
        if self._tokens >= _PIECE_TOKENS or self._rows >= PIECE_ROWS:
            self._flush()

    def finish(self) -> None:
        if self._parts:
            self._flush()
        self.digest_runs = self._digest_spiller.finish()
        if self._key_spiller is not None:
            self.key_runs = self._key_spiller.finish()
            self._sketch_file.close()
            rel = f"{self.folder}/sketches.u8"
            self.store.upload(self._sketch_path, rel)
            self.sketches = SketchInfo(
                name="sketches.u8", count=self._sketch_count, bytes=os.path.getsize(self._sketch_path),
                xxh3=self._sketch_hash.hexdigest(),
            )  # fmt: skip

    def _flush(self) -> None:
        import zstd

        arrays = {key: np.concatenate([part[key] for part in self._parts]) for key in self._parts[0]}
        self._parts, self._tokens, self._rows = [], 0, 0
        tokens = arrays.pop("tokens").astype(self.dtype)
        lengths = arrays["lengths"][arrays["reasons"] == 0]
        frame_rows = frame_bounds(lengths, FRAME_TOKENS)
        token_at = np.r_[0, np.cumsum(lengths)][frame_rows]
        frames = [
            zstd.compress(tokens[a:b].tobytes(), _ZSTD_LEVEL)
            for a, b in zip(token_at[:-1], token_at[1:], strict=True)
        ]
        arrays["frame_rows"] = frame_rows
        arrays["frame_bytes"] = np.r_[0, np.cumsum([len(f) for f in frames], dtype=np.int64)].astype(np.int64)
        arrays["frame_sums"] = np.array([xxhash.xxh3_64_intdigest(f) for f in frames], dtype=np.uint64)
        name = f"piece-{len(self.pieces):05d}"
        data = b"".join(frames)
        self.store.write_bytes(f"{self.folder}/{name}.tokens", data)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        rows = zstd.compress(buffer.getvalue(), _ZSTD_LEVEL)
        self.store.write_bytes(f"{self.folder}/{name}.rows", rows)
        self.pieces.append(TaskPiece(
            name=name, rows=len(arrays["chars"]), passing=len(lengths), rows_bytes=len(rows),
            rows_xxh3=xxhash.xxh3_64_hexdigest(rows), tokens_bytes=len(data),
        ))  # fmt: skip


def frame_bounds(lengths: np.ndarray, frame_tokens: int) -> np.ndarray:
    """Where the frames of whole documents start (document indexes, then the count): a new frame
    at the first document starting at or past each multiple of `frame_tokens` tokens."""
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    cuts = np.searchsorted(starts, np.arange(frame_tokens, total, frame_tokens), side="left")
    return np.unique(np.r_[0, cuts, len(lengths)]).astype(np.int64)


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


# --- reading a task's files back (the merge) ------------------------------------------------------


@dataclass(kw_only=True)
class PieceRows:
    """A piece's rows as the merge's main process reads them (no tokens)."""

    digests: bytes  # DIGEST_BYTES per row
    chars: np.ndarray
    lengths: np.ndarray
    reasons: np.ndarray
    first_keys: np.ndarray | None  # per passing row, with near-duplicate removal
    frame_rows: np.ndarray  # the token frames: their first passing row, then the count
    frame_bytes: np.ndarray  # their byte offsets in the tokens file, then its size
    frame_sums: np.ndarray


def read_piece_rows(store: Store, folder: str, piece: TaskPiece) -> PieceRows:
    """A piece's rows file, checked against task.json; `DamagedFile` when it does not match."""
    import zstd

    rel = f"{folder}/{piece.name}.rows"
    data = store.read_bytes(rel)
    if data is None:
        raise DamagedFile(store.url(rel), "missing")
    if len(data) != piece.rows_bytes:
        raise DamagedFile(store.url(rel), f"{len(data)} bytes where task.json says {piece.rows_bytes}")
    if xxhash.xxh3_64_hexdigest(data) != piece.rows_xxh3:
        raise DamagedFile(store.url(rel), "its checksum differs from task.json's")
    with np.load(io.BytesIO(zstd.decompress(data))) as arrays:
        fields = {key: arrays[key] for key in arrays.files}
    return PieceRows(
        digests=fields["digests"].tobytes(), chars=fields["chars"], lengths=fields["lengths"],
        reasons=fields["reasons"], first_keys=fields.get("first_keys"), frame_rows=fields["frame_rows"],
        frame_bytes=fields["frame_bytes"], frame_sums=fields["frame_sums"],
    )  # fmt: skip


def read_frames(
    store: Store, rel: str, frame_bytes: np.ndarray, frame_sums: np.ndarray, dtype: str
) -> np.ndarray:
    """The tokens of consecutive frames (their byte offsets, then the end; their checksums), checked."""
    import zstd

    start, end = int(frame_bytes[0]), int(frame_bytes[-1])
    data = store.read_range(rel, start, end)
    if data is None or len(data) != end - start:
        raise DamagedFile(store.url(rel), "missing" if data is None else "shorter than task.json says")
    pieces = []
    for (lo, hi), checksum in zip(
        zip(frame_bytes[:-1], frame_bytes[1:], strict=True), frame_sums, strict=True
    ):
        frame = memoryview(data)[int(lo) - start : int(hi) - start]
        if xxhash.xxh3_64_intdigest(frame) != int(checksum):
            raise DamagedFile(store.url(rel), f"the frame at byte {int(lo)} does not match its checksum")
        pieces.append(np.frombuffer(zstd.decompress(bytes(frame)), dtype=dtype))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)


def sketch_digest(path: str) -> str:
    """XXH3-64 of a local sketch file, read in blocks (compared with task.json before it is used)."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            hasher.update(block)
    return hasher.hexdigest()
