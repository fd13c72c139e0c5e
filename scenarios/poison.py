"""A token split with crawl garbage in known batches: the guard's poisoned-data scenario.

Web crawls hold documents that are not text: base64 blobs (images and binaries inlined in pages)
and byte soup (binary files, or text in one encoding read as another). `garbage_documents` makes
such documents, deterministically. `write_poisoned_split` tokenizes documents of real text with
the split's tokenizer, packs them as `python -m convert shards` does (each document followed by
EOS, the token stream cut into samples; shards/FORMAT.md), puts these samples in a seeded random
order (as a shuffled run reads them), and puts samples of garbage, tokenized the same way, into the
window of batches [a, b) (data.skip's numbering: the batches after the first `a`, up to batch
`b`), `per_batch` in each. It writes the split with the shards' own writer
(`shards.writer.write_token_split`), not the converter: the converter's quality filters exist to
drop such documents, and the scenario needs them kept at known places. Trained with
`data.shuffle: false` on one rank, batch `k` holds samples `(k - 1) * B` to `k * B - 1`.

Used by tests/e2e/test_guard_poison.py (the guard at its defaults skips the window) and
bench/guard.py (the poisoned demo run).
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def garbage_documents(count: int, seed: int = 0) -> list[str]:
    """`count` documents of crawl garbage, alternating: base64 blobs (a data URI or bare lines of 76
    characters), binary bytes read as Latin-1, and UTF-8 Chinese read as Latin-1 (mojibake)."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        size = rng.randrange(600, 1600)
        kind = i % 3
        if kind == 0:
            blob = base64.b64encode(rng.randbytes(size)).decode("ascii")
            lines = "\n".join(blob[j : j + 76] for j in range(0, len(blob), 76))
            docs.append(f"data:image/png;base64,{blob}" if rng.random() < 0.5 else lines)
        elif kind == 1:
            raw = bytes(b for b in rng.randbytes(size) if b >= 0x20 and b != 0x7F)
            docs.append(raw.decode("latin-1"))
        else:
            text = "".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(size // 3))
            docs.append(text.encode("utf-8").decode("latin-1"))
    return docs


@dataclass(frozen=True)
class PoisonedSplit:
    """A split written by `write_poisoned_split`: where, and which batches and samples hold garbage."""

    folder: Path
    window: tuple[int, int]  # batches [a, b) in data.skip's numbering
    garbage: frozenset[str]  # the garbage samples, by the recorder's sample hash (below)

    @staticmethod
    def sample_hash(row: np.ndarray) -> str:
        """A sample's hash as scenarios/resume_driver.py records it (its tokens as int64)."""
        return hashlib.sha256(np.asarray(row, dtype=np.int64).tobytes()).hexdigest()[:16]


def write_poisoned_split(
    out: Path,
    tokenizer: Path,
    texts: Iterable[str],
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    window: tuple[int, int],
    per_batch: int,
    seed: int = 0,
) -> PoisonedSplit:
    """`num_batches` batches of `batch_size` samples of `texts` at `out` (a split folder), with
    `per_batch` samples of garbage in each batch of `window` (module docstring)."""
    from shards.meta import SplitMeta, now
    from shards.tokenizer import Tokenizer
    from shards.writer import write_token_split
    from storage import open_store

    a, b = window
    if not (0 <= a < b <= num_batches and 0 < per_batch <= batch_size):
        raise ValueError(
            f"window {window} and per_batch {per_batch} do not fit {num_batches} batches of {batch_size}"
        )
    tok = Tokenizer(tokenizer)
    info = tok.info()
    # In a seeded random order, as a shuffled run reads them: batches of consecutive samples of one
    # newspaper page are far less alike in loss than a run's batches are, and garbage is what is tested.
    clean = _pack(tok, texts, seq_len, num_batches * batch_size)
    clean = clean[np.random.default_rng(seed).permutation(len(clean))]
    bad_count = (b - a) * per_batch
    docs = garbage_documents(4 * bad_count, seed)
    garbage = _pack(tok, docs, seq_len, bad_count)
    rng = random.Random(seed)
    rows = clean.copy()
    for i, batch in enumerate(range(a, b)):
        slots = sorted(rng.sample(range(batch_size), per_batch))
        for j, slot in enumerate(slots):
            rows[batch * batch_size + slot] = garbage[i * per_batch + j]
    dtype = "uint16" if info.vocab_size <= 1 << 16 else "uint32"
    meta = SplitMeta(
        split="train", seq_len=seq_len, dtype=dtype, vocab_size=info.vocab_size, eos_id=info.eos_id,
        bos_id=info.bos_id if info.bos_id is not None and info.bos_id >= 0 else -1, add_bos=False,
        tokenizer_sha256=info.sha256, num_samples=len(rows), num_tokens=rows.size,
        num_documents=len(rows), dropped={}, created_at=now(), command="scenarios.poison",
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_token_split(open_store(str(out)), [rows.astype(dtype)], meta, size_limit=1 << 20)
    return PoisonedSplit(out, window, frozenset(PoisonedSplit.sample_hash(r) for r in garbage))


def _pack(tok, texts: Iterable[str], seq_len: int, count: int) -> np.ndarray:
    """The first `count` samples of `texts` packed as the converter packs them (EOS after each)."""
    stream: list[int] = []
    for text in texts:
        stream.extend(tok.encode(text))
        stream.append(tok.eos_id)
        if len(stream) >= count * seq_len:
            break
    if len(stream) < count * seq_len:
        raise ValueError(f"the texts hold {len(stream)} tokens, fewer than {count} samples of {seq_len}")
    return np.array(stream[: count * seq_len], dtype=np.int64).reshape(count, seq_len)
