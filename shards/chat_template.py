"""The chat templates: how a prompt and its answer become one token sequence, stated once, here.

A template is two lists of parts, `prompt` and `answer`. Each part is one of
  "{prompt}" / "{answer}"   the user's text / the answer's text, tokenized on its own;
  "<bos>" / "<eos>"         the tokenizer's BOS / EOS id;
  any other string          literal text, tokenized on its own.
The sample is the prompt parts followed by the answer parts. The model learns the answer parts
(loss mask 1 on each of their tokens, the closing EOS included) and is given the prompt parts
(mask 0). At chat time the prompt parts are fed and the model writes the answer parts, stopping at
EOS. `prompt` holds exactly one "{prompt}" and `answer` exactly one "{answer}". A template also
names the Unicode `normalization` the converter applied to the texts, so chat input is
normalised the same way.

The default, `baby-llama2`, is baby-llama2-chinese's SFT layout, `prompt_ids + [bos] +
answer_ids + [eos]`, so models fine-tuned by that project chat the same way here.

The converter renders whole samples (`TemplateRenderer`) and writes the template into every SFT
split's `meta.json` (key `chat_template`, shards/FORMAT.md); the trainer reads it from there,
records it in its checkpoints (under `CHAT_TEMPLATE_KEY`), `llm export` writes it beside an export
(`TEMPLATE_FILE`), and `llm chat` renders prompts with it (`ChatTemplate.prompt_ids`), read from
any of these or from a JSON file (`read_template`).
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shards.errors import ShardsError
from storage import StorageError, is_remote, join, read_url

PROMPT, ANSWER = "{prompt}", "{answer}"
SPECIALS = ("<bos>", "<eos>")
NORMALIZATIONS = ("NFKC", "NFC", "NFKD", "NFD", "none")
CHAT_TEMPLATE_KEY = "llm_chat_template"  # where checkpoints record the template
TEMPLATE_FILE = "chat_template.json"  # beside an HF export

TEMPLATES: dict[str, dict] = {
    # baby-llama2-chinese: prompt_ids + [bos] + answer_ids + [eos]
    "baby-llama2": {"prompt": [PROMPT, "<bos>"], "answer": [ANSWER, "<eos>"]},
    # Alpaca's section headers, for corpora written for that layout
    "alpaca": {
        "prompt": ["<bos>", "### Instruction:\n", PROMPT, "\n\n### Response:\n"],
        "answer": [ANSWER, "<eos>"],
    },
}
DEFAULT_TEMPLATE = "baby-llama2"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    prompt: tuple[str, ...]
    answer: tuple[str, ...]
    normalization: str = "none"

    @classmethod
    def from_dict(cls, data: Any, source: str, default_name: str = "custom") -> ChatTemplate:
        """A template from its meta.json / checkpoint / JSON form; ShardsError naming `source`."""
        if not isinstance(data, dict):
            raise ShardsError(f"{source}: the chat template must be an object with prompt and answer lists")
        parts = {}
        for key, placeholder in (("prompt", PROMPT), ("answer", ANSWER)):
            value = data.get(key)
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise ShardsError(f"{source}: {key!r} must be a list of non-empty strings")
            if value.count(placeholder) != 1:
                raise ShardsError(
                    f"{source}: {key!r} must hold {placeholder!r} exactly once, as a part of its own"
                )
            other = ANSWER if key == "prompt" else PROMPT
            if any(other in p or (placeholder in p and p != placeholder) for p in value):
                raise ShardsError(
                    f"{source}: {key!r} may hold {placeholder!r} only as a part of its own, and never {other!r}"
                )
            parts[key] = tuple(value)
        normalization = data.get("normalization", "none")
        if normalization not in NORMALIZATIONS:
            raise ShardsError(
                f"{source}: unknown normalization {normalization!r} in the chat template; use one of "
                f"{', '.join(NORMALIZATIONS)}"
            )
        return cls(str(data.get("name") or default_name), parts["prompt"], parts["answer"], normalization)

    def to_dict(self) -> dict[str, Any]:
        """What meta.json, checkpoints and exports record."""
        return {
            "name": self.name,
            "prompt": list(self.prompt),
            "answer": list(self.answer),
            "normalization": self.normalization,
        }

    def normalized(self, normalization: str) -> ChatTemplate:
        return replace(self, normalization=normalization)

    def prompt_ids(self, tokenizer, text: str) -> list[int]:
        """The ids fed to the model for the user's `text` (normalised as the converter normalised
        the prompts); ShardsError if `text` is empty."""
        if self.normalization != "none":
            text = unicodedata.normalize(self.normalization, text)
        text = text.strip()
        if not text:
            raise ShardsError("empty prompt: type a question or an instruction")
        return TemplateRenderer(self, tokenizer).prompt_ids(tokenizer.encode(text))


class TemplateRenderer:
    """Token ids of the template's fixed parts for one tokenizer, and whole examples built from them."""

    def __init__(self, template: ChatTemplate, tokenizer) -> None:
        specials = {"<bos>": tokenizer.bos_id, "<eos>": tokenizer.eos_id}
        self.template = template

        def fixed(part: str) -> list[int]:
            if part in specials:
                if specials[part] is None:
                    raise ShardsError(
                        f"the chat template {template.name!r} uses {part}, which tokenizer {tokenizer.path} "
                        "lacks; choose another --template"
                    )
                return [specials[part]]
            return tokenizer.encode(part)

        # Each side as (ids before the text, ids after it).
        self.prompt_parts = _around(template.prompt, PROMPT, fixed)
        self.answer_parts = _around(template.answer, ANSWER, fixed)
        self.fixed_tokens = sum(len(ids) for pair in (self.prompt_parts, self.answer_parts) for ids in pair)

    def prompt_ids(self, prompt_ids: list[int]) -> list[int]:
        before, after = self.prompt_parts
        return [*before, *prompt_ids, *after]

    def answer_ids(self, answer_ids: list[int]) -> list[int]:
        before, after = self.answer_parts
        return [*before, *answer_ids, *after]


def _around(parts: tuple[str, ...], placeholder: str, fixed) -> tuple[list[int], list[int]]:
    at = parts.index(placeholder)
    before = [i for part in parts[:at] for i in fixed(part)]
    after = [i for part in parts[at + 1 :] for i in fixed(part)]
    return before, after


def read_template(source: str) -> ChatTemplate:
    """The template `source` names: a built-in template's name, an SFT split folder or its
    meta.json, an export folder with chat_template.json, or a JSON file holding a template
    (local or s3://)."""
    if source in TEMPLATES:
        return ChatTemplate.from_dict({"name": source, **TEMPLATES[source]}, f"template {source}")
    for candidate in _candidates(source):
        data = _read_json(candidate)
        if data is None:
            continue
        if isinstance(data, dict) and "chat_template" in data:  # a split's meta.json
            return ChatTemplate.from_dict(data["chat_template"], candidate)
        if isinstance(data, dict) and data.get("format") is not None:
            raise ShardsError(
                f"{candidate} holds no chat template: these are pretraining shards; pass the folder of a "
                "split written by `python -m convert sft`"
            )
        return ChatTemplate.from_dict(data, f"--template {candidate}", default_name=Path(candidate).stem)
    raise ShardsError(
        f"--template {source}: no chat template there; pass a built-in template ({', '.join(TEMPLATES)}), "
        "an SFT split folder (e.g. data/sft/train), its meta.json, or a JSON file such as "
        '{"prompt": ["{prompt}", "<bos>"], "answer": ["{answer}", "<eos>"]}'
    )


def _candidates(source: str) -> list[str]:
    if source.endswith(".json") or (not is_remote(source) and Path(source).is_file()):
        return [source]
    return [join(source, "meta.json"), join(source, TEMPLATE_FILE)]


def _read_json(path: str) -> Any:
    """The parsed file, or None if it does not exist; ShardsError if it is not JSON."""
    try:
        if is_remote(path):
            raw = read_url(path)
        else:
            if not Path(path).is_file():
                return None
            raw = Path(path).read_bytes()
    except StorageError as err:
        if err.missing:
            return None
        raise
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ShardsError(f"{path} is not valid JSON ({err})") from None
