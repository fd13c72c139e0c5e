"""The recipe reference (docs/config.md, `llm config`): every key of the schema, written from the code.

Each key's row says its type, default, range, meaning, and whether a resumed run takes a changed
value. All of it is read from the code, so the page cannot drift from it:
- type and default: the dataclasses of `llm/config.py` (the `model:` section's shape fields are
  `llm.model.ModelConfig`'s);
- range: the field's `bounded(...)` metadata (`Bounds.says`);
- meaning: the comment beside the field in the schema, on its line or on the comment lines right
  above it (`field_comments`). Neither dataclasses nor OmegaConf keep comments, so they are read
  from the source with the standard library's `tokenize` and `ast`; a docstring per field would
  double the schema's length. A section's intro is its class docstring;
- on resume: `llm.checkpoint.resume`'s `FROM_CHECKPOINT` and `NOT_COMPARED`, the rules a resume
  applies to a changed recipe.

After changing the schema, regenerate the page: `llm config --out docs/config.md`
(tests/llm/test_config_reference.py fails while the page is stale, or while a key has no comment).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from llm.checkpoint.resume import FROM_CHECKPOINT, NOT_COMPARED
from llm.config import TrainConfig

REGENERATE = "llm config --out docs/config.md"
# FROM_CHECKPOINT's words for a key whose new value a resume takes (as for a key it does not name)
APPLIES = "the recipe's new value applies from the resume point on"


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key's row of the reference."""

    key: str  # dotted, as an override writes it; a list item's keys relative to the item
    type: str
    default: str
    bounds: str
    meaning: str
    resume: str  # "yes", or the rule a resume applies instead


@dataclass(frozen=True)
class Section:
    """A heading of the reference: a dataclass of the schema and its keys (its sub-sections apart)."""

    name: str  # dotted path: "training.float8"; "" for the top level
    intro: str
    keys: list[KeyDoc]
    item_of: str = ""  # for a list's items: the list keys (data.train, data.eval)


def sections(root: type = TrainConfig) -> list[Section]:
    """Every section of the schema, depth first, in declaration order."""
    found: list[Section] = []
    _walk(root, "", found, item_of="")
    return found


def all_keys(root: type = TrainConfig) -> list[KeyDoc]:
    return [key for section in sections(root) for key in section.keys]


def _walk(cls: type, prefix: str, found: list[Section], item_of: str) -> None:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    here = Section(prefix.rstrip("."), _intro(cls), [], item_of)
    found.append(here)
    later: list[tuple[type, str, str]] = []
    items: dict[type, list[str]] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(kind):
            later.append((kind, key + ".", ""))
            continue
        item = _list_item(kind)
        if item is not None:
            items.setdefault(item, []).append(key)
        bounds = f.metadata.get("bounds")
        here.keys.append(
            KeyDoc(
                key=key if not item_of else f.name,
                type=type_name(kind),
                default=_default(f),
                bounds=bounds.says() if bounds else "",
                meaning=comments.get(f.name, ""),
                resume=on_resume(key if not item_of else f"{item_of.split(', ')[0]}.{f.name}"),
            )
        )
    for kind, lists in items.items():
        _walk(kind, f"{lists[0]}.N.", found, item_of=", ".join(lists))
    for kind, key, _ in later:
        _walk(kind, key, found, item_of)


def _list_item(kind: Any) -> type | None:
    """The dataclass a list field holds (data.train's streams), if any."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return item if dataclasses.is_dataclass(item) else None
    return None


def _intro(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclasses' generated signature: no docstring
        return ""
    return " ".join(inspect.cleandoc(doc).split())


# --- the meaning: the comment beside each field ------------------------------------------------


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment, for `cls` and the classes it inherits fields from: the comment
    lines right above the field (no blank line between) then the comment on its own line(s)."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base) and base is not object:
            found |= _own_comments(base)
    return found


def _own_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and not tok.string.lstrip("#").strip().startswith("fmt:")
    }
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    found = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(part for part in above + beside if part)
        if text:
            found[node.target.id] = text
    return found


# --- types, defaults, resume -----------------------------------------------------------------


def type_name(kind: Any) -> str:
    """`int | None` -> "int or null", `list[str]` -> "list of string", `tuple[float, float]` -> "2 x float"."""
    names = {int: "int", float: "float", str: "string", bool: "bool"}
    if kind in names:
        return names[kind]
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        parts = [type_name(a) for a in typing.get_args(kind) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(kind) else "")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        return "list of mappings" if dataclasses.is_dataclass(args[0]) else f"list of {type_name(args[0])}"
    if origin is tuple:
        return f"{len(args)} x {type_name(args[0])}"
    if dataclasses.is_dataclass(kind):
        return "mapping"
    return getattr(kind, "__name__", str(kind))


def _default(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "required"
    return yaml_value(value)


def yaml_value(value: Any) -> str:
    """A default as a recipe writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return str(value)


def on_resume(key: str) -> str:
    """Whether a resumed run takes a changed value of `key` ("yes"), else the rule it applies
    (`llm.checkpoint.resume.warn_recipe_changes`'s, first matching prefix)."""
    if key.startswith(NOT_COMPARED):
        return "yes"
    rule = next((v for k, v in FROM_CHECKPOINT.items() if key == k or key.startswith(k)), None)
    return "yes" if rule in (None, APPLIES) else rule


# --- the page ----------------------------------------------------------------------------------


def render(root: type = TrainConfig, only: str = "") -> str:
    """docs/config.md: every section's keys as a table (`only`: the keys starting with it)."""
    found = [s for s in sections(root) if any(_wanted(s, k, only) for k in s.keys)]
    rules = _resume_rules(found)
    out = [
        "# Recipe reference",
        "",
        "Every key a recipe (`recipes/*.yaml`, or `key=value` overrides) can set: its type, default, "
        "range and meaning, and whether a resumed run takes a changed value. Written from the schema "
        "(llm/config.py) by `llm config`, so it cannot drift from the code: edit the comment beside "
        f"a field there, not this page, then regenerate it with `{REGENERATE}`. A recipe to start "
        "from: [recipes/template.yaml](../recipes/template.yaml). Back to the "
        "[README](../README.md#train).",
        "",
        "- default `required`: the recipe must set it; a `${...}` default is resolved at load "
        "(`${run_name}`, `${oc.env:VAR,default}`).",
        "- resume: `yes` when a resumed run takes the recipe's new value from the resume point on; "
        + "; ".join(f"{mark}: {text}" for text, mark in rules.items())
        + ". Keys under "
        + ", ".join(f"`{p.rstrip('.')}`" for p in NOT_COMPARED)
        + " are not compared with the checkpoint's recipe.",
        "",
        "Sections: " + " · ".join(f"[{_title(s)}](#{_anchor(s)})" for s in found),
    ]
    for s in found:
        out += ["", f"## {_title(s)}", ""]
        if s.item_of:
            out += [f"Each item of {_code_list(s.item_of)} (N = 0, 1, ...: its place in the list).", ""]
        if s.intro:
            out += [s.intro, ""]
        out += [
            "| key | type | default | range | meaning | resume |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for k in s.keys:
            if _wanted(s, k, only):
                cells = [
                    f"`{k.key}`",
                    k.type,
                    f"`{k.default}`",
                    k.bounds,
                    k.meaning,
                    rules.get(k.resume, k.resume),
                ]
                out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def _wanted(s: Section, k: KeyDoc, only: str) -> bool:
    full = f"{s.name}.{k.key}" if s.item_of else k.key
    return (
        not only
        or full.startswith(only)
        or (s.item_of and any(p.startswith(only) for p in s.item_of.split(", ")))
    )


def _resume_rules(found: list[Section]) -> dict[str, str]:
    """Each rule other than "yes" that a key of `found` has -> its mark in the table."""
    texts = list(dict.fromkeys(k.resume for s in found for k in s.keys if k.resume != "yes"))
    return {text: f"no ({i})" for i, text in enumerate(texts, 1)}


def _title(s: Section) -> str:
    return s.name or "top level"


def _anchor(s: Section) -> str:
    return "".join(c for c in _title(s).lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _code_list(keys: str) -> str:
    return " and ".join(f"`{k}`" for k in keys.split(", "))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
