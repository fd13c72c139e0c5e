"""Quality filters: each reason on the text it is meant for, vectorised measures, defaults on real text."""

from __future__ import annotations

import numpy as np
import pytest

from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner
from convert.filters.quality import REASONS, QualityFilters, dominant_drop, filter_reasons, text_stats, utf32


def reasons_of(texts: list[str], filters: QualityFilters) -> list[str | None]:
    codes, lengths = utf32(texts)
    return [REASONS[code - 1] if code else None for code in filter_reasons(texts, codes, lengths, filters)]


@pytest.fixture(scope="module")
def articles(chinese_documents) -> list[str]:
    cleaner = Cleaner()
    return [t for t in map(cleaner.clean, chinese_documents) if t]


def test_each_filter_drops_the_text_it_is_for_and_keeps_a_real_article(articles):
    article = next(a for a in articles if 800 < len(a) < 2000 and text_stats(a)["symbol_share"] < 0.05)
    lines = article.split("\n")
    cases = {
        "too_short_chars": article[:30],
        "low_cjk": "The People's Daily (人民日报) is the largest newspaper group in China, founded in 1948. "
        * 3,
        "symbols": next(a for a in articles if a.startswith("一九九七年股市概览")),  # a real stock table
        "repeated_paragraphs": "\n\n".join(
            [lines[0], *[lines[1]] * 4, lines[2] if len(lines) > 2 else lines[0]]
        ),
        "repeated_lines": "\n".join(lines[:2] + [lines[1]] * 6),
        "long_run": "北京搬家公司北京保洁公司北京装修公司" * 8 + "。" + article[:200],
    }
    got = reasons_of([article, *cases.values()], QualityFilters.recommended(chinese=True))
    assert got == [None, *cases]
    # without `chinese` (no Chinese corpus's preset) the defaults hold for any language
    neutral = reasons_of([article, *cases.values()], QualityFilters.recommended())
    assert neutral == [None, *(None if reason == "low_cjk" else reason for reason in cases)]


def test_filters_are_off_unless_asked(articles):
    texts = [articles[0], "短", "abc" * 50, "北京搬家公司" * 50]
    assert reasons_of(texts, QualityFilters()) == [None] * 4
    only_runs = QualityFilters(max_run_chars=100)
    assert reasons_of(texts, only_runs) == [None, None, "long_run", "long_run"]


def test_vectorised_measures_agree_with_one_text_at_a_time(articles):
    """The batch code (reduceat over one code-point array) gives each text's own measures."""
    sample = articles[:400] + ["", "a", "１２３", "𠀀𠀁 emoji 😀", "\n\n"]
    for filters in (
        QualityFilters(min_cjk_share=0.5),
        QualityFilters(max_symbol_share=0.1),
        QualityFilters(max_run_chars=40),
    ):
        got = reasons_of(sample, filters)
        for text, reason in zip(sample, got, strict=True):
            stats = text_stats(text)
            expected = (
                (filters.min_cjk_share and stats["cjk_share"] < filters.min_cjk_share)
                or (filters.max_symbol_share < 1 and stats["symbol_share"] > filters.max_symbol_share)
                or (filters.max_run_chars and stats["longest_run"] > filters.max_run_chars)
            )
            assert (reason is not None) == bool(expected), (text[:40], stats, reason)


def test_recommended_filters_keep_nearly_all_news_articles(articles):
    got = reasons_of(articles, QualityFilters.recommended(chinese=True))
    dropped = [r for r in got if r]
    assert 0 < len(dropped) < 0.03 * len(articles)  # headline-only items, stock tables: about 2 %
    assert {"too_short_chars", "symbols"} <= set(dropped)


def test_longest_run_breaks_at_punctuation_and_spaces():
    assert text_stats("甲乙丙,丁戊 己庚辛壬癸")["longest_run"] == 5
    assert text_stats("abc\ndefgh")["longest_run"] == 5
    assert text_stats("")["longest_run"] == 0


def test_bad_shares_are_refused():
    with pytest.raises(ConvertError, match="--min-cjk-share 1.5"):
        QualityFilters(min_cjk_share=1.5).check()
    with pytest.raises(ConvertError, match="--max-run-chars -1"):
        QualityFilters(max_run_chars=-1).check()
    assert np.all(
        filter_reasons([], np.empty(0, np.uint32), np.empty(0, np.int64), QualityFilters.recommended()) == 0
    )


def test_a_filter_that_drops_over_90_percent_is_named_in_one_line():
    filters = QualityFilters.recommended(chinese=True)
    assert dominant_drop({"low_cjk": 900, "duplicate": 95}, 1000, filters) is None  # 90 %: not over
    line = dominant_drop({"low_cjk": 10_460}, 10_460, filters)
    assert line.startswith(
        "warning: --min-cjk-share 0.3 (low_cjk) dropped 10,460 of the 10,460 documents read (100.0 %)"
    )
    assert "\n" not in line
    assert dominant_drop({"duplicate": 990}, 1000, filters) is None  # duplicates are no filter
    assert dominant_drop({}, 0, filters) is None
