"""The README and docs/*.md cannot drift from the code (issue 34): every command line and `--flag`
they show exists in the parsers (`python -m convert`, `llm`, `train.py` / `composer train.py`,
`make`, `python -m bench.X` / `scenarios.X`, the install extras), every recipe key they name is in
the schema (llm/config.py), every link and anchor resolves, and the README's reference tables list
what the code has. The parsers are built in-process; no command is run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.support import docs
from tests.support.paths import REPO

README = REPO / "README.md"
PROJECT_PACKAGES = {"bench", "scenarios", "convert", "llm", "shards", "storage"}
PYTHON = re.compile(r"(\S*/)?python3?")
# Inline code like `tokenizer.model` or `model.safetensors` names a file, not a recipe key.
FILE_SUFFIXES = set("model safetensors json jsonl yaml py pt pth png md txt csv".split())


# --- the parsers, built in-process ---------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@functools.cache
def convert_parser() -> argparse.ArgumentParser:
    from convert.cli import build_parser

    return build_parser()


@functools.cache
def llm_parser(sub: str) -> argparse.ArgumentParser:
    """`llm`'s parser with `sub`'s arguments added (the dispatcher imports only the chosen one)."""
    from llm.commands import build_parser

    return build_parser([sub])


@functools.cache
def train_parser() -> argparse.ArgumentParser:
    import train

    return train.build_parser()


@functools.cache
def make_targets() -> frozenset[str]:
    """Every target of the Makefile, its variables expanded (`$(DEMO)/tokenizer.model` too)."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*[:?]?=\s*(.*?)\s*$", text, re.M))
    targets = set()
    for line in re.findall(r"^([^\s#=][^:=]*?)\s*:(?!=)", text, re.M):
        for target in line.split():
            targets.add(re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), target))
    return frozenset(targets)


def phony_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split())


@functools.cache
def extras() -> frozenset[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return frozenset(project["optional-dependencies"])


# --- the checks ----------------------------------------------------------------------------------


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    return [
        f"no option {name}"
        for token in args
        if re.match(r"^--?[A-Za-z]", token)
        for name in [token.split("=", 1)[0]]
        if name not in parser._option_string_actions
    ]


def parse_problem(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """What argparse says about the whole line (a missing argument, a bad choice or order)."""
    from llm.commands import parse_command_line  # as the commands parse: overrides on either side

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse_command_line(parser, args)
    except SystemExit as stop:
        if stop.code:
            return [err.getvalue().strip().splitlines()[-1]]
    return []


def key_problem(key: str) -> str | None:
    """None if the dotted recipe key is in the schema (llm/config.py), else what is wrong."""
    from llm.config import TrainConfig

    kind: typing.Any = TrainConfig
    parts = key.lstrip("+").split(".")
    for i, part in enumerate(parts):
        kind = _unwrap(kind)
        if typing.get_origin(kind) in (list, tuple) and part.isdigit():
            kind = typing.get_args(kind)[0]
            continue
        if dataclasses.is_dataclass(kind):
            hints = typing.get_type_hints(kind)
            if part not in hints:
                return f"no recipe key {'.'.join(parts[: i + 1])}"
            kind = hints[part]
        elif typing.get_origin(kind) is not dict and kind is not typing.Any:
            return f"{'.'.join(parts[:i])} has no sub-keys"
    return None


def _unwrap(kind: typing.Any) -> typing.Any:
    """`X | None` -> X."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        return rest[0] if len(rest) == 1 else kind
    return kind


def override_problems(args: list[str]) -> list[str]:
    overrides = [a for a in args if re.match(r"^\+?[a-z_][\w.]*=", a)]
    return [p for a in overrides for p in [key_problem(a.split("=", 1)[0])] if p]


def check_convert(args: list[str], full: bool) -> list[str]:
    parser = convert_parser()
    if not args or args[0].startswith("-"):
        return unknown_flags(parser, args)
    subs = subcommands(parser)
    if args[0] not in subs:
        return [] if docs.PLACEHOLDER.search(args[0]) else [f"no sub-command `python -m convert {args[0]}`"]
    problems = unknown_flags(subs[args[0]], args[1:])
    return problems or (parse_problem(parser, args) if full else [])


def check_llm(args: list[str], full: bool) -> list[str]:
    if not args or args[0].startswith("-"):
        return unknown_flags(llm_parser(""), args)
    if args[0] not in subcommands(llm_parser("")):
        return [] if docs.PLACEHOLDER.search(args[0]) else [f"no sub-command `llm {args[0]}`"]
    parser = llm_parser(args[0])
    problems = unknown_flags(subcommands(parser)[args[0]], args[1:]) + override_problems(args[1:])
    return problems or (parse_problem(parser, args) if full else [])


def check_train(args: list[str], full: bool) -> list[str]:
    parser = train_parser()
    problems = unknown_flags(parser, args) + override_problems(args)
    if problems or not full:
        return problems
    problems = parse_problem(parser, args)
    recipe = REPO / args[0] if args else None
    if not problems and recipe and recipe.is_file():  # the values too, as train.py would load them
        import train
        from llm.config import load_config
        from llm.errors import ConfigError

        parsed = train.parse_args(args)
        try:
            load_config(recipe, parsed.overrides)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def check_module(module: str) -> list[str]:
    path = REPO / module.replace(".", "/")
    if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
        return []
    return [f"no module {module}"]


def check_command(args: list[str], full: bool) -> list[str]:
    """What is wrong with one command line the docs show (`full`: parse the whole line too)."""
    program, rest = args[0], args[1:]
    full = full and not docs.has_placeholder(args)
    if PYTHON.fullmatch(program):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module, tail = rest[1], rest[2:]
            if module == "convert":
                return check_convert(tail, full)
            if module == "llm":
                return check_llm(tail, full)
            if module == "pip":
                return check_pip(tail)
            return check_module(module) if module.split(".")[0] in PROJECT_PACKAGES else []
        if rest and rest[0].endswith("train.py"):
            return check_train(rest[1:], full)
        return []
    if program == "llm-convert":
        return check_convert(rest, full)
    if program == "llm":
        return check_llm(rest, full)
    if program.endswith("train.py"):
        return check_train(rest, full)
    if program == "composer":
        script = next((i for i, a in enumerate(rest) if a.endswith(".py")), None)
        if script is not None and rest[script].endswith("train.py"):
            return check_train(rest[script + 1 :], full)
        return []
    if program == "make":
        targets = [a for a in rest if not a.startswith("-") and "=" not in a]
        return [f"no make target {t}" for t in targets if t not in make_targets() and "*" not in t]
    if re.fullmatch(r"(\S*/)?pip3?", program):
        return check_pip(rest)
    return []


def check_pip(args: list[str]) -> list[str]:
    problems = [  # the project installs from its checkout; a registry's llm-pretrain is not this one
        f"{arg} installs from the package registry: install the checkout, pip install -e '.[extra]'"
        for arg in args
        if re.fullmatch(r"llm-pretrain(\[[\w,-]+\])?", arg)
    ]
    for arg in args:
        match = re.fullmatch(r"(?:\.|llm-pretrain)\[([\w,-]+)\]", arg)
        for extra in match.group(1).split(",") if match else []:
            if extra not in extras():
                problems.append(f"no extra [{extra}] in pyproject.toml")
    return problems


# Where the flags of the other tools the docs show are defined: the launcher, lm-eval, pytest and
# its xdist plugin, pip (read as text, nothing imported); mc and sbatch are not Python.
TOOL_SOURCES = {
    "composer": "cli/launcher.py",
    "lm_eval": "_cli/run.py",
    "_pytest": "runner.py",
    "xdist": "plugin.py",
    "pip": "_internal/cli/cmdoptions.py",
}
NOT_PYTHON = {"--ignore-existing": "mc mb (MinIO's client)", "--signal": "sbatch"}
FLAG_LITERAL = re.compile(r"""["'](--[a-z][\w-]*)["']""")


@functools.cache
def known_flags() -> frozenset[str]:
    """Every option of the project's parsers, of its benchmarks and scenarios (their sources), and
    of the other tools the docs show."""
    flags = set(train_parser()._option_string_actions)
    for sub in subcommands(convert_parser()).values():
        flags |= set(sub._option_string_actions)
    for name in subcommands(llm_parser("")):
        flags |= set(subcommands(llm_parser(name))[name]._option_string_actions)
    sources = [*(REPO / "bench").glob("*.py"), *(REPO / "scenarios").glob("*.py")]
    for package, file in TOOL_SOURCES.items():
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations:
            sources.append(Path(spec.submodule_search_locations[0]) / file)
    for source in sources:
        if source.is_file():
            flags |= set(FLAG_LITERAL.findall(source.read_text(encoding="utf-8")))
    return frozenset(flags | set(NOT_PYTHON))


def check_flag_spans(text: str) -> list[str]:
    """A `--flag` in prose (`--near-dedup`, `ARGS=--smoke`) is an option of some parser."""
    return [f"no option {flag} in any parser" for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text)
            if flag not in known_flags()]  # fmt: skip


SECTIONS = "model|tokenizer|data|optimizer|scheduler|training|fsdp|checkpoint|callbacks|loggers"
KEY_SPAN = re.compile(rf"^((?:{SECTIONS})(?:\.[A-Za-z_]\w*)+)(?:\s*[:=].*)?$")


def check_key_span(text: str) -> list[str]:
    """An inline `section.key` (or `section.key=value`, `section.key: value`) names a recipe key,
    unless it names a function of the llm package of that name (`data.check_streams`)."""
    match = KEY_SPAN.match(text)
    if not match or match.group(1).rsplit(".", 1)[-1] in FILE_SUFFIXES or names_code(match.group(1)):
        return []
    problem = key_problem(match.group(1))
    return [problem] if problem else []


def names_code(dotted: str) -> bool:
    """`loggers.check_extras`: llm/loggers/ (or llm/loggers.py) defines check_extras."""
    package, _, name = dotted.partition(".")
    sources = [*(REPO / "llm" / package).glob("**/*.py"), REPO / "llm" / f"{package}.py"]
    pattern = re.compile(rf"^\s*(?:def|class) {re.escape(name)}\b|^{re.escape(name)}\s*=", re.M)
    return "." not in name and any(
        p.is_file() and pattern.search(p.read_text(encoding="utf-8")) for p in sources
    )


def check_yaml(body: str) -> list[str]:
    """A YAML snippet whose top-level keys are recipe sections: every key, at any depth, exists."""
    from llm.config import TrainConfig

    try:
        tree = yaml.safe_load(body)
    except yaml.YAMLError:
        return []
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    if not isinstance(tree, dict) or not set(tree) <= top:
        return []
    return [p for key in _keys(tree) for p in [key_problem(key)] if p]


def _keys(tree: typing.Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [
            k for key, value in tree.items() for k in [f"{prefix}{key}", *_keys(value, f"{prefix}{key}.")]
        ]
    if isinstance(tree, list):
        return [k for item in tree if isinstance(item, dict) for k in _keys(item, f"{prefix}0.")]
    return []


def page_problems(path: Path, text: str | None = None) -> list[str]:
    """Every command, flag, recipe key and YAML recipe snippet of one page that the code lacks."""
    text = docs.read(path) if text is None else text
    problems = []
    for snippet in docs.snippets(path, text):
        for args in docs.commands(snippet):
            problems += [
                f"{snippet.where}: `{snippet.text}`: {p}" for p in check_command(args, snippet.fenced)
            ]
        if not snippet.fenced:
            found = check_key_span(snippet.text) + check_flag_spans(snippet.text)
            problems += [f"{snippet.where}: `{snippet.text}`: {p}" for p in found]
    for block in docs.blocks(text):
        if block.info in ("yaml", "yml"):
            problems += [f"{path.name}:{block.line}: {p}" for p in check_yaml(block.body)]
    return problems


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of one page whose file, or whose anchor in that file, does not exist."""
    text = docs.read(path) if text is None else text
    problems = []
    for line, target in docs.links(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.name}:{line}: {target}: no such file")
            continue
        headings = docs.anchors(docs.read(linked) if file_part else text) if linked.suffix == ".md" else set()
        if anchor and anchor not in headings:
            problems.append(f"{path.name}:{line}: {target}: no heading #{anchor} in {linked.name}")
    return problems


PAGES = [pytest.param(p, id=str(p.relative_to(REPO))) for p in docs.DOC_FILES]


@pytest.mark.parametrize("page", PAGES)
def test_every_command_flag_and_recipe_key_a_page_shows_exists(page):
    assert page_problems(page) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_link_and_anchor_of_a_page_resolves(page):
    assert link_problems(page) == []


PLANTED = """\
# Sample

```bash
python -m convert shards in.jsonl --tokenizer t.model --out data/x --made-up-flag 3
python -m convert shred in.jsonl --out data/x
llm generate runs/demo/checkpoints --tokenizer t.model --prompt 中国 --top-q 0.9
llm inspect --gpus 8
python train.py recipes/demo.yaml optimizer.learning_rate=1e-3
python train.py recipes/demo.yaml optimizer.lr=-1
composer -n 8 train.py recipes/7b.yaml --dryrun
make demo-stf
python -m bench.no_such_bench
pip install -e '.[no-such-extra]'
pip install 'llm-pretrain[mlflow]'
llm eval runs/demo/export --tasks data/t --protocol lm-eval-mmlu
```

Set `training.profile.enabled_not=true` or `checkpoint.upload_wait` and run `llm chatt`; or
add `--near-dedupe`.
See [the page](docs/no-such-page.md), [resume](docs/resume.md#no-such-heading) and [up](#sample).

```yaml
data:
  eval:
    - {remote: s3://bkt/wiki/val, nmae: wiki}
```
"""


def test_the_checks_catch_planted_drift():
    """A made-up flag, sub-command, recipe key, make target, module, extra, choice, missing argument
    and broken link in a sample page are each reported; a correct page (the README) is not."""
    problems = "\n".join(page_problems(README, PLANTED) + link_problems(README, PLANTED))
    for expected in [
        "no option --made-up-flag",
        "no sub-command `python -m convert shred`",
        "no option --top-q",
        "the following arguments are required: recipe",  # `llm inspect` without a recipe
        "no recipe key optimizer.learning_rate",
        "optimizer.lr",  # -1 is out of its range: load_config says so in one line
        "no option --dryrun",
        "no make target demo-stf",
        "no module bench.no_such_bench",
        "no extra [no-such-extra]",
        "llm-pretrain[mlflow] installs from the package registry",
        "invalid choice: 'lm-eval-mmlu'",
        "no recipe key training.profile.enabled_not",
        "no recipe key checkpoint.upload_wait",
        "no sub-command `llm chatt`",
        "docs/no-such-page.md: no such file",
        "no heading #no-such-heading in resume.md",
        "no recipe key data.eval.0.nmae",
        "no option --near-dedupe in any parser",
    ]:
        assert expected in problems, expected
    assert "#sample" not in problems
    assert len(problems.splitlines()) == 19


# --- the README: a guide with the reference tables ----------------------------------------------


def test_the_readme_is_a_guide_of_at_most_250_lines_whose_contents_list_every_section():
    text = docs.read(README)
    assert len(text.splitlines()) <= 250
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    sections = {docs.slug(h) for h in docs.headings(text, 2) if h != "Contents"}
    assert sections <= listed, sections - listed
    # The two set-up commands come first, before any other command.
    first = next(b for b in docs.blocks(text) if b.info in docs.SHELL_INFO)
    assert [line.split("#")[0].strip() for line in first.body.splitlines()] == ["make demo", "make test"]


def test_every_docs_page_links_back_to_the_readme():
    for page in sorted((REPO / "docs").glob("*.md")):
        assert any(target.split("#")[0] == "../README.md" for _, target in docs.links(docs.read(page))), page


def names_in(heading: str) -> list[str]:
    return [docs.first_code(row[0]) for row in docs.table_under(docs.read(README), heading)]


def test_the_readme_lists_every_sub_command_of_python_m_convert_and_llm():
    assert names_in("`python -m convert` sub-commands") == list(subcommands(convert_parser()))
    assert names_in("`llm` sub-commands") == list(subcommands(llm_parser("")))


def test_the_readme_lists_every_make_target():
    rows = docs.table_under(docs.read(README), "Make targets")
    listed = [name for row in rows for name in docs.INLINE_CODE.findall(row[0])]
    assert sorted(listed) == sorted(phony_targets())
    assert phony_targets() <= make_targets()


def test_the_readme_lists_every_llm_environment_variable_the_code_reads():
    read_by_code = set()
    for folder in ("storage", "llm", "convert", "shards", "recipes", "docker"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") or path.name == "Dockerfile":
                read_by_code |= set(
                    re.findall(r"\bLLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8"))
                )
    assert set(names_in("Environment variables")) == read_by_code


def test_the_readme_layout_names_every_top_level_folder_and_each_exists():
    paths = [docs.first_code(row[0]) for row in docs.table_under(docs.read(README), "Layout")]
    for path in paths:
        assert (REPO / path).exists(), path
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    folders = {
        line.split("/")[0] + "/" for line in tracked.splitlines() if "/" in line and not line.startswith(".")
    }
    assert folders <= set(paths), folders - set(paths)
