"""The one tokenizer: text <-> token ids, the special ids, and what meta.json records about it
(`info()`: kind, identity hash, vocabulary, special ids), over two backends chosen by the file given:

  * a SentencePiece `.model` file (`tokenizer.model` in a folder), read with `sentencepiece`;
  * a Hugging Face `tokenizer.json` (the `tokenizers` library: the hf extra), or a folder holding
    one; its special tokens are the ones `tokenizer_config.json` beside it names, then
    `special_tokens_map.json` for what that leaves unnamed, as transformers reads them.

A path is a file or a folder, local or s3://. A folder holding both files is read through its
tokenizer.json, as `transformers.AutoTokenizer` does; a file is told by its content (a JSON object
or a SentencePiece model). The converters (shards, SFT samples), training, generation, chat,
evaluation and export all use this class, so a text is encoded the same way everywhere. Any
tokenizer is used as it is: the vocabulary size and the special ids are read from its files, never
assumed. Training a SentencePiece model is `convert/tokens/tokenizer.py`.

`encode` adds no special token (BOS, EOS and the template's tokens are added by who needs them):
for a tokenizer.json that is `add_special_tokens=False`, which transformers' encoding with the same
flag equals token for token. Decoding drops special tokens (SentencePiece drops its control pieces
alike); byte-level BPE decodes to exactly the text that was encoded.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from shards.errors import ShardsError
from storage import StorageError, is_remote, join, open_store, read_url

SENTENCEPIECE = "sentencepiece"
HUGGINGFACE = "huggingface"
KINDS = (SENTENCEPIECE, HUGGINGFACE)
# The names a tokenizer's files have in a folder (an export, a conversion task's folder).
SP_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
HF_SPECIAL_MAP = "special_tokens_map.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
_DESCRIBED = {SENTENCEPIECE: "a SentencePiece model", HUGGINGFACE: "a Hugging Face tokenizer.json"}
# The `tokenizers` library's switch for its thread pool, read at every batched call.
_PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard's meta.json records about the tokenizer that made it."""

    path: str
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int  # -1 when the model has none
    kind: str = SENTENCEPIECE

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

    def meta_fields(self) -> dict[str, Any]:
        """The tokenizer's keys of a `SplitMeta` (shards/FORMAT.md); a SentencePiece model's shards
        name no kind, as they did before there was another."""
        return {
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "tokenizer_sha256": self.sha256,
            "tokenizer_kind": None if self.kind == SENTENCEPIECE else self.kind,
        }


def describe_kind(kind: str) -> str:
    """How messages name a kind: a SentencePiece model, a Hugging Face tokenizer.json."""
    return _DESCRIBED[kind]


# --- which files a path names ---------------------------------------------------------------------


def tokenizer_in(folder: str) -> str | None:
    """The tokenizer file a folder (local or s3://) holds: its tokenizer.json, else its
    tokenizer.model; None if it holds neither."""
    store = open_store(folder)
    for name in (HF_FILE, SP_FILE):
        if store.exists(name):
            return join(folder, name)
    return None


def read_tokenizer_files(path: str) -> dict[str, bytes]:
    """The files of the tokenizer `path` names, by the name each has in a folder: {tokenizer.model}
    or {tokenizer.json, and tokenizer_config.json / special_tokens_map.json where present beside
    it}; ShardsError if there is none."""
    path, data = _resolve(path)
    if not _is_json_object(data):
        return {SP_FILE: data}
    files = {HF_FILE: data}
    beside = open_store(path.rpartition("/")[0] if is_remote(path) else os.path.dirname(path) or ".")
    for name in (HF_CONFIG, HF_SPECIAL_MAP):
        extra = beside.read_bytes(name)
        if extra is not None:
            files[name] = extra
    return files


def tokenizer_identity(path: str) -> tuple[str, str]:
    """(kind, sha256) of the tokenizer `path` names, from its files without loading it: what
    meta.json's `tokenizer_kind` and `tokenizer_sha256` say of the tokenizer that made the shards."""
    files = read_tokenizer_files(path)
    return _kind_of(files), _sha256_of(path, files)


def _kind_of(files: dict[str, bytes]) -> str:
    return HUGGINGFACE if HF_FILE in files else SENTENCEPIECE


def _sha256_of(path: str, files: dict[str, bytes]) -> str:
    """A SentencePiece model's: its file's. A tokenizer.json's: its bytes, then the special tokens
    named beside it as sorted JSON (the ids they give shape the shards as the vocabulary does)."""
    if HF_FILE not in files:
        return hashlib.sha256(files[SP_FILE]).hexdigest()
    digest = hashlib.sha256(files[HF_FILE])
    digest.update(json.dumps(_special_tokens(path, files), sort_keys=True).encode())
    return digest.hexdigest()


def _is_json_object(data: bytes) -> bool:
    """Whether a file is JSON text (a SentencePiece model is a binary protobuf, never valid UTF-8
    text that opens with a brace: its scores are floats)."""
    if data.lstrip(b" \t\r\n")[:1] != b"{":
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _resolve(path: str) -> tuple[str, bytes]:
    """The tokenizer file `path` names (itself, or what a folder holds) and its bytes."""
    if not is_remote(path):
        if os.path.isdir(path):
            found = tokenizer_in(path)
            if found is None:
                raise ShardsError(folder_without_tokenizer(path))
            return found, read_url(found)
        if not os.path.isfile(path):
            raise _missing(path)
        return path, read_url(path)
    try:
        return path, read_url(path)
    except StorageError as err:
        if not err.missing:
            raise
    found = tokenizer_in(path)  # an s3:// prefix: a folder
    if found is None:
        raise _missing(path)
    return found, read_url(found)


def folder_without_tokenizer(folder: str, key: str | None = None) -> str:
    """The message for a folder that holds neither tokenizer.json nor tokenizer.model, with a file
    inside it that could be meant (`key`: the setting that names the folder, e.g. tokenizer.path)."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    candidates = [n for n in names if n.endswith(".model")] + [
        n for n in names if n.endswith(".json") and n not in (HF_CONFIG, HF_SPECIAL_MAP)
    ]
    example = os.path.join(folder, candidates[0] if candidates else SP_FILE)
    named, example = (f"{key}={folder}", f"{key}={example}") if key else (f"tokenizer {folder}", example)
    return (
        f"{named} is a folder with neither {HF_FILE} nor {SP_FILE}; give the tokenizer's file "
        f"(a SentencePiece .model or a Hugging Face tokenizer.json), e.g. {example}"
    )


def _missing(path: str) -> ShardsError:
    return ShardsError(
        f"tokenizer {path} does not exist; train one with `python -m convert tokenizer ...` or pass "
        "an existing SentencePiece .model file, Hugging Face tokenizer.json, or a folder holding one"
    )


def _neither(path: str, err: Exception) -> ShardsError:
    reason = " ".join(str(err).split())
    return ShardsError(
        f"tokenizer {path} is neither a SentencePiece .model file nor a Hugging Face tokenizer.json "
        f"({reason}); give the tokenizer's own file, or the folder it was saved in"
    )


# --- the backends -------------------------------------------------------------------------------


class _SentencePiece:
    kind = SENTENCEPIECE
    file_name = SP_FILE

    def __init__(self, path: str, model_bytes: bytes):
        import sentencepiece as spm

        self.path, self.model_bytes = path, model_bytes
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as err:
            raise _neither(path, err) from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def special_id(self, name: str) -> int | None:
        found = {"bos_token": self._sp.bos_id, "eos_token": self._sp.eos_id, "unk_token": self._sp.unk_id,
                 "pad_token": self._sp.pad_id}[name]()  # fmt: skip
        return found if found >= 0 else None

    def missing_eos(self) -> str:
        return f"tokenizer {self.path} has no EOS piece; documents could not be separated"

    def piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    @property
    def adds_dummy_prefix(self) -> bool:
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_bytes)
        return bool(proto.normalizer_spec.add_dummy_prefix)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(
        self, texts: list[str], add_bos: bool, add_eos: bool, num_threads: int
    ) -> list[list[int]]:
        # SentencePiece's C++ loop, BOS/EOS added there too.
        return self._sp.encode(texts, add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class _HuggingFace:
    kind = HUGGINGFACE
    file_name = HF_FILE

    def __init__(self, path: str, files: dict[str, bytes]):
        tokenizers = _import_tokenizers(path)
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_str(files[HF_FILE].decode("utf-8"))
        except Exception as err:  # the library raises plain Exceptions for what it cannot read
            raise _neither(path, err) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids past the model's: added tokens
        self._ids = {name: self._id_of(name, token) for name, token in _special_tokens(path, files).items()}

    def _id_of(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        found = self._tok.token_to_id(token)
        if found is None:
            raise ShardsError(
                f"tokenizer {self.path}: {HF_CONFIG} names {name} {token!r}, which its {HF_FILE} does not "
                f"hold; fix {name} in {HF_CONFIG}, or use the {HF_FILE} it was written for"
            )
        return found

    def special_id(self, name: str) -> int | None:
        return self._ids[name]

    def missing_eos(self) -> str:
        return (
            f"tokenizer {self.path} names no EOS token: set eos_token in the {HF_CONFIG} beside its "
            f"{HF_FILE} (the token that ends a document); documents could not be separated"
        )

    def piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(
        self, texts: list[str], add_bos: bool, add_eos: bool, num_threads: int
    ) -> list[list[int]]:
        # The library's batched call (no offsets: `encode_batch_fast`); its own threads unless one
        # is asked for (a conversion worker is one core).
        with _threads_off() if num_threads == 1 else nullcontext():
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        head = [self._ids["bos_token"]] if add_bos else []
        tail = [self._ids["eos_token"]] if add_eos else []
        if not (head or tail):
            return [e.ids for e in encodings]
        return [head + e.ids + tail for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _import_tokenizers(path: str):
    try:
        import tokenizers
    except ImportError:
        raise ShardsError(
            f"tokenizer {path} is a Hugging Face {HF_FILE}, read with the `tokenizers` library, which is "
            "not installed: install the hf extra, pip install -e '.[hf]' in the checkout"
        ) from None
    return tokenizers


def _special_tokens(path: str, files: dict[str, bytes]) -> dict[str, str | None]:
    """{bos_token, eos_token, unk_token, pad_token: the token's text or None}, from
    tokenizer_config.json, then special_tokens_map.json for those it does not name."""
    named: dict[str, str | None] = dict.fromkeys(SPECIAL_TOKENS)
    for name in (HF_CONFIG, HF_SPECIAL_MAP):
        if name not in files:
            continue
        try:
            settings = json.loads(files[name])
        except ValueError as err:
            raise ShardsError(f"tokenizer {path}: the {name} beside it is not valid JSON ({err})") from None
        if not isinstance(settings, dict):
            raise ShardsError(f"tokenizer {path}: the {name} beside it is not a JSON object")
        for key in SPECIAL_TOKENS:
            if named[key] is None:
                named[key] = _token_text(settings.get(key))
    return named


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@contextmanager
def _threads_off():
    before = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = before


# --- the one interface --------------------------------------------------------------------------


class Tokenizer:
    """A tokenizer from a path (local or s3://: a file, or a folder holding one) or from its files
    (`from_files`: what a worker process or a task folder is given)."""

    def __init__(self, path: str | os.PathLike, files: dict[str, bytes] | None = None):
        self.path = str(path)
        self.files = read_tokenizer_files(self.path) if files is None else dict(files)
        if _kind_of(self.files) == HUGGINGFACE:
            self._backend: _SentencePiece | _HuggingFace = _HuggingFace(self.path, self.files)
        else:
            self._backend = _SentencePiece(self.path, self.files[SP_FILE])

    @classmethod
    def from_files(cls, files: dict[str, bytes], path: str = "<tokenizer>") -> Tokenizer:
        """A tokenizer shipped as its files (`.files`, to worker processes); `path` names it in messages."""
        return cls(path, files)

    @property
    def kind(self) -> str:
        """SENTENCEPIECE or HUGGINGFACE."""
        return self._backend.kind

    @property
    def file_name(self) -> str:
        """The name its main file has in a folder: tokenizer.model or tokenizer.json."""
        return self._backend.file_name

    def info(self) -> TokenizerInfo:
        """What meta.json records; ShardsError without EOS (shards end every document with it)."""
        if self.eos_id is None:
            raise ShardsError(self._backend.missing_eos())
        return TokenizerInfo(
            path=self.path,
            sha256=_sha256_of(self.path, self.files),
            vocab_size=self.vocab_size,
            eos_id=self.eos_id,
            bos_id=-1 if self.bos_id is None else self.bos_id,
            kind=self.kind,
        )

    @property
    def vocab_size(self) -> int:
        """One past the largest id it can give (the embedding rows a model needs)."""
        return self._backend.vocab_size

    @property
    def eos_id(self) -> int | None:
        return self._backend.special_id("eos_token")

    @property
    def bos_id(self) -> int | None:
        return self._backend.special_id("bos_token")

    @property
    def unk_id(self) -> int | None:
        return self._backend.special_id("unk_token")

    @property
    def pad_id(self) -> int | None:
        return self._backend.special_id("pad_token")

    @property
    def start_id(self) -> int | None:
        """The token a document starts after: EOS (the shards end every document with it), else BOS."""
        return self.eos_id if self.eos_id is not None else self.bos_id

    def piece(self, token_id: int) -> str:
        """The token's text as the tokenizer stores it ("▁" / "Ġ" marks and all)."""
        return self._backend.piece(token_id)

    @property
    def adds_dummy_prefix(self) -> bool:
        """Whether SentencePiece puts "▁" before the first word (its normalizer's setting); False
        for a tokenizer.json (its pre-tokenizer, carried in the file, says it)."""
        return self._backend.adds_dummy_prefix if isinstance(self._backend, _SentencePiece) else False

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text)

    def encode_batch(
        self, texts: list[str], *, add_bos: bool = False, add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """Many texts in one call of the library; BOS/EOS added around each when asked.
        `num_threads`: 1 keeps it on this thread, -1 lets the library use its threads."""
        return self._backend.encode_batch(texts, add_bos, add_eos, num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)

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
