"""Read baby-llama2-chinese's prepared token files back into documents (`import-bin`).

Its `.bin` files are raw little-endian np.uint16 ids, documents concatenated, each ended by the
tokenizer's EOS (id 2 for the ChatGLM2 tokenizer it uses). They are read in blocks (memory stays
bounded) and split back into documents on EOS; `convert.run.jobs.import_bin` sends them through
the same split, packing and writing as text. The tokenizer given must be the one that made them
(ids are checked against its vocabulary). Token files have no text, so there is no cleaning and
no de-duplication.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from convert.errors import ConvertError
from convert.reading.sources import open_binary

_BLOCK_BYTES = 16 << 20


def bin_documents(path: str, *, eos_id: int, vocab_size: int) -> Iterator[np.ndarray]:
    """The documents of one .bin file, without their EOS; a last one without EOS is kept too."""
    carry = np.empty(0, dtype=np.uint16)
    offset = 0
    with open_binary(path) as stream:
        while block := stream.read(_BLOCK_BYTES):
            if len(block) % 2:
                block += stream.read(1)  # a block boundary inside an id; the file may still be even
            if len(block) % 2:
                raise ConvertError(f"{path} has an odd number of bytes: not a file of uint16 token ids")
            ids = np.frombuffer(block, dtype="<u2")
            _check_ids(ids, path, offset, vocab_size)
            offset += len(ids)
            ids = np.concatenate([carry, ids])
            ends = np.flatnonzero(ids == eos_id)
            start = 0
            for end in ends:
                if end > start:
                    yield ids[start:end]
                start = end + 1
            carry = ids[start:].copy()
    if len(carry):
        yield carry


def _check_ids(ids: np.ndarray, path: str, offset: int, vocab_size: int) -> None:
    if len(ids) and int(ids.max()) >= vocab_size:
        position = offset + int(np.argmax(ids >= vocab_size))
        raise ConvertError(
            f"{path}: token id {int(ids[position - offset])} at position {position} is outside the tokenizer's "
            f"vocabulary ({vocab_size}); pass the tokenizer that made this file (ChatGLM2's for baby-llama2-chinese)"
        )
