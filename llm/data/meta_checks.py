"""The data's metadata against the recipe, before any model is built.

`check_streams(cfg)` reads each stream's `meta.json` (local or s3://) and refuses data that
contradicts the recipe (vocabulary, sequence length, tokenizer, pretraining vs SFT shards, SFT
streams of different chat templates, documents kept apart without an EOS id between them), and a
cache folder for remote shards that cannot be written. `document_eos(cfg, found)` is the EOS id
between two documents when the recipe keeps them apart (`model.attention=document`).
The format's own checks (meta.json's schema, index.json, the hashes, the kind) are `shards/`'s;
here is what the recipe adds.
"""

from __future__ import annotations

import json

from llm.config import SPLITS, TrainConfig
from llm.data.cache import check_cache_root
from llm.errors import ConfigError
from shards.chat_template import ChatTemplate
from shards.errors import ShardsError
from shards.index import check_index
from shards.meta import SplitMeta, check_kind, read_meta
from shards.tokenizer import SENTENCEPIECE, describe_kind, tokenizer_identity
from storage import is_remote, join


def check_streams(cfg: TrainConfig) -> dict[str, list[SplitMeta]]:
    """Check every stream's metadata against the recipe; return the metadata per split."""
    tokenizer = recipe_tokenizer(cfg.tokenizer.path) if cfg.data.check_tokenizer_hash else None
    found: dict[str, list[SplitMeta]] = {}
    for split in SPLITS:
        found[split] = []
        for i, stream in enumerate(cfg.data.streams(split)):
            where = f"data.{split}.{i} ({stream.remote})"
            try:  # the format's own checks raise ShardsError: to the recipe, a ConfigError like the rest
                meta = read_meta(stream.remote)
                check_kind(meta, cfg.data.kind, where)
                check_meta(meta, cfg, where, tokenizer)
                check_index(stream.remote, cfg.data.validate_hash, where)
            except ShardsError as err:
                raise ConfigError(str(err)) from None
            found[split].append(meta)
    if cfg.data.kind == "sft":
        _check_same_template(found)
    document_eos(cfg, found)
    if any(is_remote(s.remote) and not s.local for split in SPLITS for s in cfg.data.streams(split)):
        check_cache_root(cfg.data.cache_root)
    return found


def _check_same_template(found: dict[str, list[SplitMeta]]) -> None:
    """ConfigError unless every SFT stream was rendered with the same chat template."""
    seen: dict[str, str] = {}
    for split in SPLITS:
        for i, meta in enumerate(found[split]):
            seen.setdefault(json.dumps(meta.chat_template, sort_keys=True), f"data.{split}.{i}")
    if len(seen) > 1:
        first, second = list(seen.values())[:2]
        raise ConfigError(
            f"{first} and {second} were converted with different chat templates (meta.json "
            "chat_template); convert every stream with the same `python -m convert sft --template`"
        )


def document_eos(cfg: TrainConfig, found: dict[str, list[SplitMeta]]) -> int | None:
    """The EOS id between two documents when pretraining keeps documents apart
    (`model.attention=document`), from the streams' meta.json; None otherwise (causal over the
    window, or SFT, whose examples are told apart by their segments). ConfigError when the streams
    name different ids."""
    if cfg.model.attention != "document" or cfg.data.kind == "sft":
        return None
    ids = {meta.eos_id: f"data.{split}.{i}" for split in SPLITS for i, meta in enumerate(found[split])}
    if len(ids) > 1:
        (a, first), (b, second) = list(ids.items())[:2]
        raise ConfigError(
            f"{first} separates documents with eos_id={a} but {second} with eos_id={b} (meta.json): with "
            "model.attention=document every stream must share one tokenizer; re-convert one of them"
        )
    return next(iter(ids))


def chat_template_of(cfg: TrainConfig) -> ChatTemplate | None:
    """The chat template of an SFT recipe's shards (from the first train stream's meta.json; the
    streams agree, see `check_streams`); None for pretraining."""
    if cfg.data.kind != "sft":
        return None
    remote = cfg.data.train[0].remote
    return ChatTemplate.from_dict(read_meta(remote).chat_template, f"{join(remote, 'meta.json')}")


def check_meta(meta: SplitMeta, cfg: TrainConfig, where: str, tokenizer: tuple[str, str] | None) -> None:
    """ConfigError naming the stream, both values and the fix when `meta` contradicts `cfg`
    (`tokenizer`: the recipe's tokenizer's kind and sha256, None when not checked)."""
    vocab, model_vocab = meta.vocab_size, cfg.model.vocab_size
    if vocab > model_vocab:
        raise ConfigError(
            f"{where}: the shards' tokenizer has vocab_size={vocab} but model.vocab_size={model_vocab} "
            f"is smaller, so some token ids have no embedding; set model.vocab_size >= {vocab} "
            f"or convert with the recipe's tokenizer"
        )
    seq_len = meta.seq_len
    if seq_len != cfg.model.max_seq_len:
        raise ConfigError(
            f"{where}: the shards hold samples of seq_len={seq_len} tokens but model.max_seq_len="
            f"{cfg.model.max_seq_len}; set model.max_seq_len={seq_len} or re-convert with "
            f"--seq-len {cfg.model.max_seq_len}"
        )
    if cfg.model.attention == "document" and cfg.data.kind != "sft" and meta.eos_id < 0:
        raise ConfigError(
            f"{where}: model.attention=document tells documents apart by their EOS token, but the shards' "
            f"tokenizer has no EOS id (meta.json eos_id={meta.eos_id}); convert with a tokenizer that "
            "has one, or use model.attention=causal"
        )
    if tokenizer is not None and meta.tokenizer_sha256 != tokenizer[1]:
        theirs, ours = meta.tokenizer_kind or SENTENCEPIECE, tokenizer[0]
        made = "a tokenizer" if theirs == ours else describe_kind(theirs)
        given = "has" if theirs == ours else f"is {describe_kind(ours)} of"
        raise ConfigError(
            f"{where}: the shards were tokenized with {made} of sha256 {meta.tokenizer_sha256} but "
            f"tokenizer.path={cfg.tokenizer.path} {given} sha256 {tokenizer[1]}; point "
            f"tokenizer.path at the tokenizer used for conversion, re-convert, or set "
            f"data.check_tokenizer_hash=false if you are sure they are equivalent"
        )


def recipe_tokenizer(path: str) -> tuple[str, str]:
    """(kind, sha256) of the recipe's tokenizer, as the converters record theirs
    (`shards.tokenizer.tokenizer_identity`); ConfigError naming tokenizer.path if it cannot be read."""
    try:
        return tokenizer_identity(path)
    except ShardsError as err:
        raise ConfigError(f"tokenizer.path: {err}") from None
