"""Record layouts of the five corpora baby-llama2-chinese trains on.

A preset says how a file is laid out (`fmt`: a JSON list or JSON lines) and how to pull the
text out of one record; `chinese` says its text is Chinese (then `--filters` also asks for a
share of CJK characters, `QualityFilters.recommended`). `extract` returns None when a record
has no usable text field at all (the reader counts it as malformed); an empty string is returned
as is and left to the cleaner, which drops it as "empty".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from convert.errors import ConvertError


@dataclass(frozen=True)
class Preset:
    name: str
    fmt: str
    description: str
    extractor: Callable[[dict], str | None] = field(repr=False, compare=False)
    chinese: bool = False

    def extract(self, obj: dict) -> str | None:
        """The text of one record, or None if the record has no usable text."""
        return self.extractor(obj)


def _string(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    return value if isinstance(value, str) else None


def _field(key: str) -> Callable[[dict], str | None]:
    return lambda obj: _string(obj, key)


def _baidubaike(obj: dict) -> str | None:
    """title, summary, then each section's title and content, one per line; gaps tolerated."""
    parts = [_string(obj, "title"), _string(obj, "summary")]
    sections = obj.get("sections")
    for section in sections if isinstance(sections, list) else []:
        if isinstance(section, dict):
            parts += [_string(section, "title"), _string(section, "content")]
    text = "\n".join(p.strip() for p in parts if p and p.strip())
    return text or None


def _wudao(obj: dict) -> str | None:
    """title + newline + content; the content is required, a missing title is tolerated."""
    content = _string(obj, "content")
    if content is None:
        return None
    title = (_string(obj, "title") or "").strip()
    return f"{title}\n{content}" if title else content


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "wiki-cn",
            "json",
            "Chinese Wikipedia (wikipedia-cn-20230720-filtered.json): a JSON list of {completion}",
            _field("completion"),
            chinese=True,
        ),
        Preset(
            "baidubaike",
            "jsonl",
            "563w_baidubaike.json: JSON lines of {title, summary, sections: [{title, content}]}",
            _baidubaike,
            chinese=True,
        ),
        Preset(
            "c4-zh", "jsonl", "C4 Chinese (c4_zh_*.json): JSON lines of {text}", _field("text"), chinese=True
        ),
        Preset(
            "wudao",
            "json",
            "WuDaoCorpus2.0_base_200G/*.json: JSON lists (or lines) of {title, content}",
            _wudao,
            chinese=True,
        ),
        Preset(
            "medical",
            "jsonl",
            "shibing624/medical pretrain set (train_encyclopedia.json etc.): JSON lines of {text}",
            _field("text"),
            chinese=True,
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(PRESETS)
        raise ConvertError(f"unknown preset {name!r}; valid presets: {valid}") from None
