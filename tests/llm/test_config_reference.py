"""docs/config.md is written from the schema (llm/config_reference.py): current, and complete."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from llm.commands import main as llm_main
from llm.config_reference import REGENERATE, all_keys, render
from tests.support.paths import REPO

PAGE = REPO / "docs" / "config.md"


def test_docs_config_md_is_the_reference_the_schema_writes():
    assert PAGE.read_text(encoding="utf-8") == render(), (
        f"docs/config.md is stale: the schema changed; regenerate it with `{REGENERATE}`"
    )


def test_every_key_of_the_schema_has_a_line_of_meaning():
    missing = [k.key for k in all_keys() if not k.meaning]
    assert missing == [], (
        f"recipe keys without a meaning: {missing}; write one as a comment beside the field in "
        f"llm/config.py (on its line, or the lines right above), then run `{REGENERATE}`"
    )


PLANTED = '''
from dataclasses import dataclass, field

from llm.config import bounded


@dataclass
class Stream:
    remote: str  # where it is


@dataclass
class Inner:
    """An inner section."""

    # read from the comment
    # lines right above
    above: int = bounded(3, ge=1)
    beside: str | None = "x"  # read from its own line

    # a comment a blank line away belongs to no field

    bare: float = 1.0
    spread: list[int] = field(
        default_factory=lambda: [1, 2]
    )  # beside a field of several lines


@dataclass
class Root:
    streams: list[Stream]  # the streams
    seed: int = 17  # a seed
    inner: Inner = field(default_factory=Inner)
'''


@pytest.fixture
def planted(tmp_path):
    """A schema module of our own, with one key that has no comment (`inner.bare`)."""
    path = tmp_path / "planted_schema.py"
    path.write_text(textwrap.dedent(PLANTED))
    spec = importlib.util.spec_from_file_location("planted_schema", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["planted_schema"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["planted_schema"]


def test_a_key_added_without_a_comment_is_caught_and_each_comment_lands_on_its_field(planted):
    keys = {k.key: k for k in all_keys(planted.Root)}
    assert [k for k, doc in keys.items() if not doc.meaning] == ["inner.bare"]
    assert keys["inner.above"].meaning == "read from the comment lines right above"
    assert (keys["inner.above"].type, keys["inner.above"].default, keys["inner.above"].bounds) == (
        "int",
        "3",
        "at least 1",
    )
    assert keys["inner.beside"].meaning == "read from its own line"
    assert keys["inner.beside"].type == "string or null" and keys["inner.beside"].default == "x"
    assert keys["inner.spread"].meaning == "beside a field of several lines"
    assert keys["inner.spread"].default == "[1, 2]" and keys["inner.spread"].type == "list of int"
    assert keys["streams"].default == "required" and keys["remote"].meaning == "where it is"
    page = render(planted.Root)
    assert "## inner\n\nAn inner section." in page and "| `inner.bare` | float | `1.0` |  |  | yes |" in page
    assert "Each item of `streams`" in page


def test_the_reference_says_type_default_range_and_what_a_resume_does():
    keys = {k.key: k for k in all_keys()}
    assert (keys["model.n_kv_heads"].type, keys["model.n_kv_heads"].default) == ("int or null", "null")
    assert "grouped-query" in keys["model.n_kv_heads"].meaning
    assert keys["model.n_kv_heads"].resume.startswith("the model shape must match")
    assert keys["model.z_loss"].resume == "yes"  # the loss's penalty, not the shape
    assert "optimizer state in the checkpoint" in keys["optimizer.lr"].resume
    assert keys["optimizer.lr"].bounds.startswith("in (0, 1]") and keys["optimizer.betas"].type == "2 x float"
    assert keys["training.max_duration"].resume == "yes" and keys["checkpoint.save_folder"].resume == "yes"
    assert keys["data.train"].default == "required" and keys["tokenizer.path"].default == "required"
    assert keys["remote"].meaning  # the streams' keys, listed once for data.train and data.eval


def test_llm_config_prints_a_section_and_writes_the_page(tmp_path, capsys):
    assert llm_main(["config", "guard"]) == 0
    out = capsys.readouterr().out
    assert "| `guard.skip` | int | `200` | 0 or more |" in out and "`optimizer.lr`" not in out
    assert llm_main(["config", "--out", str(tmp_path / "config.md")]) == 0
    assert (tmp_path / "config.md").read_text(encoding="utf-8") == render()
    assert llm_main(["config", "no_such_section"]) == 2
    assert "no recipe key starts with 'no_such_section'" in capsys.readouterr().err


def test_train_py_help_points_to_the_reference_and_the_template(capsys):
    import train

    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "`llm config` or docs/config.md" in out and "recipes/template.yaml" in out
