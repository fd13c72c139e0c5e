"""The one SentencePiece wrapper: a `.model` file (local or s3://) loaded once, text <-> token ids,
the special ids, and what meta.json records about it (`info()`: hash, vocabulary, special ids).

The converters (shards, SFT samples), generation, chat, evaluation and export all use this class,
so a text is encoded the same way everywhere. Any model is used as it is: the vocabulary size and
the special ids are read from it, never assumed. Training a model is `convert/tokens/tokenizer.py`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from shards.errors import ShardsError
from storage import StorageError, is_remote, read_url


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard's meta.json records about the tokenizer that made it."""

    path: str
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int  # -1 when the model has none

    def token_dtype(self, requested: str = "auto") -> str:
        """uint16 when every id fits in 16 bits, else uint32; a forced uint16 must fit."""
        fits16 = self.vocab_size <= 1 << 16
        if requested == "auto":
            return "uint16" if fits16 else "uint32"
        if requested == "uint16" and not fits16:
            raise ShardsError(
                f"--dtype uint16 cannot hold the ids of {self.path} (vocabulary {self.vocab_size} > 65536); "
                "use --dtype auto or uint32"
            )
        if requested not in ("uint16", "uint32"):
            raise ShardsError(f"unknown --dtype {requested!r}; use auto, uint16 or uint32")
        return requested


def read_model_bytes(path: str) -> bytes:
    """The `.model` file's bytes, local or s3:// (through `storage`); ShardsError if it is absent."""
    missing = ShardsError(
        f"tokenizer {path} does not exist; train one with `python -m convert tokenizer ...` "
        "or pass the path of an existing SentencePiece .model file"
    )
    if not is_remote(path) and not os.path.isfile(path):
        raise missing
    try:
        return read_url(path)
    except StorageError as err:
        if err.missing:
            raise missing from None
        raise


class Tokenizer:
    """A SentencePiece model, from a path (local or s3://) or from its bytes (`from_bytes`)."""

    def __init__(self, path: str | os.PathLike, model_bytes: bytes | None = None):
        import sentencepiece as spm

        self.path = str(path)
        self.model_bytes = read_model_bytes(self.path) if model_bytes is None else model_bytes
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self.model_bytes)
        except (RuntimeError, OSError) as err:
            raise ShardsError(f"tokenizer {self.path} is not a SentencePiece .model file ({err})") from None

    @classmethod
    def from_bytes(cls, model_bytes: bytes, path: str = "<tokenizer>") -> Tokenizer:
        """A model shipped as bytes (to worker processes); `path` names it in messages."""
        return cls(path, model_bytes)

    def info(self) -> TokenizerInfo:
        """What meta.json records; ShardsError without EOS (shards end every document with it)."""
        if self._sp.eos_id() < 0:
            raise ShardsError(f"tokenizer {self.path} has no EOS piece; documents could not be separated")
        return TokenizerInfo(
            path=self.path,
            sha256=hashlib.sha256(self.model_bytes).hexdigest(),
            vocab_size=self._sp.vocab_size(),
            eos_id=self._sp.eos_id(),
            bos_id=self._sp.bos_id(),
        )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int | None:
        eos = self._sp.eos_id()
        return eos if eos >= 0 else None

    @property
    def bos_id(self) -> int | None:
        bos = self._sp.bos_id()
        return bos if bos >= 0 else None

    @property
    def unk_id(self) -> int | None:
        unk = self._sp.unk_id()
        return unk if unk >= 0 else None

    @property
    def start_id(self) -> int | None:
        """The token a document starts after: EOS (the shards end every document with it), else BOS."""
        return self.eos_id if self.eos_id is not None else self.bos_id

    def piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    @property
    def adds_dummy_prefix(self) -> bool:
        """Whether SentencePiece puts "▁" before the first word (its normalizer's setting)."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_bytes)
        return bool(proto.normalizer_spec.add_dummy_prefix)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(
        self, texts: list[str], *, add_bos: bool = False, add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """Many texts in one call (SentencePiece's C++ loop); BOS/EOS added around each when asked."""
        return self._sp.encode(texts, add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids that start a new document with `text`; ShardsError if `text` is empty.

        The shards put EOS after every document, so during training a document starts right after
        an EOS: prefixing it puts a prompt in the same context (BOS when the tokenizer has no EOS).
        """
        if not text.strip():
            raise ShardsError("empty prompt: give some text to continue, e.g. --prompt '床前明月光'")
        start = self.start_id
        return ([start] if start is not None else []) + self.encode(text)

    def check_fits(self, model_vocab_size: int) -> None:
        """ShardsError if this tokenizer can emit ids the model's embedding has no row for."""
        if self.vocab_size > model_vocab_size:
            raise ShardsError(
                f"tokenizer {self.path} has {self.vocab_size} pieces but the model's vocabulary is "
                f"{model_vocab_size}: use the tokenizer the model was trained with, or a model with "
                f"model.vocab_size >= {self.vocab_size}"
            )
