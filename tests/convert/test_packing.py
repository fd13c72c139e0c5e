"""Packing: EOS after each document, BOS optional, min-token drops, no token lost between pieces."""

from __future__ import annotations

import numpy as np
import pytest

from convert.tokens.packing import Packer, concat_documents, drop_short_documents


def test_documents_are_concatenated_in_order_with_their_lengths():
    tokens, lengths = concat_documents([[10, 11, 2], [12, 2], [13, 14, 15, 2]])
    assert tokens.tolist() == [10, 11, 2, 12, 2, 13, 14, 15, 2] and tokens.dtype == np.uint32
    assert lengths.tolist() == [3, 2, 4]
    empty, none = concat_documents([])
    assert empty.size == 0 and none.size == 0


def test_min_tokens_counts_the_eos_and_drops_whole_documents():
    # 19 ids + EOS = 20 (kept); 18 + EOS = 19 (dropped); 20 + EOS = 21 (kept)
    docs = [[*range(3, 22), 2], [*range(3, 21), 2], [*range(100, 120), 2]]
    tokens, lengths = concat_documents(docs)
    kept_tokens, kept = drop_short_documents(tokens, lengths, 20)
    assert kept == 2
    assert kept_tokens.tolist() == docs[0] + docs[2]
    same, all_kept = drop_short_documents(tokens, lengths, 0)
    assert all_kept == 3 and same is tokens


def test_no_token_lost_between_pieces():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 60000, size=10_007).astype(np.uint32)
    packer = Packer(64)
    rows = []
    cuts = np.sort(rng.choice(len(stream), size=40, replace=False))
    for piece in np.split(stream, cuts):
        rows.append(packer.add(piece))
    rows = np.concatenate(rows)
    assert rows.shape == (10_007 // 64, 64)
    assert np.array_equal(np.concatenate([rows.ravel(), packer.tail]), stream)
    assert len(packer.tail) == 10_007 % 64


def test_seq_len_must_hold_two_tokens():
    with pytest.raises(ValueError):
        Packer(1)
