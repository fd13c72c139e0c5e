"""Tokens: a tokenizer trained on a corpus, and token streams packed into samples.

tokenizer.py  SentencePiece BPE training with Baichuan-7B's settings (loading one for use is
              shards/tokenizer.py)
packing.py    documents' token ids concatenated, short ones dropped, cut into seq_len rows
"""

from convert.tokens.packing import Packer
from convert.tokens.tokenizer import train_tokenizer

__all__ = ["Packer", "train_tokenizer"]
