"""The conversion pipeline: chunks of documents -> workers (tokenize, pack, write a part) -> index.

    main process                              worker processes (N)
    read + clean + dedup (global)
    split by hash of the text (train/val)
    cut each split into chunks   ---------->  tokenize, pack into seq_len rows,
    (boundaries independent of N)             write the rows as MDS part-NNNNN/, done marker
                                 <----------  the chunk's tail (< seq_len tokens)
    pack the tails in chunk order into a final part (only the split's last partial row is lost)
    meta.json, summary.json, then each split's merged index.json LAST

Chunk boundaries depend only on the input, so the samples (and their order) are identical for
any worker count. Each part's `part.json` is written after its shards and names the chunk's
fingerprint; a re-run after a kill reuses the parts whose marker matches and redoes the rest.
Memory is bounded by a few chunks in flight, not the corpus.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from convert.errors import ConvertError
from convert.packing import Packer, StreamPiece, join_documents
from convert.tokenizer import TokenizerInfo, describe, load_processor
from convert.writer import ShardWriter, Store, index_json, prefixed_entries

SPLITS = ("train", "val")
FORMAT_NAME = "llm-pretrain-tokens"
FORMAT_VERSION = 1
_PIPELINE_VERSION = "1"  # part in every chunk fingerprint: bump when packing/writing changes
_ENCODE_BATCH_CHARS = 1 << 18  # tokenize in batches this big: SentencePiece's C++ loop, bounded lists
_CLEAN_BATCH_CHARS = 1 << 18  # texts per cleaning task: big enough to amortise the pickling


@dataclass(frozen=True)
class ShardOptions:
    seq_len: int = 512
    val_fraction: float = 0.01
    workers: int = 1
    add_bos: bool = False
    min_tokens: int = 20
    dtype: str = "auto"
    shard_size_mb: float = 64.0
    overwrite: bool = False
    chunk_chars: int = 1_000_000  # ~3 MB of Chinese UTF-8 per chunk
    progress: bool = True

    def validate(self) -> None:
        if self.seq_len < 2:
            raise ConvertError(f"--seq-len {self.seq_len} must be at least 2")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConvertError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if self.workers < 1:
            raise ConvertError(f"--workers {self.workers} must be at least 1")
        if self.min_tokens < 0:
            raise ConvertError(f"--min-tokens {self.min_tokens} must be 0 or more")
        if not 0 < self.shard_size_mb < 4096:
            raise ConvertError(f"--shard-size-mb {self.shard_size_mb} must be in (0, 4096)")
        if self.chunk_chars < 1:
            raise ConvertError(f"chunk size {self.chunk_chars} must be at least 1 character")

    @property
    def size_limit(self) -> int:
        return int(self.shard_size_mb * (1 << 20))


@dataclass
class Chunk:
    """A run of kept documents of one split: text to tokenize, or ids already tokenized."""

    split: str
    index: int
    texts: list[str] = field(default_factory=list)
    token_docs: list[np.ndarray] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list, repr=False)
    size: int = 0  # characters or tokens

    def add(self, doc: str | np.ndarray, digest: bytes) -> None:
        (self.texts if isinstance(doc, str) else self.token_docs).append(doc)
        self.digests.append(digest)
        self.size += len(doc)

    def seal(self, settings: str) -> str:
        """The chunk's fingerprint: its documents (by digest) and the run's settings."""
        fingerprint = hashlib.blake2b(b"".join(self.digests) + settings.encode(), digest_size=16).hexdigest()
        self.digests = []  # not needed by the worker
        return fingerprint


@dataclass
class PartResult:
    split: str
    index: int
    shards: list[dict]
    samples: int
    documents: int
    too_short: int
    tail: np.ndarray
    reused: bool = False


@dataclass
class WorkerConfig:
    """Everything a worker needs; sent once per worker process."""

    model_bytes: bytes
    out: str
    seq_len: int
    dtype: str
    size_limit: int
    eos_id: int
    bos_id: int | None
    min_tokens: int
    normalization: str = "NFKC"
    min_chars: int = 1


def digest_of(doc: str | np.ndarray) -> bytes:
    """16-byte BLAKE2b of a document: its identity for de-duplication, split and fingerprints."""
    data = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc.tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """train or val from the document's digest: stable across runs, machines and worker counts."""
    return "val" if int.from_bytes(digest[8:], "little") / 2**64 < val_fraction else "train"


def chunk_documents(
    docs: Iterable[tuple[str | np.ndarray, bytes]], *, val_fraction: float, chunk_size: int
) -> Iterator[Chunk]:
    """Route (document, digest) pairs to their split; cut each split's stream into ~chunk_size chunks."""
    open_chunks = {split: Chunk(split, 0) for split in SPLITS}
    for doc, digest in docs:
        chunk = open_chunks[split_of(digest, val_fraction)]
        chunk.add(doc, digest)
        if chunk.size >= chunk_size:
            yield chunk
            open_chunks[chunk.split] = Chunk(chunk.split, chunk.index + 1)
    for chunk in open_chunks.values():
        if chunk.size:
            yield chunk


def clean_in_workers(
    executor: Executor, texts: Iterable[str], *, dedup: bool, drops, window: int
) -> Iterator[tuple[str, bytes]]:
    """Workers clean batches of texts (Unicode normalisation is costly); de-duplication stays here,
    global and in input order, so the kept documents do not depend on the worker count."""
    seen: set[bytes] = set()
    for kept, batch_drops in ordered(executor, clean_batch, _batches(texts, _CLEAN_BATCH_CHARS), window):
        for reason, count in batch_drops.items():
            drops.add(reason, count)
        for text, digest in kept:
            if dedup:
                if digest in seen:
                    drops.add("duplicate")
                    continue
                seen.add(digest)
            yield text, digest


def _batches(texts: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- executing tasks in order ------------------------------------------------------------------


class _Done:
    """A result computed already (a part reused from an interrupted run)."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


class Executor:
    """Runs tasks in a pool of spawned worker processes."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def submit(self, fn, arg):
        return _Pending(self.pool.submit(fn, arg))


class _Pending:
    """A submitted task; `get()` returns its result or says clearly that a worker died."""

    def __init__(self, future) -> None:
        self.future = future

    def get(self):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return self.future.result()
        except BrokenProcessPool:
            raise ConvertError(
                "a conversion worker process died (killed, e.g. for lack of memory); nothing was "
                "marked complete: re-run the same command to continue (finished parts are reused), "
                "with fewer --workers if memory is short"
            ) from None


@contextmanager
def start_workers(workers: int, config: WorkerConfig) -> Iterator[Executor]:
    """A pool of `workers` processes, started once for the whole run (start-up costs ~0.3-1 s).

    Even one worker is its own process: the main process reads, de-duplicates and hands out
    work on another core, so `--workers N` means N cores of cleaning and tokenizing.
    Workers import only numpy, sentencepiece and this package's light modules. A worker that
    dies breaks the pool at once (concurrent.futures), so the run stops with a clear error
    instead of waiting forever.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # no inherited threads, locks or S3 clients
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker, initargs=(config,))
    try:
        yield Executor(pool)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def ordered(executor: Executor, fn, items: Iterable, window: int, shortcut=None) -> Iterator:
    """fn(item) for each item, results in input order, at most `window` in flight (bounded memory).

    `shortcut(item)` may return a ready result, skipping the task (resumed parts).
    """
    pending: deque = deque()
    for item in items:
        ready = shortcut(item) if shortcut else None
        pending.append(_Done(ready) if ready is not None else executor.submit(fn, item))
        while len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# --- worker side -------------------------------------------------------------------------------

_worker: dict = {}


def init_worker(config: WorkerConfig) -> None:
    from convert.cleaning import Cleaner

    _worker["config"] = config
    _worker["processor"] = load_processor(config.model_bytes)
    _worker["store"] = Store.open(config.out)
    _worker["cleaner"] = Cleaner(normalization=config.normalization, min_chars=config.min_chars, dedup=False)


def clean_batch(texts: list[str]) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """Cleaned (text, digest) of the kept texts, and the drop counts of this batch."""
    from convert.cleaning import DropCounts

    cleaner = _worker["cleaner"]
    cleaner.drops = DropCounts()
    kept = []
    for text in texts:
        cleaned = cleaner.clean(text)
        if cleaned is not None:
            kept.append((cleaned, digest_of(cleaned)))
    return kept, cleaner.drops.as_dict()


def process_chunk(task: tuple[Chunk, str]) -> PartResult:
    """Tokenize and pack one chunk, write its full rows as a part; return the tail."""
    chunk, fingerprint = task
    config: WorkerConfig = _worker["config"]
    store: Store = _worker["store"]
    folder = f"{chunk.split}/{part_name(chunk.index)}"
    store.delete_tree(folder)  # leftovers of a killed run must not mix with the new shards
    writer = ShardWriter(
        store, folder, seq_len=config.seq_len, dtype=config.dtype, size_limit=config.size_limit
    )
    packer = Packer(config.seq_len)
    kept = too_short = 0
    for piece in _stream_pieces(chunk, config):
        kept, too_short = kept + piece.kept, too_short + piece.too_short
        writer.write(packer.add(piece.tokens))
    shards = writer.finish()
    result = PartResult(chunk.split, chunk.index, shards, writer.samples, kept, too_short, packer.tail)
    store.write_json(f"{folder}/part.json", _marker(result, fingerprint))  # last: the part is done
    return result


def _stream_pieces(chunk: Chunk, config: WorkerConfig) -> Iterator[StreamPiece]:
    if chunk.token_docs:
        yield _join_arrays(chunk.token_docs, config)
        return
    processor = _worker["processor"]
    for batch in _batches(chunk.texts, _ENCODE_BATCH_CHARS):
        ids = processor.encode(batch, num_threads=1)  # one core per worker: N workers = N cores
        yield join_documents(ids, eos_id=config.eos_id, bos_id=config.bos_id, min_tokens=config.min_tokens)


def _join_arrays(docs: list[np.ndarray], config: WorkerConfig) -> StreamPiece:
    extra = 1 if config.bos_id is None else 2
    kept = [doc for doc in docs if len(doc) + extra >= config.min_tokens]
    eos = np.array([config.eos_id], dtype=np.uint32)
    bos = [] if config.bos_id is None else [np.array([config.bos_id], dtype=np.uint32)]
    parts = [part for doc in kept for part in (*bos, doc.astype(np.uint32), eos)]
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
    return StreamPiece(tokens=tokens, kept=len(kept), too_short=len(docs) - len(kept))


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def _marker(result: PartResult, fingerprint: str) -> dict:
    return {
        "fingerprint": fingerprint,
        "shards": result.shards,
        "samples": result.samples,
        "documents": result.documents,
        "too_short": result.too_short,
        "tail": result.tail.tolist(),
    }


def reuse_part(store: Store, chunk: Chunk, fingerprint: str) -> PartResult | None:
    """The finished part of an earlier run for this exact chunk, if all its shards are stored."""
    folder = f"{chunk.split}/{part_name(chunk.index)}"
    marker = store.read_json(f"{folder}/part.json")
    if not marker or marker.get("fingerprint") != fingerprint:
        return None
    for shard in marker["shards"]:
        if store.size(f"{folder}/{shard['zip_data']['basename']}") != shard["zip_data"]["bytes"]:
            return None
    tail = np.array(marker["tail"], dtype=np.uint32)
    return PartResult(
        chunk.split, chunk.index, marker["shards"], marker["samples"], marker["documents"],
        marker["too_short"], tail, reused=True,
    )  # fmt: skip


# --- main process ------------------------------------------------------------------------------


@dataclass
class SplitTotals:
    parts: list[PartResult] = field(default_factory=list)
    shards: list[dict] = field(default_factory=list)
    samples: int = 0
    documents: int = 0
    too_short: int = 0
    lost_tail_tokens: int = 0


class Conversion:
    """One run: prepares the output, farms chunks out, then writes tails, meta and indexes."""

    def __init__(
        self,
        *,
        model_bytes: bytes,
        tokenizer: TokenizerInfo,
        out: str,
        options: ShardOptions,
        normalization: str = "NFKC",
        min_chars: int = 1,
    ):
        options.validate()
        self.options = options
        self.tokenizer = tokenizer
        self.dtype = tokenizer.token_dtype(options.dtype)
        self.store = Store.open(out)
        self.bos_id = tokenizer.bos_id if options.add_bos else None
        if options.add_bos and tokenizer.bos_id < 0:
            raise ConvertError(f"--bos: tokenizer {tokenizer.path} has no BOS piece; drop --bos")
        self.config = WorkerConfig(
            model_bytes, out, options.seq_len, self.dtype, options.size_limit,
            tokenizer.eos_id, self.bos_id, options.min_tokens, normalization, min_chars,
        )  # fmt: skip
        self.settings = "|".join(
            map(str, (_PIPELINE_VERSION, tokenizer.sha256, options.seq_len, self.dtype,
                      options.size_limit, self.bos_id, options.min_tokens))
        )  # fmt: skip
        self.totals = {split: SplitTotals() for split in SPLITS}
        self.reused_parts = 0

    def prepare_output(self) -> None:
        """Refuse a complete output (unless overwrite); make an incomplete one resumable."""
        store = self.store
        store.check_writable()
        complete = all(store.exists(f"{split}/index.json") for split in SPLITS)
        if complete and not self.options.overwrite:
            raise ConvertError(
                f"{store.url()} already holds a complete conversion (train/ and val/ index.json); "
                "pass --overwrite to replace it, or choose another --out"
            )
        if self.options.overwrite:
            for rel in (*SPLITS, "summary.json"):
                store.delete_tree(rel)
        for split in SPLITS:
            # An interrupted run may have finished one split; it is redone with the other.
            store.delete_tree(f"{split}/index.json")

    def run(self, documents: Callable[[Executor], Iterable[tuple[str | np.ndarray, bytes]]]) -> None:
        """Convert the (document, digest) pairs that `documents(executor)` yields."""
        window = 2 * self.options.workers
        with start_workers(self.options.workers, self.config) as executor:
            chunks = chunk_documents(
                documents(executor),
                val_fraction=self.options.val_fraction,
                chunk_size=self.options.chunk_chars,
            )
            tasks = ((chunk, chunk.seal(self.settings)) for chunk in chunks)
            for result in ordered(executor, process_chunk, tasks, window, shortcut=self._reusable):
                self.totals[result.split].parts.append(result)
                self.reused_parts += result.reused
        for split in SPLITS:
            self._finish_split(split)

    def _reusable(self, task: tuple[Chunk, str]) -> PartResult | None:
        return reuse_part(self.store, *task)

    def _finish_split(self, split: str) -> None:
        """Pack the parts' tails, in chunk order, into one last part; collect the shard list."""
        totals = self.totals[split]
        totals.parts.sort(key=lambda part: part.index)
        packer = Packer(self.options.seq_len)
        tail_index = len(totals.parts)
        folder = f"{split}/{part_name(tail_index)}"
        self.store.delete_tree(folder)
        writer = ShardWriter(
            self.store,
            folder,
            seq_len=self.options.seq_len,
            dtype=self.dtype,
            size_limit=self.options.size_limit,
        )
        for part in totals.parts:
            writer.write(packer.add(part.tail))
        tail_shards = writer.finish()
        self._remove_stale_parts(split, keep=tail_index + (1 if tail_shards else 0))
        for part in totals.parts:
            totals.shards += prefixed_entries(part.shards, part_name(part.index))
            totals.samples += part.samples
            totals.documents += part.documents
            totals.too_short += part.too_short
        totals.shards += prefixed_entries(tail_shards, part_name(tail_index))
        totals.samples += writer.samples
        totals.lost_tail_tokens = len(packer.tail)

    def _remove_stale_parts(self, split: str, keep: int) -> None:
        """Parts numbered past this run's last one come from an earlier, different run."""
        for name in self.store.list_dirs(split):
            if name.startswith("part-") and name[5:].isdigit() and int(name[5:]) >= keep:
                self.store.delete_tree(f"{split}/{name}")

    def write_meta(self, split: str, dropped: dict[str, int], command: str) -> dict:
        totals = self.totals[split]
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "split": split,
            "seq_len": self.options.seq_len,
            "dtype": self.dtype,
            "vocab_size": self.tokenizer.vocab_size,
            "eos_id": self.tokenizer.eos_id,
            "bos_id": self.tokenizer.bos_id,
            "add_bos": self.options.add_bos,
            "tokenizer_sha256": self.tokenizer.sha256,
            "num_samples": totals.samples,
            "num_tokens": totals.samples * self.options.seq_len,
            "num_documents": totals.documents,
            "dropped": {**dropped, "too_short_tokens": totals.too_short},
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command,
        }
        self.store.write_json(f"{split}/meta.json", meta)
        return meta

    def write_indexes(self) -> None:
        """Last step: each split's merged index.json; its presence marks the split complete."""
        for split in ("val", "train"):
            self.store.write_json(f"{split}/index.json", index_json(self.totals[split].shards))


def open_tokenizer(path: str) -> tuple[bytes, TokenizerInfo]:
    from convert.tokenizer import read_model_bytes

    model_bytes = read_model_bytes(path)
    return model_bytes, describe(model_bytes, path)


def default_workers() -> int:
    return os.cpu_count() or 1


def progress_bar(total: int | None, unit: str, desc: str, *, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=True,
        desc=desc,
        file=sys.stderr,
        mininterval=0.5,
        disable=not enabled,
    )
