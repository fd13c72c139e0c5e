"""What the README and the docs tell a newcomer holds in the repository: which make target installs
what, and where the commands they show write (issue 36: `lm_eval` after `make demo`, untracked
outputs)."""

from __future__ import annotations

import re
import subprocess

import pytest
import tomllib

from tests.support.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def pages_text() -> str:
    return "\n\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def test_the_readme_says_which_make_target_installs_which_extra_and_where_the_dev_extra_is_needed():
    """After `make demo`, the README's `lm_eval` line failed (`No module named 'lm_eval'`) and the
    README never named `make install` (issue 36). The table must say what the Makefile installs."""
    makefile, readme = (REPO / "Makefile").read_text(), (REPO / "README.md").read_text(encoding="utf-8")
    installs = dict(
        re.findall(
            r"^\$\(VENV\)/(\.installed(?:-demo)?):.*\n(?:\t.*\n)*?\t\$\(UV_INSTALL\) -e '(\S+)'",
            makefile,
            re.M,
        )
    )
    assert installs == {".installed-demo": ".[demo]", ".installed": ".[demo,dev]"}
    rows = {
        cells[0]: cells[1]
        for line in readme.splitlines()
        if line.startswith("| `make install")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    demo_row = next(v for k, v in rows.items() if k.startswith("`make install-demo`"))
    dev_row = next(v for k, v in rows.items() if k.startswith("`make install` "))
    assert "`.[demo]`" in demo_row and "`.[dev]`" in dev_row and "`.[dev]`" not in demo_row
    dev = " ".join(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    )
    for package in ("pytest", "moto", "ruff", "lm-eval", "torchao"):
        assert package in dev and package in dev_row, package
    # Each paragraph (or code block) of the README and the docs that shows the `lm_eval` command says
    # it needs the dev extra.
    blocks = re.split(r"\n\s*\n", pages_text())
    needs_dev = [b for b in blocks if "lm_eval " in b or "lm_eval`" in b]
    assert len(needs_dev) >= 3
    for block in needs_dev:
        assert "make install" in block or "dev extra" in block, block


def test_the_readmes_commands_write_under_folders_git_ignores():
    """The README's `--out export/demo` (and --out tok.model, weights.pt, compare.png) made untracked
    files in the checkout; every output the README and the docs show goes under runs/ or data/ (or S3)."""
    text = pages_text()
    outs = re.findall(r"--out[ =](\S+)", "\n".join(re.findall(r"^(?:llm|python|composer) .*$", text, re.M)))
    local = [out for out in outs if not out.startswith("s3://")]
    assert len(local) >= 10 and all(out.startswith(("runs/", "data/")) for out in local), local
    defaults = ["runs/compare.png", "runs/demo/eval_results.json", "runs/eval/x.json"]
    old = ["export/demo/config.json", "eval_results.json", "compare.png", "tok.model", "weights.pt"]
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    check = subprocess.run(
        ["git", "check-ignore", "--no-index", *local, *defaults, *old],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert set(check.stdout.split()) == {*local, *defaults, *old}
