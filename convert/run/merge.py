"""Conversion across many machines, the merge: every task's rows (convert/run/tasks.py) into the
output one machine would have written.

`python -m convert merge --out OUT`, once every task is done:

  1. every task.json read and checked: finished, the same inputs, tokenizer, options and code (a
     task that differs is named: the odd one out, or the one run last), its files whole as they
     are read (a damaged one is named with its task, and the fix: run that task again);
  2. the plan (merge/plan.json): the exact stage in P partitions and the near stage in Q, so that
     one partition in each worker at once fits the memory budget (`--memory-budget`); printed,
     with the disk the stages need;
  3. the exact stage (convert/dedup/stages.py) in the worker pool, one job per partition of the
     digests: the duplicate rows and pids (merge/exact-PPPPP.*); the sketch files checked (and
     copied to a scratch folder when the output is on S3);
  4. the near stage, one job per partition of the band keys: every near pair (at or above the
     threshold), by position (merge/near-QQQQQ.*);
  5. the ordered pass, in this process: each piece's documents in input order. A worker reads and
     checks the piece's rows a few pieces ahead (digest, size, token count, filter reason), counts
     the filtered rows and the exact duplicates (the duplicate rows' bitmap, saved to the scratch
     folder) and hands back only the documents that reach near-duplicate removal (`sift_piece`).
     This process adds the near decisions (the pairs read in order from the Q outputs, decided by
     the rule: convert/dedup/pairs.py `NearDecisions`): the drop counts,
     the pair sample, the split, the cut into chunks, exactly as `Selection` and
     `chunk_documents` decide; a chunk goes to a worker as the token frames and offsets of its
     documents, and the worker reads, concatenates, packs and writes it, and formats its
     index.json entries (`process_merged_chunk`): this process touches no token and no filtered
     or duplicate row;
  6. tails, meta.json, summary.json, near_duplicates.json and index.json, as a single run.

Each stage's job writes its files and this process its marker (merge/<job>.json, naming the plan)
after them, so a merge killed at any point and run again reuses what is done and redoes the rest;
finished parts are reused as in any conversion. A partition's decisions do not depend on P, Q,
the workers or the tasks' runs, so the output is the same for any of them.

Why the ordered pass waits for every task: the stages partition the keys of all tasks, and a
document's decisions depend on every earlier document, so task i's rows can be decided once
tasks 0..i are done, but not with partitions over all tasks before all of them exist. The stages
take minutes against the tasks' hours (`make bench-dedup-scale`), so the merge starts after the
last task.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from convert.budget import budget_warning, describe_peak, format_size, resolve_budget
from convert.dedup.near_dedup import PairSample
from convert.dedup.options import NearDedupOptions
from convert.dedup.pairs import NearDecisions, RankedBits, sorted_contains
from convert.dedup.runs import RunCursor, RunFile, RunInfo
from convert.dedup.stages import (
    EXACT_BYTES_PER_ENTRY,
    NEAR_BYTES_PER_ENTRY,
    ExactJob,
    ExactResult,
    NearJob,
    RunRef,
    SketchFile,
    read_all,
    run_exact,
    run_near,
)
from convert.errors import ConvertError, DamagedFile
from convert.executor import ordered, start_workers
from convert.filters.cleaning import DropCounts
from convert.filters.quality import REASON_CODES, REASONS, QualityFilters
from convert.reading.options import ReadOptions
from convert.records import DIGEST_BYTES, ChunkTokens, PartResult, gathered, in_val
from convert.run.conversion import Conversion, OpenChunk
from convert.run.options import ShardOptions
from convert.run.report import Summary, progress_bar
from convert.run.tasks import (
    MARKER,
    PIECE_ROWS,
    TASK_FORMAT,
    TASKS,
    TaskMarker,
    TaskPiece,
    read_frames,
    read_piece_rows,
    read_sample,
    sketch_digest,
    task_folder,
)
from convert.run.worker import current_store, process_chunk
from convert.scratch import make_scratch
from shards.meta import SPLITS
from shards.output import open_output
from storage import Store

MERGE = "merge"
PLAN = f"{MERGE}/plan.json"
ID_BASE = 0  # the first row, pid and position (a test starts them just below 2**32)
_TOO_SHORT = REASON_CODES["too_short_chars"]
_NEAR_DUPLICATE = "near_duplicate"
_LEAST_SHARE = 16 << 10  # a worker's share of the budget below which the merge refuses to start
_PROCESS_BYTES = 20 << 20  # a process's own memory (`make bench-dedup-scale`: 41-56 MiB for 3)
# The partitions fill this share of what the merge leaves its workers: headroom for what the
# per-entry figures miss (the allocator; the main process's ordered pass starting while a stage's
# last jobs are still resident). Without it, 10 M documents under a 256 MiB budget peaked at
# 220-275 MiB in three runs (`make bench-dedup-scale`, 2026-12-03).
HEADROOM = 0.8


# --- the tasks ------------------------------------------------------------------------------------


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
    raw = []
    for index in range(count):
        marker = store.read_json(f"{task_folder(index)}/{MARKER}")
        if marker is None:
            raise ConvertError(
                f"task {index} of {count} has not finished (no {task_folder(index)}/{MARKER}): run it "
                "(again), then merge"
            )
        written = marker.get("settings", {}).get("task_format")
        if written != TASK_FORMAT:
            raise ConvertError(
                f"task {index} was written by another version of the converter (task format {written}, this "
                f"merge reads {TASK_FORMAT}): run it again, then merge"
            )
        raw.append(marker)
    _check_same(raw)
    extra = [name for name in names if int(name[5:]) >= count]
    if extra:
        raise ConvertError(
            f"{store.url(TASKS)} holds {extra[0]}, beyond the {count} tasks of this conversion: it comes from "
            f"another run; remove it, then merge"
        )
    markers = []
    for index, marker in enumerate(raw):
        try:
            markers.append(TaskMarker.from_json(marker))
        except (KeyError, TypeError) as err:
            raise ConvertError(
                f"task {index}'s {MARKER} is not one this converter wrote ({err}): run it again"
            ) from None
    return markers


def _check_same(markers: list[dict]) -> None:
    """Refuse tasks whose settings differ, naming the odd one: against the settings most tasks
    share, or, when no settings have a majority, against those of the task that finished first
    (a task re-run with other options is the one to blame, not the untouched ones)."""
    groups: dict[str, list[int]] = {}
    for index, marker in enumerate(markers):
        groups.setdefault(json.dumps(marker["settings"], sort_keys=True), []).append(index)
    if len(groups) == 1:
        return
    finished = [marker.get("finished_at", 0.0) for marker in markers]
    reference = max(groups.values(), key=lambda g: (len(g), -min(finished[i] for i in g)))
    blamed = min(i for g in groups.values() if g is not reference for i in g)
    mine, theirs = markers[blamed]["settings"], markers[reference[0]]["settings"]
    for key in sorted(theirs.keys() | mine.keys()):
        a, b = mine.get(key), theirs.get(key)
        if key == "options" and isinstance(a, dict) and isinstance(b, dict) and a != b:
            k = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))[0]
            raise ConvertError(
                f"task {blamed} differs from task {reference[0]} in {k} ({a.get(k)} vs {b.get(k)}): re-run it "
                "with the same options as the others, then merge"
            )
        if a != b:
            raise ConvertError(
                f"task {blamed} differs from task {reference[0]} in {key} ({a} vs {b}): re-run it with the same "
                "inputs, tokenizer and options as the others, then merge"
            )


def _options_from(
    settings: dict, *, workers: int, progress: bool, overwrite: bool, memory_budget: int
) -> ShardOptions:
    saved = dict(settings["options"])
    filters = QualityFilters(**saved.pop("filters"))
    near = saved.pop("near_dedup")
    return ShardOptions(
        **saved, workers=workers, progress=progress, overwrite=overwrite, filters=filters,
        near_dedup=NearDedupOptions(**near) if near is not None else None, memory_budget=memory_budget,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Tasks:
    """The tasks in input order, with where each one's rows and pids start."""

    markers: list[TaskMarker]
    row_bases: list[int]
    pid_bases: list[int]

    @classmethod
    def of(cls, markers: list[TaskMarker]) -> Tasks:
        rows = np.cumsum([0] + [m.rows for m in markers]).tolist()
        pids = np.cumsum([0] + [m.passing for m in markers]).tolist()
        return cls(
            markers=markers, row_bases=[ID_BASE + r for r in rows], pid_bases=[ID_BASE + p for p in pids]
        )

    @property
    def rows(self) -> int:
        return self.row_bases[-1] - ID_BASE

    @property
    def passing(self) -> int:
        return self.pid_bases[-1] - ID_BASE

    def runs(self, kind: str) -> tuple[RunRef, ...]:
        return tuple(
            RunRef(rel=f"{task_folder(i)}/{run.name}", bytes=run.bytes, row_base=self.row_bases[i],
                   pid_base=self.pid_bases[i])
            for i, marker in enumerate(self.markers)
            for run in (marker.digest_runs if kind == "digests" else marker.key_runs)
        )  # fmt: skip

    def entries(self, kind: str) -> int:
        return sum(
            run.entries for m in self.markers for run in (m.digest_runs if kind == "digests" else m.key_runs)
        )

    def fingerprint(self) -> str:
        text = json.dumps([m.to_json() for m in self.markers], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How the stages are cut: written to merge/plan.json, named by every stage's marker."""

    tasks: str  # `Tasks.fingerprint`
    exact_partitions: int
    near_partitions: int
    id_base: int

    @property
    def name(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def main_bytes(tasks: Tasks, budget: int, workers: int) -> int:
    """What the budget holds besides the stages' partitions: the ordered pass's bitmap of duplicate
    rows, the ranked bitmap of duplicate pids and the near decisions' bitmap of removed documents
    (they grow with the corpus), the near outputs' read buffers (an eighth of the budget); and
    fixed costs, each counted up to another eighth: the pieces' rows in flight (one per worker and
    two more, at most PIECE_ROWS rows of about 64 bytes), and each process's interpreter, numpy
    and SentencePiece (`_PROCESS_BYTES`)."""
    in_flight = min((workers + 2) * PIECE_ROWS * 64, budget // 8)
    processes = min((workers + 1) * _PROCESS_BYTES, budget // 8)
    return tasks.rows // 8 + tasks.passing // 4 + tasks.passing // 8 + budget // 8 + in_flight + processes


def plan_stages(
    tasks: Tasks, budget: int, workers: int, near: bool, partitions: tuple[int, int] | None
) -> Plan:
    """Partitions that each fit a worker's share of what the ordered pass leaves of the budget: its
    duplicate bitmaps (a bit per row, two per pid) and the near outputs' read buffers (an eighth)."""
    main = main_bytes(tasks, budget, workers)
    share = int((budget - main) * HEADROOM) // workers
    if share < _LEAST_SHARE:
        raise ConvertError(
            f"--memory-budget {format_size(budget)} leaves less than {format_size(_LEAST_SHARE)} per worker once what "
            f"the merge holds itself (duplicate bitmaps, buffers, its processes: {format_size(main)}) is counted: "
            "raise it, or use fewer --workers"
        )
    exact = max(1, math.ceil(tasks.entries("digests") * EXACT_BYTES_PER_ENTRY / share))
    near_count = max(1, math.ceil(tasks.entries("keys") * NEAR_BYTES_PER_ENTRY / share)) if near else 0
    if partitions is not None:
        exact, near_count = partitions[0], partitions[1] if near else 0
    if max(exact, near_count) > 1 << 16:
        raise ConvertError(
            f"--memory-budget {format_size(budget)} would need {max(exact, near_count):,} partitions (at most 65,536): "
            "raise it"
        )
    return Plan(
        tasks=tasks.fingerprint(), exact_partitions=exact, near_partitions=near_count, id_base=ID_BASE
    )


def _adopt_plan(store: Store, plan: Plan) -> Plan:
    """The plan an earlier run of this merge left, if it is for the same tasks and fits the budget
    as well (its stages' files are reused); else this one, and the earlier run's files go."""
    earlier = store.read_json(PLAN)
    if earlier is not None:
        try:
            old = Plan(**earlier)
        except TypeError:
            old = None
        if (
            old is not None and old.tasks == plan.tasks and old.id_base == plan.id_base
            and old.exact_partitions >= plan.exact_partitions and old.near_partitions >= plan.near_partitions
        ):  # fmt: skip
            return old
    store.delete_tree(MERGE)
    store.write_json(PLAN, asdict(plan))
    return plan


def describe_plan(store: Store, tasks: Tasks, plan: Plan, budget: int, workers: int, bins: int | None) -> str:
    runs = sum(run.bytes for m in tasks.markers for run in (*m.digest_runs, *m.key_runs))
    sketches = sum(m.sketches.bytes for m in tasks.markers if m.sketches is not None)
    line = (
        f"merge: {len(tasks.markers)} task(s), {tasks.rows:,} rows ({tasks.passing:,} passing the filters); "
        f"memory budget {format_size(budget)} over {workers} worker(s): exact duplicates in "
        f"{plan.exact_partitions} partition(s)"
    )
    if bins is not None:
        line += f", near duplicates in {plan.near_partitions}"
    line += f"; disk: reads {format_size(runs)} of sorted runs"
    if bins is not None:
        where = "copied to the temp folder (the output is on S3)" if store.is_remote else "mapped in place"
        line += f" and {format_size(sketches)} of sketches ({where})"
    duplicates_bytes = 8 * tasks.rows // 4  # at most: every row a duplicate, with its pid
    return (
        line
        + f", writes about {format_size(duplicates_bytes + 24 * tasks.passing)} under {store.url(MERGE)} "
        "(24 bytes a near pair)"
    )


# --- the stages -----------------------------------------------------------------------------------


def _marker_rel(name: str) -> str:
    return f"{MERGE}/{name}.json"


def _done(store: Store, plan: Plan, name: str) -> dict | None:
    """A stage job's marker, when it belongs to this plan and its files are all there at their size."""
    marker = store.read_json(_marker_rel(name))
    if not marker or marker.get("plan") != plan.name:
        return None
    for info in marker["files"]:
        if store.size(f"{MERGE}/{info['name']}") != info["bytes"]:
            return None
    return marker


def _stage(
    store: Store, executor, plan: Plan, jobs: list, fn, names: list[str], files, window: int
) -> list[dict]:
    """Each job's marker: reused when done, else the job run in the pool and its marker written."""
    markers: dict[str, dict] = {}
    todo = []
    for job, name in zip(jobs, names, strict=True):
        found = _done(store, plan, name)
        if found is not None:
            markers[name] = found
        else:
            todo.append((job, name))
    for (_, name), result in zip(todo, ordered(executor, fn, (job for job, _ in todo), window), strict=True):
        marker = {
            "plan": plan.name,
            "files": [asdict(info) for info in files(result)],
            "result": asdict(result),
        }
        store.write_json(_marker_rel(name), marker)  # after the job's files: the job is done
        markers[name] = marker
    return [markers[name] for name in names]


def _exact_stage(
    store: Store, executor, tasks: Tasks, plan: Plan, window: int
) -> tuple[RankedBits, RankedBits]:
    """The duplicate rows and the duplicate pids (with ranks), from the exact stage's partitions."""
    runs = tasks.runs("digests")
    names = [f"exact-{p:05d}" for p in range(plan.exact_partitions)]
    jobs = [
        ExactJob(out=store.url(), runs=runs, index=p, count=plan.exact_partitions, output=f"{MERGE}/{name}")
        for p, name in enumerate(names)
    ]
    markers = _stage(store, executor, plan, jobs, run_exact, names, lambda r: (r.rows, r.pids), window)
    rows, pids = RankedBits(ID_BASE, tasks.rows), RankedBits(ID_BASE, tasks.passing)
    for marker in markers:
        result = ExactResult(
            **{k: (RunInfo(**v) if isinstance(v, dict) else v) for k, v in marker["result"].items()}
        )
        rows.add(read_all(store, f"{MERGE}/{result.rows.name}", result.rows.bytes)[0])
        pids.add(read_all(store, f"{MERGE}/{result.pids.name}", result.pids.bytes)[0])
    return rows, pids.freeze()


def _check_sketches(check: tuple[str, str, str, int, str]) -> str:
    """A task's sketch file as a local path (copied here from S3), checked against task.json."""
    out, rel, local, size, digest = check
    store = open_output(out)
    if store.is_remote:
        store.download(rel, local)
    else:
        local = store.url(rel)
    if not os.path.exists(local) or os.path.getsize(local) != size or sketch_digest(local) != digest:
        raise DamagedFile(store.url(rel), "its size or checksum differs from task.json")
    return local


def _near_stage(
    store: Store, executor, tasks: Tasks, plan: Plan, near: NearDedupOptions, duplicates: RankedBits,
    scratch: str, window: int,
) -> list[dict]:  # fmt: skip
    bits_path = f"{scratch}/duplicate-pids.npy"
    duplicates.save(bits_path)
    checks = [
        (store.url(), f"{task_folder(i)}/{m.sketches.name}", f"{scratch}/sketches-{i:05d}.u8", m.sketches.bytes,
         m.sketches.xxh3)
        for i, m in enumerate(tasks.markers)
    ]  # fmt: skip
    paths = list(ordered(executor, _check_sketches, checks, window))
    sketches = tuple(
        SketchFile(path=path, pid_base=tasks.pid_bases[i], count=m.sketches.count)
        for i, (path, m) in enumerate(zip(paths, tasks.markers, strict=True))
    )
    runs = tasks.runs("keys")
    names = [f"near-{q:05d}" for q in range(plan.near_partitions)]
    jobs = [
        NearJob(out=store.url(), runs=runs, index=q, count=plan.near_partitions, output=f"{MERGE}/{name}",
                options=near, duplicates=bits_path, sketches=sketches, first_pid=ID_BASE, first_position=ID_BASE)
        for q, name in enumerate(names)
    ]  # fmt: skip
    return _stage(store, executor, plan, jobs, run_near, names, lambda r: (r.near,), window)


# --- the ordered pass -----------------------------------------------------------------------------


@dataclass(kw_only=True)
class PieceTokens:
    """The token frames of one piece that a chunk's documents from it lie in, and where each starts."""

    rel: str  # the piece's tokens file
    frame_bytes: np.ndarray  # byte offsets of the frames read, then the end of the last
    frame_sums: np.ndarray
    starts: np.ndarray  # each document's first token within those frames' tokens


@dataclass(kw_only=True)
class MergedChunk:
    """A chunk as a merge worker gets it: its documents as token frames and offsets."""

    split: str
    index: int
    fingerprint: str
    lengths: np.ndarray
    pieces: list[PieceTokens]
    dtype: str

    def gather(self) -> ChunkTokens:
        store, parts, at = current_store(), [], 0
        for piece in self.pieces:
            tokens = read_frames(store, piece.rel, piece.frame_bytes, piece.frame_sums, self.dtype)
            lengths = self.lengths[at : at + len(piece.starts)]
            at += len(piece.starts)
            gather = np.repeat(piece.starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(
                int(lengths.sum())
            )
            parts.append(tokens[gather])
        return gathered(self, parts, self.dtype)


def process_merged_chunk(chunk: MergedChunk) -> PartResult:
    return process_chunk(chunk.gather())


@dataclass(frozen=True)
class PieceJob:
    """A piece for a worker to read and sift (`sift_piece`)."""

    folder: str
    piece: TaskPiece
    first_row: int  # the piece's first row among all tasks' rows
    duplicates: str  # the saved RankedBits of the duplicate rows (a local file)


@dataclass(kw_only=True)
class PieceDocs:
    """What the ordered pass needs of a piece: its drop counts, and the rest of its rows only for
    the documents that reach near-duplicate removal (passing the filters, not exact duplicates)."""

    duplicates: int
    reason_counts: np.ndarray  # per filter reason code: rows dropped, and their tokens
    reason_tokens: np.ndarray
    among: np.ndarray  # each document's index among the piece's passing rows
    digests: bytes  # DIGEST_BYTES per document
    chars: np.ndarray
    lengths: np.ndarray
    token_starts: np.ndarray  # each document's first token in the piece's tokens
    first_keys: np.ndarray | None
    frame_rows: np.ndarray  # the token frames: their first passing row, then the count
    frame_bytes: np.ndarray
    frame_sums: np.ndarray
    frame_starts: np.ndarray  # each frame's first token in the piece's tokens


def sift_piece(job: PieceJob) -> PieceDocs:
    """In a worker: a piece's rows, read and checked (`read_piece_rows`), less the filtered rows and
    the exact duplicates, counted: what depends on one row alone is done here, beside the parts
    the workers write, so that the ordered pass handles only the documents it decides."""
    rows = read_piece_rows(current_store(), job.folder, job.piece)
    duplicate = RankedBits.load(job.duplicates).contains_range(job.first_row, len(rows.chars))
    is_passing = rows.reasons == 0
    filtered = np.flatnonzero(~(duplicate | is_passing))
    codes = rows.reasons[filtered].astype(np.intp)
    passing = np.flatnonzero(is_passing)
    among = np.flatnonzero(~duplicate[passing])
    indexed = passing[among]
    lengths = rows.lengths[passing]
    token_starts = np.cumsum(lengths) - lengths
    frames = rows.frame_rows[:-1]
    return PieceDocs(
        duplicates=int(np.count_nonzero(duplicate)),
        reason_counts=np.bincount(codes, minlength=len(REASONS) + 1),
        reason_tokens=np.bincount(codes, weights=rows.lengths[filtered], minlength=len(REASONS) + 1),
        among=among,
        digests=np.frombuffer(rows.digests, dtype=np.dtype((np.void, DIGEST_BYTES)))[indexed].tobytes(),
        chars=rows.chars[indexed], lengths=rows.lengths[indexed], token_starts=token_starts[among],
        first_keys=rows.first_keys[among] if rows.first_keys is not None else None,
        frame_rows=rows.frame_rows, frame_bytes=rows.frame_bytes, frame_sums=rows.frame_sums,
        frame_starts=token_starts[frames[frames < len(passing)]],
    )  # fmt: skip


@dataclass
class _OpenChunk(OpenChunk):
    pieces: list[PieceTokens] = field(default_factory=list)


@dataclass
class MergeReport:
    """What `Conversion.finish` reads of a selection, for the merge."""

    dropped_tokens: dict[str, int] = field(default_factory=dict)
    sample: PairSample | None = None
    near_index_bytes: int | None = None
    near_through_removed: int = 0


class OrderedPass:
    """The merge's main process (module docstring, step 5): rows in, chunk descriptors out."""

    def __init__(self, store: Store, conversion: Conversion, tasks: Tasks, duplicates: str,
                 near_outputs: list[dict], drops: DropCounts, texts: dict, bar, cursor_bytes: int) -> None:  # fmt: skip
        self.store, self.conversion, self.tasks, self.duplicates = store, conversion, tasks, duplicates
        self.options = conversion.options
        self.drops, self.texts, self.bar = drops, texts, bar
        near = self.options.near_dedup
        self.report = MergeReport(sample=PairSample() if near is not None else None)
        self.decisions = NearDecisions(near.rule, first=ID_BASE) if near is not None else None
        self.cursors = [
            RunCursor(
                RunFile(store, f"{MERGE}/{m['files'][0]['name']}", m["files"][0]["bytes"]), cursor_bytes
            )
            for m in near_outputs
        ]
        self.open = {split: _OpenChunk(index=0) for split in SPLITS}
        self.position = ID_BASE
        self.members: dict[int, np.ndarray] = {}  # per task: the positions its sample has texts for
        for task, position in texts:
            self.members.setdefault(task, []).append(position)
        self.members = {
            task: np.sort(np.array(found, dtype=np.int64)) for task, found in self.members.items()
        }

    def chunks(self, executor) -> Iterator[MergedChunk]:
        """The chunks in order. The pieces' rows are read, checked and decompressed by the workers,
        a few pieces ahead (`read_piece`), between the parts they write."""
        pieces = [
            (index, piece) for index, marker in enumerate(self.tasks.markers) for piece in marker.pieces
        ]
        at = {
            index: (self.tasks.row_bases[index], self.tasks.pid_bases[index])
            for index in range(len(self.tasks.markers))
        }
        firsts = []  # each piece's first row and first pid
        for index, piece in pieces:
            firsts.append(at[index])
            at[index] = (at[index][0] + piece.rows, at[index][1] + piece.passing)
        jobs = (
            PieceJob(folder=task_folder(index), piece=piece, first_row=row, duplicates=self.duplicates)
            for (index, piece), (row, _) in zip(pieces, firsts, strict=True)
        )
        read = ordered(executor, sift_piece, jobs, self.options.workers + 1)
        for (index, piece), (_, pid), docs in zip(pieces, firsts, read, strict=True):
            yield from self._piece(index, piece.name, docs, pid)
            self.bar.update()
        for split in SPLITS:
            if self.open[split].size:
                yield self._seal(split)

    def _drop(self, reason: str, count: int, tokens: int) -> None:
        self.drops.add(reason, count)
        self.report.dropped_tokens[reason] = self.report.dropped_tokens.get(reason, 0) + tokens

    def _piece(self, task: int, name: str, docs: PieceDocs, first_pid: int) -> Iterator[MergedChunk]:
        if docs.duplicates:
            self.drops.add("duplicate", docs.duplicates)
        for code in np.flatnonzero(docs.reason_counts).tolist():
            self._drop(REASONS[code - 1], int(docs.reason_counts[code]), int(docs.reason_tokens[code]))
        count = len(docs.lengths)
        first = self.position
        self.position += count
        match, estimate = self._near(first, count)
        if docs.first_keys is not None and count:
            self._sample(task, first_pid, docs, first, match, estimate)
        near = np.flatnonzero(match >= 0)
        if len(near):
            self._drop(_NEAR_DUPLICATE, len(near), int(docs.lengths[near].sum()))
        yield from self._route(task, name, docs, np.flatnonzero(match < 0))

    def _near(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Each indexed document's match and estimate (-1, 0: kept), decided by the rule from its
        close pairs in the stage's outputs."""
        if self.decisions is None:
            return np.full(count, -1, dtype=np.int64), np.zeros(count)
        found = [cursor.below(first + count) for cursor in self.cursors]
        later = np.concatenate([f[0] for f in found]).astype(np.int64)
        matches = np.concatenate([f[1] for f in found]).astype(np.int64)
        estimates = np.concatenate([f[2] for f in found]).view(np.float64)
        decided = self.decisions.decide(first, count, later, matches, estimates)
        self.report.near_through_removed = self.decisions.through_removed
        return decided

    def _sample(self, task, first_pid, docs: PieceDocs, first, match, estimate) -> None:
        sample = self.report.sample
        local = first_pid - self.tasks.pid_bases[task]  # the piece's first pid within its task
        positions = first + np.arange(len(docs.lengths))
        texts, among = self.texts, docs.among
        # Only the members of the tasks' samples have a text (the others could not join: a task's
        # sample holds every document of the merged one, `PairSample`); offering the rest, only to
        # have them refused, would cost a decision round each.
        members = self.members.get(task, np.empty(0, dtype=np.int64))
        known = np.flatnonzero(sorted_contains(members, local + among))
        if len(known):
            sample.offer_all(
                docs.first_keys[known], positions[known],
                lambda i: texts.get((task, local + int(among[known[i]]))),
            )  # fmt: skip
        near = np.flatnonzero(match >= 0)
        if len(near):
            sample.record_all(positions[near], match[near], estimate[near])

    def _route(self, task: int, name: str, docs: PieceDocs, kept: np.ndarray) -> Iterator[MergedChunk]:
        if not len(kept):
            return
        digests = np.frombuffer(docs.digests, dtype=np.dtype((np.void, DIGEST_BYTES)))[kept]
        is_val = in_val(digests.tobytes(), self.options.val_fraction)
        where = _Where(rel=f"{task_folder(task)}/{name}.tokens", docs=docs)
        for split, chosen in (("train", ~is_val), ("val", is_val)):
            if chosen.any():
                picked = kept[chosen]
                yield from self._add(split, where, picked, docs.lengths[picked], docs.chars[picked],
                                     digests[chosen])  # fmt: skip

    def _add(self, split, where, picked, lengths, chars, digests) -> Iterator[MergedChunk]:
        """Documents into the split's open chunk, sealed where `chunk_documents` seals one."""
        limit, at = self.options.chunk_chars, 0
        total = np.cumsum(chars)  # once per piece: each chunk a search in it
        while at < len(chars):
            chunk = self.open[split]
            before = int(total[at - 1]) if at else 0
            # the first document that brings the chunk to the limit closes it
            cut = int(total.searchsorted(limit - chunk.size + before, side="left"))
            take = min(cut + 1, len(chars)) - at
            part = slice(at, at + take)
            chunk.lengths.append(lengths[part])
            chunk.digests.append(digests[part].tobytes())
            chunk.pieces.append(where.tokens(picked[part]))
            chunk.size += int(total[at + take - 1]) - before
            at += take
            if chunk.size >= limit:
                yield self._seal(split)

    def _seal(self, split: str) -> MergedChunk:
        chunk = self.open[split]
        self.open[split] = _OpenChunk(index=chunk.index + 1)
        fingerprint, lengths = chunk.identity(self.options, self.conversion.tokenizer)
        return MergedChunk(
            split=split, index=chunk.index, fingerprint=fingerprint, lengths=lengths, pieces=chunk.pieces,
            dtype=self.options.dtype,
        )  # fmt: skip


@dataclass(kw_only=True)
class _Where:
    """A piece's tokens file and its frames, to name the frames a run of its documents lies in."""

    rel: str
    docs: PieceDocs

    def tokens(self, picked: np.ndarray) -> PieceTokens:
        """`picked`: indexes among the piece's documents, ascending."""
        docs = self.docs
        passing = docs.among[picked]
        first = int(np.searchsorted(docs.frame_rows, passing[0], side="right")) - 1
        last = int(np.searchsorted(docs.frame_rows, passing[-1], side="right")) - 1
        return PieceTokens(
            rel=self.rel, frame_bytes=docs.frame_bytes[first : last + 2],
            frame_sums=docs.frame_sums[first : last + 1],
            starts=docs.token_starts[picked] - docs.frame_starts[first],
        )  # fmt: skip


# --- the merge ------------------------------------------------------------------------------------


def merge_tasks(
    out: str, *, workers: int = 1, progress: bool = True, overwrite: bool = False, command: str = "",
    memory_budget: int = 0, partitions: tuple[int, int] | None = None,
) -> Summary:  # fmt: skip
    """Merge the finished tasks under OUT/tasks/ into the conversion one machine would have
    written to OUT; returns its summary. `partitions`: (exact, near) instead of the plan's."""
    store = open_output(out)
    markers = read_markers(store)
    try:
        return _merge(store, markers, workers=workers, progress=progress, overwrite=overwrite, command=command,
                      memory_budget=memory_budget, partitions=partitions)  # fmt: skip
    except DamagedFile as err:
        raise _named(store, markers, err) from None


def _named(store: Store, markers: list[TaskMarker], err: DamagedFile) -> ConvertError:
    """A damaged file as one line: whose it is and what to run again."""
    for index, marker in enumerate(markers):
        if err.url.startswith(store.url(task_folder(index)) + "/"):
            again = f" ({marker.command})" if marker.command else ""
            return ConvertError(
                f"task {index}'s file {err.url} is damaged ({err.reason}): run task {index} again{again}, then merge"
            )
    store.delete_tree(MERGE)
    return ConvertError(
        f"the merge's own file {err.url} is damaged ({err.reason}): its stages were removed; run the merge again"
    )


def _merge(store: Store, markers: list[TaskMarker], *, workers: int, progress: bool, overwrite: bool, command: str,
           memory_budget: int, partitions: tuple[int, int] | None) -> Summary:  # fmt: skip
    settings = markers[0].settings
    options = _options_from(
        settings, workers=workers, progress=progress, overwrite=overwrite, memory_budget=memory_budget
    )
    conversion = Conversion(tokenizer=store.url(task_folder(0)), out=store.url(), options=options)
    if conversion.tokenizer.sha256 != settings["tokenizer_sha256"]:
        raise ConvertError(
            f"the tokenizer in {store.url(task_folder(0))} does not match its task.json: run task 0 again"
        )
    conversion.prepare_output()
    _remove_stale_temporaries(store)
    start = time.monotonic()
    tasks = Tasks.of(markers)
    near = conversion.options.near_dedup
    budget = resolve_budget(memory_budget)
    plan = _adopt_plan(store, plan_stages(tasks, budget, workers, near is not None, partitions))
    print(
        describe_plan(store, tasks, plan, budget, workers, near.bins if near is not None else None)
        + f"; {describe_peak(budget, workers + 1)}",
        flush=True,
    )
    warning = budget_warning(budget, workers + 1)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    read = ReadOptions(**settings["read"])
    drops = read.cleaner().drops
    for marker in markers:  # what the tasks dropped before their rows
        for reason, count in marker.dropped_before_selection.items():
            drops.add(reason, count)
    texts = _sample_texts(store, markers) if near is not None else {}  # checked before the stages run
    scratch = make_scratch("merge")
    window = 2 * workers
    try:
        with start_workers(workers, _no_setup) as executor:
            stage_start = time.monotonic()
            duplicate_rows, duplicate_pids = _exact_stage(store, executor, tasks, plan, window)
            line = f"merge: exact duplicates in {time.monotonic() - stage_start:.1f} s"
            near_outputs = []
            if near is not None:
                stage_start = time.monotonic()
                near_outputs = _near_stage(
                    store, executor, tasks, plan, near, duplicate_pids, scratch, window
                )
                pairs = sum(marker["result"]["pairs"] for marker in near_outputs)
                line += (
                    f", near duplicates ({pairs:,} candidate pairs) in {time.monotonic() - stage_start:.1f} s"
                )
            print(line, flush=True)
        del duplicate_pids
        duplicates = f"{scratch}/duplicate-rows.npy"  # the workers sift the pieces with it
        duplicate_rows.freeze().save(duplicates)
        del duplicate_rows
        cursor_bytes = min(4 << 20, max(4 << 10, budget // (8 * max(1, len(near_outputs)))))
        total = sum(len(marker.pieces) for marker in markers)
        with progress_bar(total, "piece", "merging", enabled=progress) as bar:
            feed = OrderedPass(
                store, conversion, tasks, duplicates, near_outputs, drops, texts, bar, cursor_bytes
            )
            conversion.run(chunks=feed.chunks, process=process_merged_chunk, cleaner=read.worker_cleaner())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.stdout.flush()
    return conversion.finish(
        read=_merged_read(markers), dropped=drops.as_dict(), start=start, command=command or markers[0].command,
        selection=feed.report, tasks=len(markers),
    )  # fmt: skip


def _remove_stale_temporaries(store: Store) -> None:
    """The stage files a killed merge was writing (temporary files as large as a stage's output;
    its workers die with it) go, but not those of a live process: another merge of this output."""
    removed = store.remove_stale_temporaries(MERGE)
    if removed:
        print(
            f"merge: removed {len(removed)} temporary file(s) a killed run left under {store.url(MERGE)}",
            flush=True,
        )


def _no_setup() -> None:
    """The stage workers need no state (each job names its files)."""


def _sample_texts(
    store: Store, markers: list[TaskMarker]
) -> dict[tuple[int, int], str | tuple[str, str, int]]:
    texts = {}
    for index, marker in enumerate(markers):
        for member in read_sample(store, task_folder(index), marker.sample):
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
