"""Clean documents and drop the unusable ones, counting every drop by reason.

`Cleaner.clean(text)` returns the cleaned text, or None when the document is dropped:
  "empty"            nothing left after cleaning
  "too_short_chars"  fewer than `min_chars` characters left
  "duplicate"        exactly the same cleaned text as an earlier document
(The pipeline adds "too_short_tokens" after tokenization, in its own DropCounts.)

Exact de-duplication keeps a set of 16-byte BLAKE2b digests of the cleaned texts: the only
memory that grows with the corpus. That is 16 bytes of hash per distinct document, about
90 bytes once CPython's bytes-object and set-slot overhead are counted (roughly 0.9 GB per
10 M documents). Each Cleaner sees only its own documents: parallel workers de-duplicate within
their share of the corpus.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

from convert.errors import ConvertError

NORMALIZATIONS = ("NFKC", "NFC", "NFKD", "NFD", "none")

# ESC [ params intermediates final (CSI: colours, cursor moves), ESC ] ... BEL/ST (OSC: window
# titles, links), ESC ( B style charset picks, and any other two-character ESC sequence.
_ANSI_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[()*+][0-~]"
    r"|\x1b[ -~]?"
)
# C0 and C1 controls except \t and \n (\r is turned into \n first), DEL, and the byte-order mark.
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
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

    def clean(self, text: str) -> str | None:
        """The cleaned text, or None (and the reason counted in `drops`) if it is dropped."""
        text = self.normalize(text)
        if not text:
            return self._drop("empty")
        if len(text) < self.min_chars:
            return self._drop("too_short_chars")
        if self.dedup:
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if digest in self._seen:
                return self._drop("duplicate")
            self._seen.add(digest)
        return text

    def normalize(self, text: str) -> str:
        """Cleaning without the drop decisions: escapes, controls, Unicode form, whitespace."""
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        text = _ANSI_ESCAPES.sub("", text)
        if self.normalization != "none":
            text = unicodedata.normalize(self.normalization, text)
        text = _CONTROL_CHARS.sub("", text)
        text = _TRAILING_SPACE.sub("\n", text)
        return _BLANK_RUNS.sub("\n\n", text).strip()

    def _drop(self, reason: str) -> None:
        self.drops.add(reason)
        return None
