"""The chat templates: how a prompt and its answer become one token sequence, stated once, here.

A template is two lists of parts, `prompt` and `answer`. Each part is one of
  "{prompt}" / "{answer}"   the user's text / the answer's text, tokenized on its own;
  "<bos>" / "<eos>"         the tokenizer's BOS / EOS id;
  any other string          literal text, tokenized on its own.
The sample is the prompt parts followed by the answer parts. The model learns the answer parts
(loss mask 1 on each of their tokens, the closing EOS included) and is given the prompt parts
(mask 0). At chat time the prompt parts are fed and the model writes the answer parts, stopping at
EOS. `prompt` holds exactly one "{prompt}" and `answer` exactly one "{answer}".

The default, `baby-llama2`, is baby-llama2-chinese's SFT layout, `prompt_ids + [bos] +
answer_ids + [eos]`, so models fine-tuned by that project chat the same way here.

Why the template lives in `convert` and travels in meta.json: the converter must render whole
samples (prompt and answer, with the loss mask), while the trainer and `llm chat` only render
prompts, and `llm` may not import `convert` (docs/architecture.md). So the template is stated
here, written into every SFT split's `meta.json` (key `chat_template`, convert/FORMAT.md), and
`llm` reads it from there (training, the generation callback), from the checkpoints the trainer
writes (it records the template in them), or from a file given to `llm chat --template`.
`llm/chat_template.py` interprets the same parts for prompts; tests/test_sft_convert.py checks
that both sides give the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from convert.errors import ConvertError

PROMPT, ANSWER = "{prompt}", "{answer}"
SPECIALS = ("<bos>", "<eos>")

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

    def as_meta(self) -> dict:
        """What meta.json records (`chat_template`)."""
        return {"name": self.name, "prompt": list(self.prompt), "answer": list(self.answer)}


def get_template(name_or_path: str) -> ChatTemplate:
    """A built-in template by name, or one read from a JSON file `{"prompt": [...], "answer": [...]}`."""
    if name_or_path in TEMPLATES:
        return _checked(name_or_path, TEMPLATES[name_or_path], "template")
    path = Path(name_or_path)
    if not path.is_file():
        raise ConvertError(
            f"--template {name_or_path!r} is neither a built-in template ({', '.join(TEMPLATES)}) nor a "
            'JSON file such as {"prompt": ["{prompt}", "<bos>"], "answer": ["{answer}", "<eos>"]}'
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise ConvertError(f"--template {path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"--template {path}: expected a JSON object with prompt and answer lists")
    return _checked(str(data.get("name") or path.stem), data, f"--template {path}")


def _checked(name: str, data: dict, where: str) -> ChatTemplate:
    parts = {}
    for key, placeholder in (("prompt", PROMPT), ("answer", ANSWER)):
        value = data.get(key)
        if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
            raise ConvertError(f"{where}: {key!r} must be a list of non-empty strings")
        if value.count(placeholder) != 1:
            raise ConvertError(
                f"{where}: {key!r} must hold {placeholder!r} exactly once, as a part of its own"
            )
        other = ANSWER if key == "prompt" else PROMPT
        if any(other in p or (placeholder in p and p != placeholder) for p in value):
            raise ConvertError(
                f"{where}: {key!r} may hold {placeholder!r} only as a part of its own, and never {other!r}"
            )
        parts[key] = tuple(value)
    return ChatTemplate(name=name, prompt=parts["prompt"], answer=parts["answer"])


class TemplateRenderer:
    """Token ids of the template's fixed parts for one tokenizer, and whole examples built from them."""

    def __init__(self, template: ChatTemplate, processor, *, bos_id: int, eos_id: int) -> None:
        specials = {"<bos>": bos_id, "<eos>": eos_id}
        self.template = template

        def fixed(part: str) -> list[int]:
            if part in specials:
                if specials[part] < 0:
                    raise ConvertError(
                        f"chat template {template.name!r} uses {part} but the tokenizer has none; "
                        "choose another --template"
                    )
                return [specials[part]]
            return list(processor.encode(part))

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
