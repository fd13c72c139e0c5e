"""Multiple-choice tasks in C-Eval's and CMMLU's published CSV layout, from a folder or `s3://`.

A task is a folder (the name of the task is the folder's name):

    <task>/dev/<subject>.csv       few-shot examples (C-Eval: `<subject>_dev.csv`)
    <task>/val/<subject>.csv       questions with answers (C-Eval: `<subject>_val.csv`)
    <task>/test/<subject>.csv      CMMLU's questions with answers (C-Eval's test split has none)
    <task>/task.json               optional: {"style", "description", "subjects": {name: shown name}}
    <task>/subject_mapping.json    optional, C-Eval's: {name: [English name, Chinese name, category]}

Each CSV has a header row naming `question`, the options `A`, `B` (and `C`, `D`, ...: consecutive
letters) and `answer` (a letter among the options), in any case and order; other columns (C-Eval's
`id` and `explanation`, CMMLU's unnamed index) are ignored. The split evaluated is `val` when the
folder has one, else `test` (or the CSVs at the top of the folder). Files are read through
`storage`, so a task under `s3://bucket/prefix` reads like a local one.

`style` (task.json) decides what is scored: "letter" (the default; C-Eval's and CMMLU's way) lists
the options under the question and scores the letters after "答案："; "cloze" scores each option's
own text as the continuation of the question.

`protocol` (task.json, or `llm eval --protocol`) names how a letter task's prompt is written
(llm/eval/prompts.py): "lm-eval-ceval" and "lm-eval-cmmlu" are lm-eval 0.4.13's stock `ceval-valid`
and `cmmlu` tasks, "compact" is this project's earlier format. Unnamed, a letter task takes
"lm-eval-cmmlu" when its header spells `Question` and `Answer` as CMMLU's CSVs (and lm-eval's cmmlu
task) do, else "lm-eval-ceval". Cells are kept as written (the stock protocols use the option
cells unstripped); `Question.options` holds them stripped for the compact protocol and cloze.

Every question has an id for matching results with another tool's: the CSV's `id` column when it
has one (C-Eval's), else `<file>:<line>`.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from llm.errors import ConfigError
from llm.eval.subjects import CEVAL_SUBJECTS, CMMLU_SUBJECTS
from storage import StorageError, is_remote, join, open_store

EVAL_SPLITS = ("val", "validation", "test")  # the first present is evaluated unless a split is named
DEV_SPLIT = "dev"
STYLES = ("letter", "cloze")
PROTOCOLS = ("lm-eval-ceval", "lm-eval-cmmlu", "compact")  # prompt formats of letter tasks
LAYOUT_HINT = "expected C-Eval/CMMLU's layout: dev/<subject>.csv plus val/ or test/<subject>.csv"


@dataclass(frozen=True)
class Question:
    text: str
    options: tuple[str, ...]
    answer: int  # index into options
    line: int  # line of the CSV it came from, for messages
    id: str = ""  # the CSV's id column, else "<file>:<line>"
    cells: tuple[str, ...] = ()  # the option cells as written (options are these stripped)


@dataclass
class Subject:
    name: str
    shown: str  # the name used in prompts
    questions: list[Question]
    examples: list[Question]  # the dev split: the few-shot pool, in file order
    source: str  # the CSV evaluated


@dataclass
class Task:
    name: str
    root: str
    split: str
    style: str = "letter"
    description: str | None = None  # None: the protocol's default; "{subject}" is replaced
    subjects: list[Subject] = field(default_factory=list)
    protocol: str = "lm-eval-ceval"  # how a letter prompt is written (PROTOCOLS); "cloze" for cloze

    @property
    def num_questions(self) -> int:
        return sum(len(s.questions) for s in self.subjects)


def load_task(
    root: str, split: str | None = None, max_questions: int | None = None, protocol: str | None = None
) -> Task:
    """Read the task folder `root` (local or s3://); ConfigError naming the file and the fix.

    `protocol` overrides task.json's for a letter task (see the module docstring)."""
    root = root.rstrip("/")
    if not is_remote(root) and not Path(root).is_dir():
        raise ConfigError(f"task folder {root} does not exist; {LAYOUT_HINT}")
    store = open_store(root)
    try:
        files = sorted(rel for rel in store.list() if rel.lower().endswith(".csv"))
    except StorageError as err:
        if err.missing:
            raise ConfigError(f"task folder {root} does not exist") from None
        raise
    if not files:
        raise ConfigError(f"task folder {root} holds no CSV files; {LAYOUT_HINT}")
    by_folder: dict[str, list[str]] = {}
    for rel in files:
        folder, _, name = rel.rpartition("/")
        by_folder.setdefault(folder, []).append(name)
    split = _choose_split(root, by_folder, split)
    settings = _read_settings(store, root)
    shown_names = settings.get("subjects", {})
    dev = {_subject_name(n, DEV_SPLIT): n for n in by_folder.get(DEV_SPLIT, [])}
    subjects = []
    cmmlu_header = False
    for name in by_folder[split]:
        subject = _subject_name(name, split)
        source = join(root, f"{split}/{name}" if split else name)
        data = _read(store, f"{split}/{name}" if split else name)
        cmmlu_header = cmmlu_header or _spells_cmmlu_header(data)
        questions = read_questions(source, data)
        examples = []
        if subject in dev:
            dev_source = join(root, f"{DEV_SPLIT}/{dev[subject]}")
            examples = read_questions(dev_source, _read(store, f"{DEV_SPLIT}/{dev[subject]}"))
        if max_questions is not None:
            questions = questions[:max_questions]
        subjects.append(Subject(subject, "", questions, examples, source))
    style = settings.get("style", "letter")
    chosen = _protocol(root, style, protocol or settings.get("protocol"), cmmlu_header)
    known = CMMLU_SUBJECTS | CEVAL_SUBJECTS if chosen != "lm-eval-cmmlu" else CEVAL_SUBJECTS | CMMLU_SUBJECTS
    for s in subjects:
        s.shown = _shown(shown_names.get(s.name), s.name, known)
    return Task(
        name=root.rsplit("/", 1)[-1],
        root=root,
        split=split or "(top)",
        style=style,
        description=settings.get("description"),
        subjects=subjects,
        protocol=chosen,
    )


def _protocol(root: str, style: str, named: str | None, cmmlu_header: bool) -> str:
    if named is not None and named not in PROTOCOLS:
        raise ConfigError(f"{root}: protocol {named!r} is not one of {', '.join(PROTOCOLS)}")
    if style == "cloze":
        return "cloze"
    return named or ("lm-eval-cmmlu" if cmmlu_header else "lm-eval-ceval")


def _spells_cmmlu_header(data: bytes) -> bool:
    """CMMLU's CSVs (and lm-eval's cmmlu task, which reads these names) say Question and Answer."""
    header = next(csv.reader(io.StringIO(data.decode("utf-8-sig", errors="replace"))), [])
    return "Question" in header and "Answer" in header


def read_questions(source: str, data: bytes) -> list[Question]:
    """The questions of one CSV (`source` names it in errors)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{source} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if not rows:
        raise ConfigError(f"{source} is empty (an empty subject): remove the file or fill it")
    columns = _columns(source, rows[0])
    letters = columns["letters"]
    questions = []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line
        if len(row) < len(rows[0]):
            raise ConfigError(
                f"{source}, line {number}: {len(row)} cells but the header has {len(rows[0])}; "
                "quote cells that contain commas or line breaks"
            )
        answer = row[columns["answer"]].strip().upper()
        if not answer:
            raise ConfigError(
                f"{source}, line {number}: no answer (C-Eval's test split publishes none); "
                "evaluate a split with answers, e.g. --split val"
            )
        if answer not in letters:
            raise ConfigError(
                f"{source}, line {number}: answer {answer!r} is not one of the options "
                f"{', '.join(letters)}; fix the answer or add the option's column"
            )
        cells = tuple(row[columns[letter]] for letter in letters)
        given_id = row[columns["id"]].strip() if columns["id"] is not None else ""
        questions.append(
            Question(
                row[columns["question"]].strip(),
                tuple(c.strip() for c in cells),
                letters.index(answer),
                number,
                id=given_id or f"{source.rsplit('/', 1)[-1]}:{number}",
                cells=cells,
            )
        )
    if not questions:
        raise ConfigError(f"{source} has a header but no questions (an empty subject): remove it or fill it")
    return questions


def _columns(source: str, header: list[str]) -> dict:
    """Column positions of question, answer and the option letters (case-insensitive)."""
    names = [cell.strip().lower() for cell in header]
    missing = [n for n in ("question", "a", "b", "answer") if n not in names]
    if missing:
        found = ", ".join(cell.strip() or "(unnamed)" for cell in header)
        raise ConfigError(
            f"{source}: no {', '.join(repr(m.upper() if len(m) == 1 else m) for m in missing)} column "
            f"(found: {found}); the C-Eval/CMMLU layout needs question, A, B, C, D, answer"
        )
    letters = []
    for code in range(ord("a"), ord("z") + 1):
        if chr(code) not in names:
            break
        letters.append(chr(code).upper())
    positions = {
        "question": names.index("question"),
        "answer": names.index("answer"),
        "letters": letters,
        "id": names.index("id") if "id" in names else None,
    }
    positions.update({letter: names.index(letter.lower()) for letter in letters})
    return positions


def _choose_split(root: str, by_folder: dict[str, list[str]], split: str | None) -> str:
    if split is not None:
        if split not in by_folder:
            present = ", ".join(sorted(f or "(top)" for f in by_folder))
            raise ConfigError(f"task folder {root} has no split {split!r} (found: {present}); {LAYOUT_HINT}")
        return split
    for candidate in EVAL_SPLITS:
        if candidate in by_folder:
            return candidate
    if "" in by_folder:
        return ""
    raise ConfigError(
        f"task folder {root} has no val/ or test/ folder (found: {', '.join(sorted(by_folder))}); {LAYOUT_HINT}"
    )


def _subject_name(file_name: str, split: str) -> str:
    stem = file_name[: -len(".csv")]
    suffix = f"_{split}"
    return stem[: -len(suffix)] if split and stem.endswith(suffix) and len(stem) > len(suffix) else stem


def _read(store, rel: str) -> bytes:
    data = store.read_bytes(rel)
    if data is None:
        raise ConfigError(f"{store.url(rel)} disappeared while the task was read")
    return data


def _read_settings(store, root: str) -> dict:
    settings: dict = {}
    for name in ("subject_mapping.json", "task.json"):
        data = store.read_bytes(name)
        if data is None:
            continue
        try:
            loaded = json.loads(data)
        except ValueError as err:
            raise ConfigError(f"{join(root, name)} is not valid JSON ({err})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{join(root, name)} must hold a JSON object")
        if name == "subject_mapping.json":
            settings["subjects"] = loaded
        else:
            unknown = set(loaded) - {"style", "description", "subjects", "protocol"}
            if unknown:
                raise ConfigError(
                    f"{join(root, name)}: unknown key {sorted(unknown)[0]!r}; "
                    "valid: style, description, subjects, protocol"
                )
            settings.update(loaded)
    style = settings.get("style", "letter")
    if style not in STYLES:
        raise ConfigError(f"{join(root, 'task.json')}: style {style!r} is not one of {', '.join(STYLES)}")
    return settings


def _shown(mapped, subject: str, known: dict[str, str]) -> str:
    """The subject's name in prompts: task.json's string, C-Eval's [English, Chinese, category], the
    benchmarks' own Chinese name (llm/eval/subjects.py), else the file's name with spaces."""
    if isinstance(mapped, str) and mapped:
        return mapped
    if isinstance(mapped, list) and mapped:
        return str(mapped[1] if len(mapped) > 1 else mapped[0])
    return known.get(subject) or subject.replace("_", " ")
