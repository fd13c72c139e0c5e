"""Filters: what a document's own text decides, each drop counted by its reason.

cleaning.py  Unicode normalisation, escape and control removal, whitespace; empty texts,
             too-short texts and exact duplicates dropped; a text's digest (`text_digest`)
quality.py   the quality filters (length, CJK share, symbols, repetition, long runs) over a
             whole batch with numpy; their settings, `QualityFilters`
"""

from convert.filters.cleaning import Cleaner, DropCounts, text_digest
from convert.filters.quality import REASONS, QualityFilters, filter_reasons

__all__ = ["REASONS", "Cleaner", "DropCounts", "QualityFilters", "filter_reasons", "text_digest"]
