"""Write small fixture corpora of real Chinese text in every input format and preset layout; real
English text for what must work in any language (`english_documents`).

Each writer takes documents (e.g. `peoples_daily_documents()[:20]`), writes them in one layout
and returns the texts a correct reader must yield from that file, in order. Preset writers
split each article into the parts the real corpus has (title, summary, sections, ...), so the
returned texts are what the preset must reassemble.
"""

from __future__ import annotations

import json
from pathlib import Path


def _write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _first_line_and_rest(doc: str) -> tuple[str, str]:
    title, _, rest = doc.partition("\n")
    return title, rest or title


def english_documents(count: int = 200, min_chars: int = 200) -> list[str]:
    """Real English prose: the longest docstrings of the standard library's modules (in name order),
    at least `min_chars` characters each. Nothing is downloaded."""
    import ast
    import sysconfig

    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= min_chars:
                    found.append(text)
        if len(found) >= count:
            break
    return list(dict.fromkeys(found))[:count]


# --- plain formats -----------------------------------------------------------------------------


def write_txt(path: str | Path, docs: list[str]) -> list[str]:
    """One document per line: each document's lines are joined with a full-width space."""
    lines = ["\u3000".join(doc.splitlines()) for doc in docs]
    _write_text(path, "".join(line + "\n" for line in lines))
    return lines


def write_txt_blank(path: str | Path, docs: list[str]) -> list[str]:
    """Documents separated by blank lines (sometimes two, and CRLF endings in one of them)."""
    parts = []
    for i, doc in enumerate(docs):
        parts.append(doc.replace("\n", "\r\n") if i == 1 else doc)
        parts.append("\n\n\n" if i % 3 == 2 else "\n\n")
    _write_text(path, "".join(parts))
    return list(docs)


def write_json_list(path: str | Path, docs: list[str], field: str = "text") -> list[str]:
    """A pretty-printed JSON list of {field: doc, "id": i}."""
    records = [{"id": i, field: doc} for i, doc in enumerate(docs)]
    _write_text(path, json.dumps(records, ensure_ascii=False, indent=2))
    return list(docs)


def write_jsonl(path: str | Path, docs: list[str], field: str = "text") -> list[str]:
    _write_text(path, "".join(_json_line({"id": i, field: doc}) for i, doc in enumerate(docs)))
    return list(docs)


def write_parquet(path: str | Path, texts: list[str | None], *, row_group_size: int, **options) -> Path:
    """Real Parquet written by pyarrow, the same texts (None: a null) in several columns, each a
    way corpora store text: `text` (string), `content.text` (a struct's field, beside
    `content.lang`), `dict_text` (dictionary-encoded), `large_text` (large_string); and `id`
    (int64, not text). `options` go to `pyarrow.parquet.write_table` (compression, ...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = len(texts)
    content = pa.StructArray.from_arrays([pa.array(texts), pa.array(["zh"] * count)], names=["text", "lang"])
    table = pa.table({
        "id": pa.array(range(count), type=pa.int64()),
        "text": pa.array(texts, type=pa.string()),
        "content": content,
        "dict_text": pa.array(texts, type=pa.string()).dictionary_encode(),
        "large_text": pa.array(texts, type=pa.large_string()),
    })  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size, **options)
    return path


# --- preset layouts ----------------------------------------------------------------------------


def write_wiki_cn(path: str | Path, docs: list[str]) -> list[str]:
    """wikipedia-cn-20230720-filtered.json: a JSON list of {"completion", "source"}."""
    records = [{"completion": doc, "source": "wikipedia.zh2307"} for doc in docs]
    _write_text(path, json.dumps(records, ensure_ascii=False, indent=4))
    return list(docs)


def write_baidubaike(path: str | Path, docs: list[str]) -> list[str]:
    """563w_baidubaike.json: JSON lines of {title, summary, sections: [{title, content}]}.

    Every third record has a null summary, and one section per record lacks a title, as in
    the real data; the expected text skips the missing parts.
    """
    expected, lines = [], []
    for i, doc in enumerate(docs):
        title, *body = doc.splitlines()
        summary = None if i % 3 == 0 or not body else body[0]
        rest = body if summary is None else body[1:]
        sections = [{"title": f"第{j + 1}节" if j else None, "content": text} for j, text in enumerate(rest)]
        lines.append(_json_line({"title": title, "summary": summary, "sections": sections, "tags": []}))
        parts = [title] + ([summary] if summary else [])
        for section in sections:
            parts += [p for p in (section["title"], section["content"]) if p]
        expected.append("\n".join(parts))
    _write_text(path, "".join(lines))
    return expected


def write_c4_zh(path: str | Path, docs: list[str]) -> list[str]:
    """c4_zh_*.json: JSON lines of {"text", "timestamp", "url"}."""
    records = [
        {"text": doc, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.cn/{i}"}
        for i, doc in enumerate(docs)
    ]
    _write_text(path, "".join(_json_line(r) for r in records))
    return list(docs)


def write_medical(path: str | Path, docs: list[str]) -> list[str]:
    """shibing624/medical pretrain (train_encyclopedia.json): JSON lines of {"text"}."""
    _write_text(path, "".join(_json_line({"text": doc}) for doc in docs))
    return list(docs)


def write_wudao(path: str | Path, docs: list[str]) -> list[str]:
    """WuDaoCorpus2.0_base_200G/part-*.json: a JSON list of {id, uniqueKey, titleUkey, dataType, title, content}."""
    records, expected = [], []
    for i, doc in enumerate(docs):
        title, content = _first_line_and_rest(doc)
        records.append(
            {
                "id": i,
                "uniqueKey": f"u{i}",
                "titleUkey": f"t{i}",
                "dataType": "新闻",
                "title": title,
                "content": content,
            }
        )
        expected.append(f"{title}\n{content}")
    _write_text(path, json.dumps(records, ensure_ascii=False))
    return expected


PRESET_WRITERS = {
    "wiki-cn": write_wiki_cn,
    "baidubaike": write_baidubaike,
    "c4-zh": write_c4_zh,
    "wudao": write_wudao,
    "medical": write_medical,
}


# --- near-duplicates ---------------------------------------------------------------------------


def edited_copy(text: str, share: float, seed: int) -> str:
    """`text` with about `share` of its characters replaced, one at a time, by other characters of
    the text itself (a near-duplicate whose similarity falls as `share` grows)."""
    import random

    rng = random.Random(seed)
    chars = list(text)
    for _ in range(max(1, round(share * len(chars)))):
        chars[rng.randrange(len(chars))] = rng.choice(text)
    return "".join(chars)
