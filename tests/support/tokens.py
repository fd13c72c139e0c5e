"""Token facts of the suite's small tokenizer that several test modules need."""

from __future__ import annotations


def merging_pair(tok) -> tuple[str, str]:
    """A prompt and a one-character option that SentencePiece encodes as ONE token with its end."""
    for i in range(tok.vocab_size):
        piece = tok.piece(i).lstrip("▁")
        if len(piece) < 2 or not all("一" <= ch <= "鿿" for ch in piece):
            continue
        context, option = "。" + piece[:-1], piece[-1]
        whole, alone = tok.encode(context + option), tok.encode(context)
        if len(whole) <= len(alone) and whole[: len(alone)] != alone:
            return context, option
    raise AssertionError("the test tokenizer has no merging pair")
