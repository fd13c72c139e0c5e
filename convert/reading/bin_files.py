"""Import baby-llama2-chinese's prepared token files into the same shards as text corpora.

Its `.bin` files are raw little-endian np.uint16 ids, documents concatenated, each ended by the
tokenizer's EOS (id 2 for the ChatGLM2 tokenizer it uses). They are read in blocks (memory stays
bounded), split back into documents on EOS, and go through the same split, packing and writing
as text; the tokenizer given must be the one that made them (ids are checked against its
vocabulary). Token files have no text, so there is no cleaning and no de-duplication.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from convert.errors import ConvertError
from convert.run.conversion import Conversion, Doc, digest_of, split_of
from convert.run.options import ShardOptions
from convert.run.report import progress_bar

_BLOCK_BYTES = 16 << 20


def bin_documents(path: str, *, eos_id: int, vocab_size: int) -> Iterator[np.ndarray]:
    """The documents of one .bin file, without their EOS; a last one without EOS is kept too."""
    from convert.reading.sources import open_binary

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


def import_bin(
    files: list[str], *, tokenizer: str, out: str, options: ShardOptions = ShardOptions(), command: str = ""
) -> dict:
    """Split .bin token files into documents and write them as shards; returns the summary."""
    from convert.reading.sources import expand_inputs

    conversion = Conversion(tokenizer=tokenizer, out=out, options=options)
    info = conversion.tokenizer
    paths = expand_inputs(files)
    conversion.prepare_output()
    counts = {"files": len(paths), "documents": 0}
    start = time.monotonic()

    eos = np.array([info.eos_id], dtype=np.uint32)
    bos = np.array([info.bos_id] if options.add_bos else [], dtype=np.uint32)

    def documents(_executor) -> Iterator[Doc]:
        with progress_bar(None, "doc", "importing", enabled=options.progress) as bar:
            for path in paths:
                for doc in bin_documents(path, eos_id=info.eos_id, vocab_size=info.vocab_size):
                    counts["documents"] += 1
                    bar.update()
                    digest = digest_of(doc)
                    tokens = np.concatenate([bos, doc, eos], dtype=np.uint32)
                    yield Doc(digest, len(doc), tokens, split_of(digest, options.val_fraction))
        if counts["documents"] == 0:
            raise ConvertError(f"no tokens found in {', '.join(paths[:3])}: the .bin files are empty")

    conversion.run(documents)
    return conversion.finish(read=counts, dropped={}, start=start, command=command)
