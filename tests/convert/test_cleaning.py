"""The cleaner: Unicode normalisation, escape/control removal, drops counted by reason."""

from __future__ import annotations

import pytest

from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner, DropCounts


def test_nfkc_turns_full_width_forms_into_plain_ones(chinese_documents):
    article = chinese_documents[0]
    assert "１９９８年" in article and "，" in article
    cleaned = Cleaner().clean(article)
    assert "1998年" in cleaned and "１" not in cleaned
    assert "," in cleaned and "，" not in cleaned  # NFKC maps full-width punctuation too
    assert cleaned.count("\n") == article.count("\n")  # the article's lines survive


def test_normalization_none_keeps_the_text(chinese_documents):
    article = chinese_documents[0]
    assert Cleaner(normalization="none").clean(article) == article


def test_fortune_style_ansi_colour_codes_and_controls_are_removed():
    # As in Debian's fortunes-zh: colour codes around a poem's title and author.
    raw = "\x1b[32m静夜思\x1b[m\n\x1b[1;31m李白\x1b[0m\n床前明月光，\x07疑是地上霜。\x1b]0;title\x07\x00\x1bc"
    assert Cleaner(normalization="none").clean(raw) == "静夜思\n李白\n床前明月光，疑是地上霜。"


def test_lone_surrogates_are_removed_so_the_tokenizer_can_take_the_text():
    import sentencepiece as spm

    cleaned = Cleaner().clean("半个\ud83d表情 and \udc80 a stray byte")
    assert cleaned == "半个表情 and  a stray byte"
    spm.SentencePieceNormalizer(rule_name="identity").normalize(cleaned)  # raised TypeError before


def test_tabs_survive_line_endings_are_normalised_and_blank_runs_collapse():
    raw = "\ufeff  第一段\t甲  \r\n乙\r\r\n\n \n\t\n第二段\n\n第三段  \n"
    assert Cleaner().clean(raw) == "第一段\t甲\n乙\n\n第二段\n\n第三段"


def test_drops_are_counted_by_reason(chinese_documents):
    cleaner = Cleaner(min_chars=5)
    kept = [
        cleaner.clean(t)
        for t in [chinese_documents[1], " \x1b[0m\n\t", "短文", chinese_documents[1], chinese_documents[2]]
    ]
    assert kept[0] and kept[2:] == [None, None, kept[4]] and kept[1] is None
    assert cleaner.drops.as_dict() == {"duplicate": 1, "empty": 1, "too_short_chars": 1}
    assert cleaner.drops.total == 3


def test_duplicates_are_found_after_cleaning():
    cleaner = Cleaner()
    assert cleaner.clean("人民日报\r\n") == "人民日报"
    assert cleaner.clean("\x1b[31m人民日报\x1b[0m") is None
    assert cleaner.clean("人民日报。") == "人民日报。"
    assert Cleaner(dedup=False).clean("甲") == "甲"


def test_dedup_off_keeps_repeats():
    cleaner = Cleaner(dedup=False)
    assert [cleaner.clean("同一句话") for _ in range(3)] == ["同一句话"] * 3
    assert cleaner.drops.as_dict() == {}


def test_drop_counts_merge():
    a, b = DropCounts(), DropCounts()
    a.add("duplicate")
    b.add("duplicate", 2)
    b.add("too_short_tokens")
    a.merge(b)
    assert a.as_dict() == {"duplicate": 3, "too_short_tokens": 1}


def test_bad_settings_are_refused():
    with pytest.raises(ConvertError, match="unknown normalization 'NFX'.*NFKC"):
        Cleaner(normalization="NFX")
    with pytest.raises(ConvertError, match="min_chars"):
        Cleaner(min_chars=-1)


# Compatibility forms, combining sequences SentencePiece's table does not compose or reorder
# (U+0344, marks out of canonical order), ligatures, circled and full-width forms, and a lone
# surrogate (left by surrogateescape reading) that SentencePiece cannot take at all.
TRICKY = [
    "ﬁ ｶﾀｶﾅ ①②③ ㍿ ＡＢＣ１２３ ¼ ℌ \u3000全角空格",
    "a\u0344b e\u0301\u0316 ｅ\u0316\u0301 Ａ\u0301 \u1e9b\u0323",
    "한국어 \u1100\u1161\u11a8 가",
    "bad byte \udc80 kept",
]


@pytest.mark.parametrize("form", ["NFKC", "NFC", "NFKD", "NFD"])
def test_unicode_form_matches_unicodedata(chinese_documents, form):
    import unicodedata

    from convert.filters.cleaning import unicode_form

    for text in [*chinese_documents[:300], *TRICKY]:
        assert unicode_form(form, text) == unicodedata.normalize(form, text), text[:40]


def test_controls_go_before_nfkc_so_the_output_is_normalised():
    import unicodedata

    cleaned = Cleaner().clean("e\x00\u0301 ｔｅｓｔ")
    assert cleaned == "é test" and unicodedata.is_normalized("NFKC", cleaned)


def test_first_seen_all_decides_a_batch_as_first_seen_does_one_by_one():
    import random

    import numpy as np

    from convert.filters.cleaning import Cleaner, text_digest

    rng = random.Random(3)
    texts = [str(rng.randrange(40)) for _ in range(300)]
    batch = Cleaner()
    skip = np.array([t == "7" for t in texts])  # never de-duplicated, never remembered
    got = np.concatenate([batch.first_seen_all(b"".join(map(text_digest, texts[i : i + 37])), skip[i : i + 37])
                          for i in range(0, len(texts), 37)])  # fmt: skip
    assert got[skip].all()
    fresh = Cleaner()
    plain = [fresh.first_seen(text_digest(t)) for t in texts if t != "7"]
    assert got[~skip].tolist() == plain
    assert batch.drops.as_dict() == {"duplicate": plain.count(False)}


def test_digests_ending_in_zero_bytes_stay_distinct():
    from convert.filters.cleaning import Cleaner

    cleaner = Cleaner()
    zero, one, other = bytes(16), bytes(15) + b"\x01", bytes(14) + b"\x01\x00"
    assert cleaner.first_seen_all(zero + one + zero + other).tolist() == [True, True, False, True]
    assert not cleaner.first_seen(zero) and not cleaner.first_seen(other)
    assert cleaner.first_seen(bytes(13) + b"\x01\x00\x00")
