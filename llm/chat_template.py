"""The chat template on the training and chat side: read it, and turn a user's text into prompt ids.

The template is stated once, in `convert/chat_template.py`, and reaches `llm` as data: each SFT
split's `meta.json` carries it (`chat_template`: `prompt` and `answer` lists of parts, plus the
Unicode `normalization` the converter applied to the texts; convert/FORMAT.md). The trainer
records it in every checkpoint of an SFT run (`llm/callbacks/chat_record.py`, under
`CHAT_TEMPLATE_KEY`),
`llm export` writes it beside an export (`chat_template.json`), and `llm chat` reads it from any
of these, or from `--template` (a split folder, its meta.json, or a JSON file).

Only the prompt side is rendered here: "{prompt}" is the user's text (normalised as the
converter normalised it), "<bos>"/"<eos>" the tokenizer's ids, any other part literal text, each
part tokenized on its own, exactly as `convert.chat_template.TemplateRenderer` does (a test
compares the two). The model then writes the answer parts and stops at EOS.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm.errors import ConfigError
from storage import StorageError, is_remote, join, read_url

CHAT_TEMPLATE_KEY = "llm_chat_template"  # where checkpoints record the template
TEMPLATE_FILE = "chat_template.json"  # beside an HF export
PROMPT = "{prompt}"
NORMALIZATIONS = ("NFKC", "NFC", "NFKD", "NFD", "none")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    prompt: tuple[str, ...]
    answer: tuple[str, ...]
    normalization: str = "none"

    @classmethod
    def from_dict(cls, data: Any, source: str) -> ChatTemplate:
        """A template from its meta.json form; ConfigError naming `source` if it is not one."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the chat template must be an object with prompt and answer lists")
        parts = {}
        for key in ("prompt", "answer"):
            value = data.get(key)
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise ConfigError(
                    f"{source}: the chat template's {key!r} must be a list of non-empty strings"
                )
            parts[key] = tuple(value)
        if parts["prompt"].count(PROMPT) != 1:
            raise ConfigError(f"{source}: the chat template's prompt must hold {PROMPT!r} exactly once")
        normalization = data.get("normalization", "none")
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"{source}: unknown normalization {normalization!r} in the chat template")
        return cls(str(data.get("name", "custom")), parts["prompt"], parts["answer"], normalization)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prompt": list(self.prompt),
            "answer": list(self.answer),
            "normalization": self.normalization,
        }

    def prompt_ids(self, tokenizer, text: str) -> list[int]:
        """The ids fed to the model for the user's `text`; ConfigError if `text` is empty."""
        if self.normalization != "none":
            text = unicodedata.normalize(self.normalization, text)
        text = text.strip()
        if not text:
            raise ConfigError("empty prompt: type a question or an instruction")
        specials = {"<bos>": tokenizer.bos_id, "<eos>": tokenizer.eos_id}
        ids: list[int] = []
        for part in self.prompt:
            if part in specials:
                if specials[part] is None:
                    raise ConfigError(
                        f"the chat template {self.name!r} uses {part}, which tokenizer {tokenizer.path} lacks"
                    )
                ids.append(specials[part])
            else:
                ids += tokenizer.encode(text if part == PROMPT else part)
        return ids


def read_template(source: str) -> ChatTemplate:
    """The template in `source`: an SFT split folder or its meta.json, a JSON file holding the
    template, or an export folder with chat_template.json (local or s3://)."""
    candidates = (
        [source] if source.endswith(".json") else [join(source, "meta.json"), join(source, TEMPLATE_FILE)]
    )
    for candidate in candidates:
        data = _read_json(candidate)
        if data is None:
            continue
        if isinstance(data, dict) and "chat_template" in data:  # a split's meta.json
            return ChatTemplate.from_dict(data["chat_template"], candidate)
        if isinstance(data, dict) and data.get("format") is not None:
            raise ConfigError(
                f"{candidate} holds no chat template: these are pretraining shards; pass the folder of a "
                "split written by `python -m convert sft`"
            )
        return ChatTemplate.from_dict(data, candidate)
    raise ConfigError(
        f"--template {source}: no chat template there; pass an SFT split folder (e.g. data/sft/train), "
        "its meta.json, or a JSON file with prompt and answer lists"
    )


def _read_json(path: str) -> Any:
    """The parsed file, or None if it does not exist; ConfigError if it is not JSON."""
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
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
