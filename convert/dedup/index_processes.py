"""The exact and near-duplicate state of a conversion with many workers, held by index processes,
and the main process's side of talking to them without waiting on each batch.

With more workers than one process can decide for (`ShardOptions.index_processes`), the state is
split by value over P index processes: the digests (exact duplicates) by their first 8 bytes
modulo P, the LSH band keys (near duplicates, convert/dedup/near_dedup.py `candidates`) by key value
modulo P. Every rule is decided digest by digest or key by key, in input order, so each process
decides its share as the one index would, and the union of their answers is the one index's.

A worker splits each batch itself (`partition`): one bytes message per process, that the main
process forwards without reading. Per batch the main process then only sends and receives P
messages, all pipelined:

    main process                                     index process p (one thread reads, one decides)
    batch k's shares, with the mask of an        ->  exact: which of its digests came before
    earlier batch j whose duplicates are known       (rows of batch k); near, for batch j: look up
                                                     and insert its keys of the indexed documents,
                                                     verify the candidate pairs by the sketches
                                                 <-  batch k's duplicate rows; batch j's pairs
                                                     at or over the threshold (document, match,
                                                     estimate), every one
    the P answers' pairs decided in input order (convert/dedup/pairs.py `NearDecisions`)

A batch's near-duplicate step needs its exact decisions (only first-seen documents that pass the
filters are indexed, at consecutive positions), so it runs one round later, when the main
process sends which rows are indexed (the mask) and has appended their sketches to a file that
every index process maps. Up to `DEPTH` messages per process are unanswered, so the main process
never waits on a round trip while the index processes keep up; an index process that falls
behind finds several messages waiting and decides them as one batch (the same decisions, since
none depends on how documents are cut into batches). A thread reads each process's messages as
they come, so neither side can block the other with a full pipe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import shutil
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from convert.dedup.minhash import estimate_jaccard
from convert.dedup.near_dedup import BandIndex, candidates, distinct_pairs
from convert.dedup.options import NearDedupOptions
from convert.records import DIGEST_BYTES
from convert.scratch import make_scratch

DEPTH = 16  # messages to each index process that may wait for their answer
_DIGEST = np.dtype(f"S{DIGEST_BYTES}")


# --- the messages -------------------------------------------------------------------------------


def partition(
    digests: bytes | None, digest_rows: np.ndarray | None, keys: np.ndarray | None, parts: int
) -> list[bytes]:
    """One batch's share for each of `parts` index processes, as bytes: the digests of
    `digest_rows` (16 bytes each in `digests`) whose first 8 bytes are p modulo `parts`, with their
    rows, in row order; the band keys (passing rows x bands) whose value is p modulo `parts`, in
    ascending order (equal keys in row order, as `candidates` takes them: an index process then
    merges a few sorted runs instead of sorting), with each one's row among the passing rows.
    None: no exact (or no near) duplicates to decide."""
    if digests is not None and len(digest_rows):
        pairs = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)[digest_rows]
        d_order, d_bounds = _by_part(pairs[:, 0], parts)
        d_pairs, d_rows = pairs[d_order], digest_rows[d_order].astype(np.int64)
    else:
        d_bounds = np.zeros(parts + 1, dtype=np.int64)
        d_pairs, d_rows = np.empty((0, 2), "<u8"), np.empty(0, np.int64)
    if keys is not None and keys.size:
        flat = keys.ravel()
        by_key = np.argsort(flat, kind="stable")
        k_order, k_bounds = _by_part(flat[by_key], parts)
        k_order = by_key[k_order]
        k_keys, k_rows = flat[k_order], (k_order // keys.shape[1]).astype(np.int32)
    else:
        k_bounds = np.zeros(parts + 1, dtype=np.int64)
        k_keys, k_rows = np.empty(0, np.uint64), np.empty(0, np.int32)
    out = []
    for p in range(parts):
        d, k = slice(d_bounds[p], d_bounds[p + 1]), slice(k_bounds[p], k_bounds[p + 1])
        header = np.array([d.stop - d.start, k.stop - k.start], dtype=np.int64)
        out.append(b"".join((header.tobytes(), d_pairs[d].tobytes(), d_rows[d].tobytes(),
                             k_keys[k].tobytes(), k_rows[k].tobytes())))  # fmt: skip
    return out


def _by_part(values: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """An order of `values` by value modulo `parts` (stable), and each part's bounds in it."""
    part = (values % np.uint64(parts)).astype(np.int64)
    order = np.argsort(part, kind="stable")
    return order, np.searchsorted(part[order], np.arange(parts + 1))


def _unpack_share(blob: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(digests, their rows, keys, their rows among the passing rows) of one share."""
    nd, nk = np.frombuffer(blob, dtype=np.int64, count=2).tolist()
    at = 16
    digests = np.frombuffer(blob, dtype=_DIGEST, count=nd, offset=at)
    at += DIGEST_BYTES * nd
    digest_rows = np.frombuffer(blob, dtype=np.int64, count=nd, offset=at)
    at += 8 * nd
    keys = np.frombuffer(blob, dtype=np.uint64, count=nk, offset=at)
    at += 8 * nk
    return digests, digest_rows, keys, np.frombuffer(blob, dtype=np.int32, count=nk, offset=at)


# A message: its header (4 int64: has a share, the mask's bit count or -1, the mask's bytes, the
# share's bytes), the mask (np.packbits of the indexed rows among the passing rows), the share.
_HEADER = struct.Struct("<4q")
# An answer: two counts, the duplicate rows (int64), then per document with a near pair: its
# index among the batch's indexed documents (int64), the match's position (int64), the estimate.
_ANSWER = struct.Struct("<2q")
_STOP = b"stop"


@dataclass
class Answer:
    duplicates: np.ndarray  # rows of the message's batch whose digest came before
    # Every close pair (at or above the threshold) of the masked batch's documents found here:
    documents: np.ndarray  # by index among its indexed documents (a document may come again)
    matches: np.ndarray  # the earlier document's position
    estimates: np.ndarray


def _answer(
    duplicates: np.ndarray, documents: np.ndarray, matches: np.ndarray, estimates: np.ndarray
) -> bytes:
    parts = (_ANSWER.pack(len(duplicates), len(documents)), duplicates.astype(np.int64).tobytes(),
             documents.astype(np.int64).tobytes(), matches.astype(np.int64).tobytes(),
             estimates.astype(np.float64).tobytes())  # fmt: skip
    return b"".join(parts)


def _read_answer(data: bytes) -> Answer:
    nd, nn = _ANSWER.unpack_from(data)
    at = _ANSWER.size
    dup = np.frombuffer(data, dtype=np.int64, count=nd, offset=at)
    at += 8 * nd
    doc, match = (np.frombuffer(data, dtype=np.int64, count=nn, offset=at + 8 * nn * i) for i in range(2))
    est = np.frombuffer(data, dtype=np.float64, count=nn, offset=at + 16 * nn)
    return Answer(dup, doc, match, est)


def _send(fd: int, parts: list) -> None:
    """One message of `multiprocessing.Connection` framing (4-byte big-endian length) from
    several buffers, in one system call when the socket takes it all."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    views.insert(0, memoryview(struct.pack("!i", sum(len(v) for v in views))))
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


# --- the main process's side --------------------------------------------------------------------


class IndexProcesses:
    """P index processes (module docstring); forked when made: make this before any thread
    starts (the worker pool's). They end with the main process (even by SIGKILL) and at `close`.

    `send(share, mask)` and `receive()` are one message and its answer per process, in order;
    the caller keeps at most `DEPTH` unanswered (`Selection.select_all`)."""

    def __init__(self, parts: int, near: NearDedupOptions | None) -> None:
        import multiprocessing

        from convert.executor import die_with

        self.parts, self.near = parts, near
        self.folder = make_scratch("sketches")
        path = os.path.join(self.folder, "sketches.u8")
        self.sketch_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        context = multiprocessing.get_context("fork")
        self.connections, self.processes = [], []
        for _ in range(parts):
            mine, theirs = context.Pipe()
            args = (theirs, near, path, os.getpid(), die_with)
            process = context.Process(target=_serve, args=args, daemon=True)
            process.start()
            theirs.close()
            self.connections.append(mine)
            self.processes.append(process)
        self.index_bytes = 0  # the band indexes' bytes, known at `close`
        self.sketch_bytes = 0
        self.unanswered = 0  # messages sent and not answered yet
        self.cpu_s = [0.0] * parts  # each process's CPU seconds, known at `close`

    @property
    def nbytes(self) -> int:
        return self.index_bytes + self.sketch_bytes

    def append_sketches(self, sketches: np.ndarray) -> None:
        """Sketches of the next indexed documents, in order: before the mask that indexes them."""
        data = memoryview(np.ascontiguousarray(sketches)).cast("B")
        while len(data):
            data = data[os.write(self.sketch_fd, data) :]
        self.sketch_bytes += sketches.nbytes

    def send(self, shares: list[bytes] | None, mask: np.ndarray | None) -> None:
        """One message to every process: a batch's shares (or none) and the mask of the oldest
        batch whose indexed rows are known and not yet sent (or none)."""
        bits = np.packbits(mask).tobytes() if mask is not None else b""
        for p, connection in enumerate(self.connections):
            share = shares[p] if shares is not None else b""
            header = _HEADER.pack(
                shares is not None, len(mask) if mask is not None else -1, len(bits), len(share)
            )
            try:
                _send(connection.fileno(), [header, bits, share])
            except OSError:
                raise _died() from None
        self.unanswered += 1

    def receive(self) -> list[Answer]:
        """The answers to the oldest unanswered message, one per process."""
        try:
            answers = [_read_answer(connection.recv_bytes()) for connection in self.connections]
        except (EOFError, OSError):
            raise _died() from None
        self.unanswered -= 1
        return answers

    def close(self) -> None:
        """Stop the processes: they send their index's size and CPU time; after a failure, with
        answers still due, they are killed."""
        if self.sketch_fd < 0:
            return
        if self.unanswered:
            for process in self.processes:
                process.kill()
        else:
            for connection in self.connections:
                with contextlib.suppress(OSError):
                    connection.send_bytes(_STOP)
            for p, connection in enumerate(self.connections):
                with contextlib.suppress(EOFError, OSError):
                    index_bytes, cpu = struct.unpack("<qd", connection.recv_bytes())
                    self.index_bytes += index_bytes
                    self.cpu_s[p] = cpu
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.connections, self.processes = [], []
        os.close(self.sketch_fd)
        self.sketch_fd = -1
        shutil.rmtree(self.folder, ignore_errors=True)


def _died() -> RuntimeError:
    return RuntimeError("a de-duplication index process died (killed, e.g. for lack of memory)")


@dataclass
class _Batch:
    """A batch on its way through `pipelined`: the caller's item, then what is known of it."""

    item: object
    state: object = None  # what `decided` returned with the mask
    mask: np.ndarray | None = None  # its indexed rows among the passing rows
    answers: list[Answer] | None = None  # to the message that carried its mask


def pipelined(
    processes: IndexProcesses,
    items: Iterable,
    shares: Callable[[object], list[bytes]],
    decided: Callable[[object, np.ndarray], tuple[object, np.ndarray | None]],
    finished: Callable[[object, object, list[Answer] | None], object],
) -> Iterator:
    """Each item's batch through the index processes, results in input order, with up to `DEPTH`
    messages unanswered. Per item: `shares(item)` (one message per process, `partition`); then
    `decided(item, duplicate_rows)` once its exact duplicates are known, which returns a state
    and, with near duplicates, the mask of its indexed rows among the passing rows (their
    sketches appended); then `finished(item, state, answers)` once its near duplicates are known
    (answers None without near duplicates), which gives the result yielded."""
    unanswered: deque[tuple[_Batch | None, _Batch | None]] = deque()  # (batch sent, batch masked)
    to_mask: deque[_Batch] = deque()

    def receive() -> Iterator:
        sent, masked = unanswered.popleft()
        answers = processes.receive()
        if masked is not None:  # masks go in input order, so near decisions come back in it
            yield finished(masked.item, masked.state, answers)
        if sent is not None:
            sent.state, sent.mask = decided(sent.item, np.concatenate([a.duplicates for a in answers]))
            if sent.mask is None:  # exact duplicates only: answers come back in input order
                yield finished(sent.item, sent.state, None)
            else:
                to_mask.append(sent)

    def send(batch: _Batch | None) -> None:
        masked = to_mask.popleft() if to_mask else None
        processes.send(shares(batch.item) if batch is not None else None,
                       masked.mask if masked is not None else None)  # fmt: skip
        unanswered.append((batch, masked))

    for item in items:
        while len(unanswered) >= DEPTH:
            yield from receive()
        send(_Batch(item))
    while unanswered or to_mask:
        if to_mask and len(unanswered) < DEPTH:
            send(None)
        else:
            yield from receive()


# --- an index process ---------------------------------------------------------------------------


def _serve(connection, near: NearDedupOptions | None, path: str, parent: int, die_with) -> None:
    die_with(parent)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_into, args=(connection, inbox), daemon=True).start()
    state = _State(near, path)
    while True:
        messages = [inbox.get()]
        while len(messages) < DEPTH and not inbox.empty() and messages[-1] not in (_STOP, None):
            messages.append(inbox.get())
        stop = messages[-1] in (_STOP, None)
        if stop:
            messages.pop()
        for answer in state.decide(messages):
            connection.send_bytes(answer)
        if stop:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            with contextlib.suppress(OSError):
                connection.send_bytes(struct.pack("<qd", state.index.nbytes, usage.ru_utime + usage.ru_stime))
            return


def _read_into(connection, inbox: queue.SimpleQueue) -> None:
    """The reading thread: every message as it comes (None when the main process is gone)."""
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            inbox.put(None)
            return
        inbox.put(message)
        if message == _STOP:
            return


class _State:
    """One index process's share: the digests seen, the band index, the batches awaiting a mask."""

    def __init__(self, near: NearDedupOptions | None, path: str) -> None:
        self.near, self.path = near, path
        self.seen: set = set()
        self.index = BandIndex()
        self.waiting: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (keys, rows) per batch
        self.size = 0  # documents indexed so far: the next one's position

    def decide(self, messages: list[bytes]) -> list[bytes]:
        """Answers to `messages`, in order; their near-duplicate steps decided together."""
        duplicates, masks = [], []
        for message in messages:
            has_share, bits, mask_bytes, share_bytes = _HEADER.unpack_from(message)
            view = memoryview(message)[_HEADER.size :]
            mask = None
            if bits >= 0:
                mask = np.unpackbits(np.frombuffer(view[:mask_bytes], dtype=np.uint8), count=bits).astype(
                    bool
                )
            masks.append(mask)
            if not has_share:
                duplicates.append(np.empty(0, dtype=np.int64))
                continue
            digests, digest_rows, keys, key_rows = _unpack_share(view[mask_bytes : mask_bytes + share_bytes])
            duplicates.append(
                digest_rows[~first_seen_in(self.seen, digests)] if len(digests) else digest_rows[:0]
            )
            if self.near is not None:
                self.waiting.append((keys, key_rows))
        found = iter(self._near([m for m in masks if m is not None]))
        none = (np.empty(0, dtype=np.int64),) * 2 + (np.empty(0),)
        return [_answer(dup, *(next(found) if mask is not None else none))
                for dup, mask in zip(duplicates, masks, strict=True)]  # fmt: skip

    def _near(self, masks: list[np.ndarray]) -> list[tuple]:
        """The near-duplicate step of the oldest waiting batches, one per mask, as one batch:
        per batch, its documents with a pair at or over the threshold, their match and estimate."""
        if not masks:
            return []
        flat, doc, counts = [], [], []
        total = 0
        for mask in masks:
            keys, rows = self.waiting.popleft()
            document_of = np.cumsum(mask) - 1
            indexed = mask[rows]
            flat.append(keys[indexed])
            doc.append(document_of[rows[indexed]] + total)
            counts.append(int(mask.sum()))
            total += counts[-1]
        base, near = self.size, self.near
        later, before = candidates(self.index, np.concatenate(flat), np.concatenate(doc), base, near.per_key)
        later, before = distinct_pairs(later, before, base, total)
        scores = np.empty(len(later))
        if len(later):
            stored = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(base + total, near.bins))
            step = max(1, (1 << 24) // near.bins)
            for lo in range(0, len(later), step):
                hi = lo + step
                scores[lo:hi] = estimate_jaccard(stored[base + later[lo:hi]], stored[before[lo:hi]])
            del stored
        self.size += total
        close = scores >= near.threshold
        later, before, scores = later[close], before[close], scores[close]  # by later document
        out, start = [], 0
        for count in counts:
            lo, hi = np.searchsorted(later, [start, start + count])
            out.append((later[lo:hi] - start, before[lo:hi], scores[lo:hi]))
            start += count
        return out


def first_seen_in(seen: set, digests: np.ndarray) -> np.ndarray:
    """For each digest (numpy S16) in order: True when it is not in `seen` (and not earlier in
    `digests`); adds them. A batch without duplicates takes C-level set operations."""
    views = digests.tolist()  # items drop trailing zero bytes: one-to-one
    new = dict.fromkeys(views).keys() - seen
    if len(new) == len(views):
        seen |= new
        return np.ones(len(views), dtype=bool)
    return np.array([d not in seen and not seen.add(d) for d in views], dtype=bool)
