"""Prompt/answer records out of SFT files: JSON lists, JSON lines and CSV, local or s3://.

Where a record keeps its prompt and answer is an `SftLayout`: a preset's (`--preset alpaca`,
`belle`, `baby-llama2`) or the fields given (`--prompt-field`, `--answer-field`, `--input-field`).
JSON records go through the corpus reader (convert/reading/readers.py `read_json_records`); CSV
is read here. A record without the prompt or the answer field is malformed: counted in
`ReadStats` with its file and line, or refused with `strict`; a CSV whose header lacks the
columns is refused in one line.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from convert.errors import ConvertError
from convert.reading.readers import AUTO, ReadStats, read_json_records
from convert.reading.sources import open_binary

FORMATS = ("json", "jsonl", "csv")


@dataclass(frozen=True)
class SftLayout:
    """Where a record keeps its prompt and answer."""

    fmt: str = AUTO  # auto | json | jsonl | csv
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    input_field: str | None = None  # Alpaca's "input": added to the prompt after a newline when not empty


PRESETS = {
    # alpaca_data_zh / alpaca_gpt4_data_zh and shibing624/medical's finetune files: a JSON list
    # (or JSON lines) of {"instruction", "input", "output"}.
    "alpaca": SftLayout(AUTO, "instruction", "output", "input"),
    # BelleGroup's releases (Belle_open_source_1M.json, school_math_0.25M.json): JSON lines of the
    # same fields.
    "belle": SftLayout(AUTO, "instruction", "output", "input"),
    # baby-llama2-chinese's sft_data.csv: a header `prompt,answer`, one pair per row.
    "baby-llama2": SftLayout("csv", "prompt", "answer"),
}


def layout_for(
    preset: str | None,
    fmt: str = AUTO,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    input_field: str | None = None,
) -> SftLayout:
    """The layout of a preset, or of the given fields (not both); ConvertError naming the fix."""
    given = {"--prompt-field": prompt_field, "--answer-field": answer_field, "--input-field": input_field}
    if preset is not None:
        if preset not in PRESETS:
            raise ConvertError(f"unknown --preset {preset!r}; use one of: {', '.join(PRESETS)}")
        named = [flag for flag, value in given.items() if value]
        if named:
            raise ConvertError(f"--preset {preset} fixes the fields; drop {named[0]}")
        base = PRESETS[preset]
        return base if fmt == AUTO else SftLayout(fmt, base.prompt_field, base.answer_field, base.input_field)
    if fmt not in (AUTO, *FORMATS):
        raise ConvertError(
            f"unknown --format {fmt!r} for SFT records; use one of: {', '.join(FORMATS)}, auto"
        )
    return SftLayout(fmt, prompt_field or "prompt", answer_field or "answer", input_field or None)


class Pair(NamedTuple):
    prompt: str
    answer: str
    source: str
    line: int


def read_pairs(paths: list[str], layout: SftLayout, *, strict: bool, stats: ReadStats) -> Iterator[Pair]:
    """The prompt/answer pairs of every file, in order; bad records counted in `stats`."""
    for path in paths:
        fmt = _format_of(path, layout.fmt)
        if fmt == "csv":
            yield from _read_csv(path, layout, strict, stats)
            continue
        extract = _extractor(layout)
        for doc in read_json_records(path, fmt, extract, strict=strict, stats=stats):
            prompt, answer = doc.text
            yield Pair(prompt, answer, doc.source, doc.line)


def _format_of(path: str, fmt: str) -> str:
    if fmt != AUTO:
        return fmt
    name = path.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "csv"
    if name.endswith((".json", ".jsonl", ".json-lines", ".jsonlines", ".ndjson")):
        return AUTO  # the JSON reader tells a list from lines by the first character
    raise ConvertError(
        f"cannot tell the format of {path} from its name; pass --format ({', '.join(FORMATS)})"
    )


def _extractor(layout: SftLayout):
    def extract(obj: object) -> tuple[tuple[str, str] | None, str]:
        if not isinstance(obj, dict):
            return None, "expected a JSON object with the prompt and answer fields"
        texts = []
        for name, role in ((layout.prompt_field, "prompt"), (layout.answer_field, "answer")):
            value = obj.get(name)
            if value is None:
                fields = ", ".join(map(str, list(obj)[:6])) or "none"
                return (
                    None,
                    f"no {role} field {name!r} (its fields: {fields}); set --{role}-field or --preset",
                )
            if not isinstance(value, str):
                return None, f"the {role} field {name!r} is not a string"
            texts.append(value)
        extra = obj.get(layout.input_field) if layout.input_field else None
        if isinstance(extra, str) and extra.strip():
            texts[0] = f"{texts[0]}\n{extra}"
        return (texts[0], texts[1]), ""

    return extract


def _read_csv(path: str, layout: SftLayout, strict: bool, stats: ReadStats) -> Iterator[Pair]:
    stats.files += 1
    with open_binary(path) as raw:
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if path.lower().endswith(".gz") else raw
        text = io.TextIOWrapper(binary, encoding="utf-8-sig", errors="strict", newline="")
        rows = csv.reader(text)
        try:
            header = next(rows, None)
        except (UnicodeDecodeError, csv.Error) as err:
            raise ConvertError(f"{path}: cannot read the CSV header ({err})") from None
        needed = [layout.prompt_field, layout.answer_field]
        if header is None or any(name not in header for name in needed):
            shown = ",".join(header or []) or "nothing"
            raise ConvertError(
                f"{path}: the CSV header is {shown!r} but the columns {needed[0]!r} and {needed[1]!r} are needed; "
                "fix the header or pass --prompt-field/--answer-field"
            )
        columns = {name: header.index(name) for name in needed}
        extra = header.index(layout.input_field) if layout.input_field in header else None
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except (UnicodeDecodeError, csv.Error) as err:
                _malformed(stats, strict, path, rows.line_num, f"unreadable CSV ({err}); the rest is skipped")
                return
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                _malformed(
                    stats, strict, path, rows.line_num, f"{len(row)} fields, the header has {len(header)}"
                )
                continue
            stats.documents += 1
            prompt, answer = row[columns[needed[0]]], row[columns[needed[1]]]
            if extra is not None and row[extra].strip():
                prompt = f"{prompt}\n{row[extra]}"
            yield Pair(prompt, answer, path, rows.line_num)


def _malformed(stats: ReadStats, strict: bool, path: str, line: int, reason: str) -> None:
    if strict:
        raise ConvertError(f"{path}:{line}: {reason}; fix the line or drop --strict")
    stats.record_malformed(path, line, reason)
