"""A split's `meta.json`: one typed schema, written by the converters and checked by the trainer.

`meta.json` is what a trainer needs to refuse data that does not fit it (vocabulary, sequence
length, tokenizer, pretraining vs SFT samples) before it builds anything; shards/FORMAT.md lists
its keys. Pretraining shards carry no `kind` (it means "pretrain") and none of the SFT keys, so a
`SplitMeta` leaves out what is None when written.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from shards.errors import ShardsError
from shards.tokenizer import KINDS
from storage import StorageError, Store, join, read_url

FORMAT_NAME = "llm-pretrain-tokens"  # pretraining and SFT shards alike; `kind` tells them apart
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
SFT = "sft"
PRETRAIN = "pretrain"
SFT_COLUMNS = {"loss_mask": "uint8", "segments": "uint16"}  # beside `tokens`
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True, kw_only=True)
class SplitMeta:
    """The keys of one split's meta.json (shards/FORMAT.md); the SFT ones are None for pretraining."""

    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    kind: str | None = None  # "sft"; pretraining shards do not say
    split: str
    seq_len: int
    dtype: str
    columns: dict[str, str] | None = None  # SFT: {"tokens": dtype, **SFT_COLUMNS}
    vocab_size: int
    eos_id: int
    bos_id: int  # -1 when the tokenizer has none
    add_bos: bool
    tokenizer_sha256: str
    tokenizer_kind: str | None = None  # "huggingface" (a tokenizer.json); SentencePiece shards do not say
    chat_template: dict[str, Any] | None = None  # SFT: ChatTemplate.to_dict()
    packed: bool | None = None
    num_samples: int
    num_tokens: int
    num_documents: int
    num_examples: int | None = None
    target_tokens: int | None = None
    padding_tokens: int | None = None
    padding_share: float | None = None
    truncated: dict[str, int] | None = None
    dropped: dict[str, int]
    created_at: str
    command: str

    @property
    def sample_kind(self) -> str:
        return self.kind or PRETRAIN

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: Any, source: str) -> SplitMeta:
        """The schema of a parsed meta.json; ShardsError naming `source` and the fix if it is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ShardsError(f"{source} is not a {FORMAT_NAME!r} file; re-run `python -m convert shards`")
        if data.get("format_version") != FORMAT_VERSION:
            raise ShardsError(
                f"{source} has format_version {data.get('format_version')!r}, this code reads "
                f"{FORMAT_VERSION}; re-run the conversion with this version of `python -m convert`"
            )
        known = {f.name: f for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        missing = [f.name for f in known.values() if f.name not in values and _required(f)]
        if missing:
            raise ShardsError(f"{source} lacks {', '.join(missing)}; re-run the conversion")
        meta = cls(**values)
        meta.validate(source)
        return meta

    def validate(self, source: str) -> None:
        """ShardsError unless the values have the types and ranges shards/FORMAT.md gives them."""
        ints = ("seq_len", "vocab_size", "eos_id", "bos_id", "num_samples", "num_tokens", "num_documents")
        wrong = [name for name in ints if not _is_int(getattr(self, name))]
        if not isinstance(self.add_bos, bool):
            wrong.append("add_bos")
        if self.dtype not in TOKEN_DTYPES:
            wrong.append("dtype")
        if wrong:
            raise ShardsError(
                f"{source}: {', '.join(wrong)} not as shards/FORMAT.md says; re-run the conversion"
            )
        if self.tokenizer_kind not in (None, *KINDS):
            raise ShardsError(
                f"{source} has an unknown tokenizer_kind {self.tokenizer_kind!r}; re-run the conversion"
            )
        if self.sample_kind not in (PRETRAIN, SFT):
            raise ShardsError(f"{source} has an unknown kind {self.kind!r}; re-run the conversion")


def _required(f) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def now() -> str:
    """`created_at`: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_meta(store: Store, meta: SplitMeta, folder: str | None = None) -> None:
    """`meta` as `<folder>/meta.json` of `store` (the split's name when `folder` is None)."""
    store.write_json(f"{meta.split if folder is None else folder}/{META_FILE}".lstrip("/"), meta.to_dict())


def read_meta_dict(split_folder: str) -> dict[str, Any]:
    """The parsed meta.json of a split folder (local or s3://), not yet checked against the schema."""
    try:
        raw = read_url(join(split_folder, META_FILE))
    except StorageError as err:
        if not err.missing:
            raise
        raise ShardsError(
            f"stream {split_folder} has no meta.json: it was not produced by `python -m convert shards`; "
            f"convert the corpus with `python -m convert shards ... --out <folder>` and point the "
            f"stream at <folder>/train or <folder>/val"
        ) from None
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ShardsError(
            f"stream {split_folder}: meta.json is not valid JSON ({err}); re-run the conversion"
        ) from None


def read_meta(split_folder: str) -> SplitMeta:
    """The checked meta.json of a split folder (local path or s3://bucket/prefix)."""
    return SplitMeta.from_dict(read_meta_dict(split_folder), f"stream {split_folder}: meta.json")


def check_kind(meta: SplitMeta, kind: str, where: str) -> None:
    """ShardsError when SFT shards meet a pretraining recipe, or pretraining shards an SFT one."""
    found = meta.sample_kind
    if found == kind:
        if kind == SFT and not all(c in (meta.columns or {}) for c in SFT_COLUMNS):
            raise ShardsError(
                f"{where}: meta.json says SFT but lists no {' and '.join(SFT_COLUMNS)} columns; re-run "
                "`python -m convert sft`"
            )
        return
    if found == SFT:
        raise ShardsError(
            f"{where}: these are SFT shards (prompt/answer samples from `python -m convert sft`) but the "
            "recipe pretrains (data.kind=pretrain); set data.kind: sft to fine-tune on them, or point the "
            "stream at shards from `python -m convert shards`"
        )
    raise ShardsError(
        f"{where}: these are pretraining shards (`python -m convert shards`) but the recipe fine-tunes "
        "(data.kind=sft), which needs prompt/answer samples with a loss mask; convert the pairs with "
        "`python -m convert sft`, or set data.kind: pretrain"
    )
