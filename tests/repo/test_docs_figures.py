"""Figures the docs quote from a command are that command's current output (issue 36, item 14: the
README's SFT padding figure was not what `make demo-sft` printed, and `convert/demo/sft.py` gave the
wrong share of 正面).

A page marks a quote with `<!-- output of: COMMAND -->` on the line before a fenced block; each is
run here, in-process, and every line of the quote (with `...` for what changes from run to run)
must be a line of what it prints, in order. The demo's data comes from the Makefile's own commands.
Figures that need minutes of training are not quoted this way: docs/benchmarks.md gives their
command, date and machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import docs
from tests.support.paths import REPO

MAKEFILE = REPO / "Makefile"
SFT_PAGE = REPO / "docs" / "sft.md"
QUOTES = [
    pytest.param(block, id=f"{page.relative_to(REPO)}:{block.line}")
    for page in docs.DOC_FILES
    for block in docs.blocks(docs.read(page))
    if block.output_of
]


def make_commands(target: str) -> list[list[str]]:
    """The commands of a Makefile rule, as a user's shell would run them from the repository root
    (`$(PY)` is `python`, `$@` the target, `$<` its first prerequisite)."""
    text = MAKEFILE.read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*:?=\s*(.*?)\s*$", text, re.M))
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    first = (lines[at].split(":", 1)[1].split("|")[0].split() or [""])[0]
    body = []
    for line in lines[at + 1 :]:
        if not line.startswith("\t"):
            break
        body.append(line[1:])
    body = "\n".join(body).replace("\\\n", " ")

    def expand(word: str) -> str:
        word = word.replace("$(PY)", "python").replace("$@", target).replace("$<", first)
        return re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], word)

    return [shlex.split(expand(line)) for line in body.splitlines() if line.strip()]


@contextlib.contextmanager
def working_folder(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def run(command: list[str], folder: Path) -> str:
    """What the command prints on stdout, run in-process in `folder` (exit 0 asserted)."""
    out = io.StringIO()
    with working_folder(folder), contextlib.redirect_stdout(out):
        if command[:3] == ["python", "-m", "convert"]:
            from convert.cli import main

            code = main(command[3:])
        elif command[0] == "llm":
            from llm.commands import main

            code = main(command[1:])
        else:
            raise AssertionError(
                f"no in-process runner for `{shlex.join(command)}`: quote only cheap commands"
            )
    assert code == 0, (command, out.getvalue())
    return out.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """A folder holding data/demo/ as `make demo-sft` has it before training: the demo corpus, its
    tokenizer and the SFT pairs, made by the Makefile's commands; recipes/ beside it for `llm`."""
    folder = tmp_path_factory.mktemp("demo")
    (folder / "recipes").symlink_to(REPO / "recipes")
    for target in ("$(DEMO)/corpus.jsonl", "$(DEMO)/tokenizer.model", "$(DEMO)/sft/train.jsonl"):
        for command in make_commands(target):
            run(command, folder)
    return folder


def test_the_docs_quote_some_outputs():
    commands = [block.values[0].output_of for block in QUOTES]
    assert any(" -m convert sft " in c for c in commands) and any(
        c.startswith("llm inspect") for c in commands
    )


@pytest.mark.parametrize("block", QUOTES)
def test_a_quoted_output_is_the_commands_current_output(block, demo):
    printed = run(shlex.split(block.output_of), demo)
    assert docs.output_matches(block.body, printed) is None, printed


def test_the_quoted_demo_sft_conversion_is_the_one_make_demo_sft_runs():
    """The padding figures in docs/sft.md come from the command `make demo-sft` runs, with its flags."""
    made = {shlex.join(c) for t in ("$(DEMO)/sft/train.jsonl", "$(DEMO)/sft/shards/train/index.json")
            for c in make_commands(t)}  # fmt: skip
    quoted = {b.output_of for b in docs.blocks(docs.read(SFT_PAGE)) if b.output_of}
    assert made <= quoted
    no_pack = next(q for q in quoted if "--no-pack" in q).split()
    packed = next(q for q in made if "--out data/demo/sft/shards" in q).split()
    assert no_pack[: no_pack.index("--out")] == packed[: packed.index("--out")]


def test_the_share_of_positive_answers_the_docs_give_is_the_demo_tasks(demo):
    """convert/demo/sft.py said about 40% 正面 while the pairs held 47.9% (issue 36)."""
    from convert.demo import sft

    pairs = sft.labelled_pairs()
    train, heldout = (
        [json.loads(line)["answer"] for line in (demo / "data/demo/sft" / name).read_text().splitlines()]
        for name in ("train.jsonl", "heldout.jsonl")
    )
    share = [
        sum(answer == "正面" for answer in answers) / len(answers)
        for answers in ([a for _, a in pairs], train, heldout)
    ]
    said = (
        f"正面 is {share[0]:.1%} of the usable reviews, {share[1]:.1%} of the training pairs and "
        f"{share[2]:.1%} of the held-out ones"
    )
    for text in (sft.__doc__, docs.read(SFT_PAGE)):
        assert said in " ".join(text.split())
