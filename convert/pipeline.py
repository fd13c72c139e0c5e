"""The conversion pipeline: texts -> workers (clean, tokenize) -> de-duplicate, split, chunk
-> workers (pack, write a part) -> index.

    main process                                worker processes (N)
    read documents, cut into batches  --------> clean* and digest each text, tokenize (EOS added)
                                      <-------- digests, lengths and one token array per batch
    global de-duplication by digest, in input order
    (* here instead, de-duplicating before tokenizing, and ** too, when there are more CPUs than workers)
    split by digest (train/val), cut each split into chunks (boundaries independent of N)
                                      --------> drop too-short documents, pack into seq_len rows,**
                                                write the rows as MDS part-NNNNN/, done marker
                                      <-------- the chunk's tail (< seq_len tokens)
    pack the tails in chunk order into a final part (only the split's last partial row is lost)
    meta.json, summary.json, then each split's merged index.json LAST

Where the work runs: with fewer workers than CPUs the main process has a core to spare: it
cleans, de-duplicates and sends only kept, cleaned texts, and packs and writes the parts itself
(the workers just tokenize); otherwise the workers clean and write too, and a duplicate is tokenized before the main process sees that it is
one (a little waste on duplicate-heavy corpora). Either way text crosses to a worker once, what
comes back is compact (16-byte digests, token arrays), and de-duplication is global and in
input order, so the kept documents do not depend on the worker count or the placement. Chunk
boundaries depend only on the input, so the samples (and their order) are identical for any
worker count. Each part's `part.json` is written after its shards and names the chunk's
fingerprint; a re-run after a kill reads and tokenizes the input again (to rebuild the
de-duplication set and the chunks) but reuses the parts whose marker matches instead of
writing them again. Memory is bounded by a few batches and chunks in flight, not the corpus.
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
from typing import NamedTuple

import numpy as np
import xxhash

from convert.cleaning import Cleaner, text_digest
from convert.errors import ConvertError
from convert.packing import TOKEN_DTYPE, Packer, concat_documents, drop_short_documents
from convert.tokenizer import TokenizerInfo, describe, load_processor
from convert.writer import ShardWriter, Store, index_json, prefixed_entries

SPLITS = ("train", "val")
FORMAT_NAME = "llm-pretrain-tokens"
FORMAT_VERSION = 1
_PIPELINE_VERSION = "2"  # part in every chunk fingerprint: bump when packing/writing changes
_BATCH_CHARS = 1 << 18  # texts per tokenizing task: amortises the hand-off, bounds the lists
DIGEST_BYTES = 16


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
    # The main process cleans the texts and writes the parts itself (the workers only tokenize)
    # when it has a core to spare; None: when there are more CPUs than workers.
    main_works: bool | None = None

    @property
    def main_helps(self) -> bool:
        if self.main_works is not None:
            return self.main_works
        return self.workers < available_cpus()

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


class Doc(NamedTuple):
    """One kept document on its way into a chunk: its tokens end with EOS (BOS first if asked)."""

    digest: bytes
    size: int  # characters of cleaned text (token count for imported token files)
    tokens: np.ndarray
    split: str


@dataclass
class Chunk:
    """A run of kept documents of one split, tokenized, on their way to becoming one part."""

    split: str
    index: int
    pieces: list[np.ndarray] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list, repr=False)
    size: int = 0  # characters (or tokens) of its documents

    def add(self, doc: Doc) -> None:
        self.pieces.append(doc.tokens)
        self.digests.append(doc.digest)
        self.size += doc.size

    def seal(self, settings: str) -> tuple[str, ChunkTokens]:
        """The chunk's fingerprint (its documents by digest, and the run's settings) and the
        compact form that a worker gets."""
        fingerprint = hashlib.blake2b(b"".join(self.digests) + settings.encode(), digest_size=16).hexdigest()
        lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
        tokens = np.concatenate(self.pieces) if self.pieces else np.empty(0, dtype=TOKEN_DTYPE)
        return fingerprint, ChunkTokens(self.split, self.index, tokens, lengths)


@dataclass
class ChunkTokens:
    """A sealed chunk as a worker gets it: one token array and the documents' lengths."""

    split: str
    index: int
    tokens: np.ndarray
    lengths: np.ndarray


@dataclass
class TokenizedBatch:
    """What a worker returns for a batch of texts: the documents that survived cleaning."""

    digests: bytes  # DIGEST_BYTES per document
    chars: np.ndarray  # cleaned length in characters, per document
    lengths: np.ndarray  # tokens per document, EOS (and BOS) included
    tokens: np.ndarray  # all documents' tokens, one after another
    drops: dict[str, int]

    def documents(self, val_fraction: float) -> Iterator[Doc]:
        """The documents, in order, with their split. A val document's tokens are a copy: val
        chunks fill slowly, and a view would keep the whole batch's array in memory."""
        ends = np.cumsum(self.lengths).tolist()
        starts = [0, *ends[:-1]] if ends else []  # a batch may keep no document at all
        digests = [self.digests[i : i + DIGEST_BYTES] for i in range(0, len(self.digests), DIGEST_BYTES)]
        # split_of for the whole batch at once: the digest's upper 8 bytes as a fraction of 2**64
        upper = np.frombuffer(self.digests, dtype="<u8")[1::2]
        is_val = (upper / 2.0**64 < val_fraction).tolist()
        tokens = self.tokens
        for digest, start, end, chars, val in zip(
            digests, starts, ends, self.chars.tolist(), is_val, strict=True
        ):
            piece = tokens[start:end]
            yield Doc(digest, chars, piece.copy() if val else piece, "val" if val else "train")


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
    """A document's 16-byte identity: `text_digest` of a text, XXH3-128 of a token array's bytes."""
    return text_digest(doc) if isinstance(doc, str) else xxhash.xxh3_128_digest(doc.tobytes())


def split_of(digest: bytes, val_fraction: float) -> str:
    """train or val from the document's digest: stable across runs, machines and worker counts."""
    return "val" if int.from_bytes(digest[8:], "little") / 2**64 < val_fraction else "train"


def chunk_documents(docs: Iterable[Doc], *, chunk_size: int) -> Iterator[Chunk]:
    """Route documents to their split; cut each split's stream into ~chunk_size chunks."""
    open_chunks = {split: Chunk(split, 0) for split in SPLITS}
    for doc in docs:
        chunk = open_chunks[doc.split]
        chunk.add(doc)
        if chunk.size >= chunk_size:
            yield chunk
            open_chunks[chunk.split] = Chunk(chunk.split, chunk.index + 1)
    for chunk in open_chunks.values():
        if chunk.size:
            yield chunk


@dataclass
class TextBatch:
    """Texts for a worker to tokenize. With digests, they are cleaned and de-duplicated already."""

    texts: list[str]
    digests: bytes | None = None


def tokenize_in_workers(
    executor: Executor,
    texts: Iterable[str],
    *,
    cleaner: Cleaner,
    val_fraction: float,
    window: int,
    clean_here: bool,
) -> Iterator[Doc]:
    """Tokenized documents, in input order, without duplicates; drops are counted in `cleaner.drops`.

    Cleaning (Unicode normalisation is the costly part) runs in the workers, or here when
    `clean_here`: with fewer workers than cores this process has a core of its own, and
    cleaning here leaves the workers only the tokenizing. Either way `cleaner` de-duplicates
    (if it is set to), globally and in input order, so the kept documents do not depend on the
    worker count or placement.
    """
    batches: Iterable[TextBatch]
    if clean_here:
        batches = (_clean(batch, cleaner) for batch in _batches(texts, _BATCH_CHARS))
    else:
        batches = map(TextBatch, _batches(texts, _BATCH_CHARS))
    for batch in ordered(executor, tokenize_batch, batches, window):
        for reason, count in batch.drops.items():
            cleaner.drops.add(reason, count)
        for doc in batch.documents(val_fraction):
            if clean_here or cleaner.first_seen(doc.digest):  # cleaned here: de-duplicated already
                yield doc


def _clean(texts: list[str], cleaner: Cleaner) -> TextBatch:
    kept = [k for k in map(cleaner.clean_with_digest, texts) if k is not None]
    return TextBatch([text for text, _ in kept], b"".join(digest for _, digest in kept))


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
    """Runs tasks in a pool of worker processes; a dead worker becomes one clear ConvertError."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def submit(self, fn, arg):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return _Pending(self.pool.submit(fn, arg))
        except BrokenProcessPool:  # a worker died while this process was busy elsewhere
            raise _worker_died() from None


class _Pending:
    """A submitted task; `get()` returns its result or says clearly that a worker died."""

    def __init__(self, future) -> None:
        self.future = future

    def get(self):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return self.future.result()
        except BrokenProcessPool:
            raise _worker_died() from None


def _worker_died() -> ConvertError:
    return ConvertError(
        "a conversion worker process died (killed, e.g. for lack of memory); nothing was "
        "marked complete: re-run the same command to continue (finished parts are reused), "
        "with fewer --workers if memory is short"
    )


# fork: a worker is ready in milliseconds with numpy, SentencePiece and this package already
# imported (spawn takes ~0.4 s per worker). The main process starts no threads before the pool
# (progress bars run without tqdm's monitor thread) and S3 clients are per process id. Where
# fork is not the safe default (macOS, Windows) workers are spawned.
_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


@contextmanager
def start_workers(workers: int, config: WorkerConfig) -> Iterator[Executor]:
    """A pool of `workers` processes, started once for the whole run.

    Even one worker is its own process: the main process reads, de-duplicates and hands out
    work on another core, so `--workers N` means N cores of tokenizing (and cleaning, unless
    the main process has a core to spare for it). Spawned workers import only numpy,
    sentencepiece and this package's light modules. A worker that dies breaks the pool at once
    (concurrent.futures), so the run stops with a clear error instead of waiting forever.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context(_START_METHOD)
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=init_worker, initargs=(config, os.getpid())
    )
    try:
        yield Executor(pool)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def ordered(executor: Executor | None, fn, items: Iterable, window: int, shortcut=None) -> Iterator:
    """fn(item) for each item, results in input order, at most `window` in flight (bounded memory).

    `shortcut(item)` may return a ready result, skipping the task (resumed parts). Without an
    executor each task runs here, at once.
    """
    pending: deque = deque()
    for item in items:
        ready = shortcut(item) if shortcut else None
        if ready is None and executor is None:
            ready = fn(item)
        pending.append(_Done(ready) if ready is not None else executor.submit(fn, item))
        while len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# --- worker side -------------------------------------------------------------------------------

_worker: dict = {}


def init_worker(config: WorkerConfig, parent: int | None = None) -> None:
    if parent is not None and _START_METHOD == "fork":
        _die_with(parent)
    init_writer(config)
    _worker["processor"] = load_processor(config.model_bytes)
    _worker["cleaner"] = Cleaner(normalization=config.normalization, min_chars=config.min_chars, dedup=False)


def _die_with(parent: int) -> None:
    """Make this forked worker end when the main process does, even by SIGKILL.

    A forked worker holds copies of the pool's pipe ends, so it never reads end-of-file when
    its parent is killed and would wait forever; Linux's parent-death signal ends it instead.
    """
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux after all
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def init_writer(config: WorkerConfig) -> None:
    """What `process_chunk` needs; the main process calls this when it writes parts itself."""
    _worker["config"] = config
    _worker["store"] = Store.open(config.out)


def tokenize_batch(batch: TextBatch) -> TokenizedBatch:
    """Clean the texts (unless done already), then tokenize them into one array, each document
    ended by EOS."""
    from convert.cleaning import DropCounts

    config: WorkerConfig = _worker["config"]
    cleaner = _worker["cleaner"]
    cleaner.drops = DropCounts()
    if batch.digests is None:
        cleaned = [k for k in map(cleaner.clean_with_digest, batch.texts) if k is not None]
        kept, digests = [text for text, _ in cleaned], b"".join(digest for _, digest in cleaned)
    else:
        kept, digests = batch.texts, batch.digests
    # One core per worker (N workers = N cores); SentencePiece adds EOS (and BOS) in C++.
    ids = _worker["processor"].encode(kept, add_bos=config.bos_id is not None, add_eos=True, num_threads=1)
    tokens, lengths = concat_documents(ids)
    chars = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
    return TokenizedBatch(digests, chars, lengths, tokens, cleaner.drops.as_dict())


def process_chunk(task: tuple[ChunkTokens, str]) -> PartResult:
    """Drop too-short documents, pack the chunk into rows, write them as a part; return the tail."""
    chunk, fingerprint = task
    config: WorkerConfig = _worker["config"]
    store: Store = _worker["store"]
    folder = f"{chunk.split}/{part_name(chunk.index)}"
    store.delete_tree(folder)  # leftovers of a killed run must not mix with the new shards
    tokens, kept = drop_short_documents(chunk.tokens, chunk.lengths, config.min_tokens)
    writer = ShardWriter(
        store, folder, seq_len=config.seq_len, dtype=config.dtype, size_limit=config.size_limit
    )
    packer = Packer(config.seq_len)
    writer.write(packer.add(tokens))
    shards = writer.finish()
    too_short = len(chunk.lengths) - kept
    result = PartResult(chunk.split, chunk.index, shards, writer.samples, kept, too_short, packer.tail)
    store.write_json(f"{folder}/part.json", _marker(result, fingerprint))  # last: the part is done
    return result


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


def reuse_part(store: Store, chunk: ChunkTokens, fingerprint: str) -> PartResult | None:
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


def _task(chunk: Chunk, settings: str) -> tuple[ChunkTokens, str]:
    fingerprint, tokens = chunk.seal(settings)
    return tokens, fingerprint


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

    def run(self, documents: Callable[[Executor], Iterable[Doc]], *, write_here: bool = False) -> None:
        """Convert the documents that `documents(executor)` yields, in order; with `write_here`
        this process packs and writes the parts, not the workers."""
        window = 2 * self.options.workers
        if write_here:
            init_writer(self.config)  # before the workers are forked: they replace it with their own
        with start_workers(self.options.workers, self.config) as executor:
            chunks = chunk_documents(documents(executor), chunk_size=self.options.chunk_chars)
            tasks = (_task(chunk, self.settings) for chunk in chunks)
            parts = None if write_here else executor
            for result in ordered(parts, process_chunk, tasks, window, shortcut=self._reusable):
                self.totals[result.split].parts.append(result)
                self.reused_parts += result.reused
        for split in SPLITS:
            self._finish_split(split)

    def _reusable(self, task: tuple[ChunkTokens, str]) -> PartResult | None:
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


def available_cpus() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    return available_cpus()


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
