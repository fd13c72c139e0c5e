"""Clean documents and drop the unusable ones, counting every drop by reason.

`Cleaner.clean(text)` returns the cleaned text, or None when the document is dropped:
  "empty"            nothing left after cleaning
  "too_short_chars"  fewer than `min_chars` characters left
  "duplicate"        exactly the same cleaned text as an earlier document
(The conversion counts "too_short_tokens" after tokenization.) A text dropped by an earlier rule
is counted by that rule only: a conversion's too-short texts (`filtered_below`, its --min-chars)
are never counted as duplicates. `clean_with_digest` also returns
the text's digest (`text_digest`), and `first_seen(digest)` is the de-duplication on its own,
for digests computed elsewhere (a conversion's workers clean without de-duplicating and the
main process de-duplicates their digests, in input order).

Exact de-duplication keeps a set of 16-byte XXH3-128 digests of the cleaned texts: the only
memory that grows with the corpus. That is 16 bytes of hash per distinct document, about
90 bytes once CPython's bytes-object and set-slot overhead are counted (roughly 0.9 GB per
10 M documents). `first_seen_all` decides a whole batch of digests in one pass.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field

import numpy as np
import xxhash

from convert.errors import ConvertError
from convert.records import DIGEST_BYTES

NORMALIZATIONS = ("NFKC", "NFC", "NFKD", "NFD", "none")

# ESC [ params intermediates final (CSI: colours, cursor moves), ESC ] ... BEL/ST (OSC: window
# titles, links), ESC ( B style charset picks, any other two-character ESC sequence; then single
# C0 and C1 controls except \t and \n (\r is turned into \n first), DEL, the byte-order mark and
# lone surrogates (JSON's "\ud800" escapes: not text, and no tokenizer takes them).
# One pattern, one pass: the escape alternatives are tried first, so a sequence goes as a whole.
_ESCAPES_AND_CONTROLS = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[()*+][0-~]"
    r"|\x1b[ -~]?"
    "|[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\ud800-\udfff]"
)
# The single characters that pattern removes (ESC included): a plain character class is found
# 3x faster than the alternation above is tried, and most documents have none.
_ANY_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\ud800-\udfff]")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")
# Two or more blank lines (possibly holding only spaces/tabs) become a single blank line.
_BLANK_RUNS = re.compile(r"\n(?:[ \t]*\n){2,}")


@dataclass
class DropCounts:
    """How many documents were dropped, by reason."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def merge(self, other: DropCounts) -> None:
        for reason, n in other.counts.items():
            self.add(reason, n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


class Cleaner:
    def __init__(self, *, normalization: str = "NFKC", min_chars: int = 1, dedup: bool = True) -> None:
        if normalization not in NORMALIZATIONS:
            raise ConvertError(
                f"unknown normalization {normalization!r}; use one of: {', '.join(NORMALIZATIONS)}"
            )
        if min_chars < 0:
            raise ConvertError(f"min_chars must be 0 or more, got {min_chars}")
        self.normalization = normalization
        self.min_chars = min_chars
        self.dedup = dedup
        self.drops = DropCounts()
        self._seen: set[bytes] = set()
        # At most this many digests are kept (None: no limit): a multi-machine task's share of the
        # memory budget. A copy of a document whose digest was not kept is not dropped here; the
        # merge's exact stage drops it (convert/dedup/stages.py).
        self.seen_limit: int | None = None
        # Texts shorter than this are left to the quality filter's "too_short_chars" (counted by
        # the first rule that drops them), not de-duplicated: set by `Selection` (--min-chars).
        self.filtered_below = 0

    def clean(self, text: str) -> str | None:
        """The cleaned text, or None (and the reason counted in `drops`) if it is dropped."""
        kept = self.clean_with_digest(text)
        return None if kept is None else kept[0]

    def clean_with_digest(self, text: str) -> tuple[str, bytes] | None:
        """(cleaned text, its digest), or None (and the reason counted) if it is dropped."""
        text = self.normalize(text)
        if not text:
            return self._drop("empty")
        if len(text) < self.min_chars:
            return self._drop("too_short_chars")
        digest = text_digest(text)
        if len(text) < self.filtered_below:
            return text, digest  # the quality filter drops it as too short: not a duplicate
        return (text, digest) if self.first_seen(digest) else None

    def first_seen(self, digest: bytes) -> bool:
        """False, counted as a "duplicate", when de-duplicating and the digest came before."""
        if not self.dedup:
            return True
        key = _key(digest)
        if key in self._seen:
            self._drop("duplicate")
            return False
        if self.seen_limit is None or len(self._seen) < self.seen_limit:
            self._seen.add(key)
        return True

    def first_seen_all(self, digests: bytes, skip: np.ndarray | None = None) -> np.ndarray:
        """`first_seen` for each DIGEST_BYTES digest of `digests`, in order, as a bool array;
        rows where `skip` is True are left out of de-duplication (True, their digest not kept).
        A batch without duplicates is decided by C-level set operations, others by one pass."""
        seen, count = self._seen, len(digests) // DIGEST_BYTES
        if not self.dedup:
            return np.ones(count, dtype=bool)
        # numpy's bytes items drop trailing zero bytes: `_key`, the same for every digest
        views = np.frombuffer(digests, dtype=f"S{DIGEST_BYTES}").tolist()
        checked = np.ones(count, dtype=bool) if skip is None else ~skip
        if skip is not None and skip.any():
            views = [d for d, keep in zip(views, checked.tolist(), strict=True) if keep]
        new = dict.fromkeys(views).keys() - seen
        fresh = np.ones(count, dtype=bool)
        limit = self.seen_limit
        if len(new) == len(views) and (limit is None or len(seen) + len(new) <= limit):
            seen |= new
        elif limit is None:
            fresh[checked] = [d not in seen and not seen.add(d) for d in views]
        else:  # in order, until the set is full
            fresh[checked] = [d not in seen and (len(seen) >= limit or not seen.add(d)) for d in views]
        duplicates = int(count - fresh.sum())
        if duplicates:
            self.drops.add("duplicate", duplicates)
        return fresh

    def normalize(self, text: str) -> str:
        """Cleaning without the drop decisions: escapes, controls, Unicode form, whitespace.

        Each regex pass runs only when a cheap C-level check says it has something to do: most
        documents have no \r, no escapes or controls, no trailing spaces and no blank runs.
        """
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        # \n, \t and U+3000 also make isprintable() False; then the character class decides.
        if not text.isprintable() and _ANY_CONTROL.search(text):
            text = _ESCAPES_AND_CONTROLS.sub("", text)
        if self.normalization != "none":
            text = unicode_form(self.normalization, text)
        # Trailing-space removal must follow NFKC, which turns U+3000 into a plain space.
        if " \n" in text or "\t\n" in text:
            text = _TRAILING_SPACE.sub("\n", text)
        # With no trailing blanks left, a run of blank lines is three or more \n in a row.
        if "\n\n\n" in text:
            text = _BLANK_RUNS.sub("\n\n", text)
        return text.strip()

    def _drop(self, reason: str) -> None:
        self.drops.add(reason)
        return None


def _key(digest: bytes) -> bytes:
    """A digest as the set holds it: without trailing zero bytes, as numpy's `S16` items come
    (one-to-one: every digest has 16 bytes)."""
    return digest.rstrip(b"\x00")


def text_digest(text: str) -> bytes:
    """16-byte XXH3-128 of the text's UTF-8: its identity for de-duplication, split and resume.

    Not a cryptographic hash: a collision (odds about n^2 / 2^129 for n documents) would drop a
    document as a duplicate; XXH3 is about 2x faster than BLAKE2b here.
    """
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


def unicode_form(form: str, text: str) -> str:
    """`text` in Unicode normal form `form` (NFKC, NFC, NFKD or NFD).

    NFKC, the default, goes through SentencePiece's compiled NFKC normaliser, about 4x faster than
    `unicodedata` on Chinese text. Its result is accepted only when `unicodedata` agrees it is in
    NFKC; otherwise (sequences of combining marks it does not reorder or compose, such as
    U+0344, or text SentencePiece cannot take, like lone surrogates) `unicodedata` redoes it.
    Known difference: characters newer than Python's Unicode database (14.0 on Python 3.11),
    about 100 of them, e.g. U+A7F1 or U+1CCD6..U+1CCF9, get their compatibility mapping from SentencePiece
    and pass unchanged through `unicodedata`.
    """
    if unicodedata.is_normalized(form, text):  # quick check in C; true for 1 in 6 documents here
        return text
    if form == "NFKC":
        try:
            fast = _sentencepiece_nfkc().normalize(text)
        except (UnicodeError, RuntimeError, TypeError):
            fast = None
        if fast is not None and unicodedata.is_normalized("NFKC", fast):
            return fast
    return unicodedata.normalize(form, text)


@functools.cache
def _sentencepiece_nfkc():
    import sentencepiece as spm

    # Plain NFKC: no dummy prefix, whitespace kept as it is, no U+2581 escaping.
    return spm.SentencePieceNormalizer(
        rule_name="nfkc", add_dummy_prefix=False, remove_extra_whitespaces=False, escape_whitespaces=False
    )
