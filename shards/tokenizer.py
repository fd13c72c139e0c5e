"""A thin SentencePiece wrapper: text <-> token ids, the special ids, and a check against the model.

Generation (the training callback and `llm generate`) and export use this one class, so a prompt is
encoded the same way everywhere. A `s3://` model file is fetched through `storage`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from llm.errors import ConfigError
from storage import download_url, is_remote


class Tokenizer:
    def __init__(self, path: str | Path):
        import sentencepiece as spm

        local = _local_file(str(path))
        self.path = local
        self._sp = spm.SentencePieceProcessor(model_file=str(local))

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
        proto.ParseFromString(self.path.read_bytes())
        return bool(proto.normalizer_spec.add_dummy_prefix)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids that start a new document with `text`; ConfigError if `text` is empty.

        The shards put EOS after every document, so during training a document starts right after
        an EOS: prefixing it puts a prompt in the same context (BOS when the tokenizer has no EOS).
        """
        if not text.strip():
            raise ConfigError("empty prompt: give some text to continue, e.g. --prompt '床前明月光'")
        start = self.start_id
        return ([start] if start is not None else []) + self.encode(text)

    def check_fits(self, model_vocab_size: int) -> None:
        """ConfigError if this tokenizer can emit ids the model's embedding has no row for."""
        if self.vocab_size > model_vocab_size:
            raise ConfigError(
                f"tokenizer {self.path} has {self.vocab_size} pieces but the model's vocabulary is "
                f"{model_vocab_size}: use the tokenizer the model was trained with, or a model with "
                f"model.vocab_size >= {self.vocab_size}"
            )


def _local_file(path: str) -> Path:
    if is_remote(path):
        return download_url(path, Path(tempfile.mkdtemp(prefix="llm-tokenizer-")) / path.rsplit("/", 1)[-1])
    local = Path(path)
    if not local.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist; pass a SentencePiece .model file")
    return local
