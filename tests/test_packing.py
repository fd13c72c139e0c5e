"""Packing: EOS after each document, BOS optional, min-token drops, no token lost between pieces."""

from __future__ import annotations

import numpy as np
import pytest

from convert.packing import Packer, join_documents


def test_eos_after_each_document_and_optional_bos():
    docs = [[10, 11], [12], [13, 14, 15]]
    piece = join_documents(docs, eos_id=2, bos_id=None, min_tokens=0)
    assert piece.tokens.tolist() == [10, 11, 2, 12, 2, 13, 14, 15, 2]
    with_bos = join_documents(docs, eos_id=2, bos_id=1, min_tokens=0)
    assert with_bos.tokens.tolist() == [1, 10, 11, 2, 1, 12, 2, 1, 13, 14, 15, 2]


def test_min_tokens_counts_the_eos():
    docs = [list(range(3, 22)), list(range(3, 21))]  # 19 ids + EOS = 20 (kept); 18 + EOS = 19 (dropped)
    piece = join_documents(docs, eos_id=2, bos_id=None, min_tokens=20)
    assert (piece.kept, piece.too_short) == (1, 1)
    assert len(piece.tokens) == 20 and piece.tokens[-1] == 2


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
