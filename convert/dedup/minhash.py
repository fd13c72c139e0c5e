"""MinHash signatures of texts over character n-grams, a whole batch at once with numpy (worker side).

Chinese has no spaces between words, so a text's shingles are its overlapping `ngram`-character
substrings (5 by default: unrelated People's Daily articles then share almost none, at most
a Jaccard similarity of 0.29 over 800 of them, while a copy with 5 % of its characters edited
keeps about 0.83). Per batch:

  1. the batch's texts as one array of UTF-32 code points (`quality.utf32`, shared with the
     quality filters); each shingle hashed to 64 bits: a sum of its code points times fixed
     odd 64-bit multipliers, then the murmur3 finaliser to spread the bits;
  2. one-permutation hashing (Li, Owen & Zhang 2012): the top log2(bins) bits of a shingle's
     hash pick its bin, the rest is its value, and each bin keeps the smallest value: one pass
     over the shingles instead of one per permutation, so `bins` costs almost nothing;
  3. empty bins (texts with few shingles) borrow the value of another bin, chosen by a fixed
     probe sequence per bin that is the same for every text ("optimal densification",
     Shrivastava 2017), so that two texts' signatures stay comparable bin by bin;
  4. out of the signature: the LSH band keys, a 64-bit hash of each band's `rows` values with
     the band's own salt, and the low 8 bits of every bin (the "sketch", b-bit MinHash, Li &
     König 2010) from which the main process estimates the Jaccard similarity of a candidate
     pair: J ~ (share of equal bytes - 1/256) / (1 - 1/256).

Why not a library: `datasketch` (what baby-llama2-chinese uses) hashes each shingle with SHA-1
in Python and applies every permutation to every shingle; `rensa` (Rust) computes classic
k-permutation signatures fast, but hands them back only as Python lists; `datatrove` runs
deduplication as separate disk-backed pipeline stages, not as a step inside a conversion.
`make bench-dedup` measures them on the same text: our whole near-dedup step (signatures and
decisions) does 23-28x the documents per core of datasketch's MinHash-LSH; for the signatures
alone, ours match rensa's (taken out as an array) on article-length texts (78 k vs 65 k per
second for a median of 503 characters) and are half as fast on 45-character reviews, where
densifying the empty bins dominates. So no dependency beyond numpy. Constants come from a fixed
splitmix64 stream (not numpy's generators, whose streams may change between versions), so
signatures are the same on every machine: the multi-machine merge relies on it
(`SIGNATURE_VERSION`).
"""

from __future__ import annotations

import functools

import numpy as np

from convert.dedup.options import NearDedupOptions

SIGNATURE_VERSION = 1  # bump when anything below changes the keys or sketches of a text
_MASK64 = (1 << 64) - 1
_EMPTY = np.uint64(_MASK64)
_PROBES = 64  # densification probes per bin before the fallback scan
_U64 = np.uint64


def _splitmix64(seed: int, count: int) -> list[int]:
    """`count` 64-bit constants of the splitmix64 sequence from `seed` (plain integers)."""
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


@functools.cache
def _multipliers(seed: int, count: int) -> np.ndarray:
    """`count` fixed odd 64-bit multipliers (the first ones of the stream are the same for any count)."""
    return np.array([c | 1 for c in _splitmix64(seed, count)], dtype=np.uint64)


@functools.cache
def _salts(count: int) -> np.ndarray:
    return np.array(_splitmix64(0x5EED_0003, count), dtype=np.uint64)


@functools.cache
def _probes(bins: int) -> np.ndarray:
    """Each bin's fixed sequence of bins to borrow from (bins x _PROBES)."""
    stream = np.array(_splitmix64(0x5EED_0004, bins * _PROBES), dtype=np.uint64) % np.uint64(bins)
    return stream.astype(np.int64).reshape(bins, _PROBES)


def mix64(h: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finaliser, in place on a uint64 array (returned)."""
    h ^= h >> _U64(33)
    h *= _U64(0xFF51AFD7ED558CCD)
    h ^= h >> _U64(33)
    h *= _U64(0xC4CEB9FE1A85EC53)
    h ^= h >> _U64(33)
    return h


def shingle_hashes(codes: np.ndarray, lengths: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every `ngram`-character shingle of each text, and the text each belongs to.

    A text shorter than `ngram` (the conversion never lets one through) is one shingle, itself.
    """
    mult = _multipliers(0x5EED_0001, ngram)
    total = len(codes)
    wide = np.concatenate([codes, np.zeros(ngram - 1, dtype=codes.dtype)]).astype(np.uint64)
    h = wide[:total] * mult[0]
    for j in range(1, ngram):
        h += wide[j : j + total] * mult[j]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ends = starts + lengths
    valid = np.ones(total, dtype=bool)
    for k in range(1, ngram):  # a shingle must not run past its text's end
        tail = ends - k
        valid[tail[tail >= starts]] = False
    short = np.flatnonzero((lengths < ngram) & (lengths > 0))
    for i in short.tolist():  # the whole text as its only shingle: hash its code points alone
        piece = codes[starts[i] : ends[i]].astype(np.uint64)
        h[starts[i]] = (piece * mult[: len(piece)]).sum(dtype=np.uint64)
        valid[starts[i]] = True
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return mix64(h[valid]), owner[valid]


def signatures(
    codes: np.ndarray, lengths: np.ndarray, options: NearDedupOptions
) -> tuple[np.ndarray, np.ndarray]:
    """Band keys (texts x bands, uint64) and sketches (texts x bins, uint8) of a batch of texts
    given as `quality.utf32` code points; `options` must be resolved (bands and rows set)."""
    n, bins = len(lengths), options.bins
    hashes, owner = shingle_hashes(codes, lengths, options.ngram)
    bits = bins.bit_length() - 1
    slot = owner * bins + (hashes >> _U64(64 - bits)).astype(np.int64)
    signature = np.full(n * bins, _EMPTY, dtype=np.uint64)
    np.minimum.at(signature, slot, hashes & _U64((1 << (64 - bits)) - 1))
    signature = densify(signature.reshape(n, bins))
    return band_keys(signature, options), (signature & _U64(0xFF)).astype(np.uint8)


def band_keys(signature: np.ndarray, options: NearDedupOptions) -> np.ndarray:
    """The LSH band keys (texts x bands) of densified signatures (texts x bins, uint64)."""
    n = len(signature)
    used = signature[:, : options.bands * options.rows].reshape(n, options.bands, options.rows)
    keys = (used * _multipliers(0x5EED_0002, options.rows)).sum(axis=2, dtype=np.uint64) + _salts(
        options.bands
    )
    return mix64(keys)


def densify(signature: np.ndarray) -> np.ndarray:
    """Fill each empty bin with the value of the first non-empty bin on its fixed probe sequence
    (after `_PROBES` misses, of the next non-empty bin to the right, circularly)."""
    n, bins = signature.shape
    flat = signature.ravel()
    todo = np.flatnonzero(flat == _EMPTY)
    if not len(todo):
        return signature
    probes = _probes(bins).T.copy()  # attempt x bin
    filled = flat.copy()
    row_start, col = todo - todo % bins, todo % bins
    for attempt in range(_PROBES):
        value = flat[row_start + probes[attempt][col]]
        found = value != _EMPTY
        filled[todo[found]] = value[found]
        todo, row_start, col = todo[~found], row_start[~found], col[~found]
        if not len(todo):
            return filled.reshape(n, bins)
    filled = filled.reshape(n, bins)
    for row in np.unique(todo // bins).tolist():  # very few shingles
        present = np.flatnonzero(signature[row] != _EMPTY)
        if len(present):  # (a text without any shingle keeps its empty bins)
            gaps = np.flatnonzero(filled[row] == _EMPTY)
            filled[row, gaps] = signature[row, present[np.searchsorted(present, gaps) % len(present)]]
    return filled


def estimate_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Jaccard similarity estimated from two (stacks of) 8-bit sketches, row by row."""
    equal = np.count_nonzero(a == b, axis=-1) / a.shape[-1]
    return np.clip((equal - 1 / 256) / (1 - 1 / 256), 0.0, 1.0)


def shingle_set(text: str, ngram: int) -> set[str]:
    """The text's shingles as strings: for exact Jaccard in reports, tests and benchmarks."""
    if len(text) < ngram:
        return {text}
    return {text[i : i + ngram] for i in range(len(text) - ngram + 1)}


def jaccard(a: str, b: str, ngram: int) -> float:
    """Exact Jaccard similarity of two texts' shingle sets."""
    sa, sb = shingle_set(a, ngram), shingle_set(b, ngram)
    return len(sa & sb) / len(sa | sb) if sa or sb else 1.0
