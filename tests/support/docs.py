"""What the README and docs/*.md show, read for the docs tests (tests/repo/test_docs.py): shell
commands, recipe keys, YAML recipe snippets, links and headings, and the blocks that quote a
command's output. The checks against the parsers live in the test module; this reads Markdown."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO

# Every page a user reads: the guide, the docs it links to, the shard format and the suite's map.
DOC_FILES = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "shards" / "FORMAT.md",
    REPO / "tests" / "README.md",
)
SHELL_INFO = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
OUTPUT_OF = re.compile(r"^<!--\s*output of:\s*(.+?)\s*-->\s*$")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


@dataclass(frozen=True)
class Snippet:
    """One shell command line a page shows: in a code block (`fenced`) or an inline code span."""

    path: Path
    line: int
    text: str
    fenced: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string, first body line and body."""

    info: str
    line: int
    body: str
    output_of: str | None = None  # the command named by a `<!-- output of: ... -->` line just before it


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def blocks(text: str) -> Iterator[Block]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match.group(2), match.group(3), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        said = OUTPUT_OF.match(before.strip())
        yield Block(info, start + 2, "\n".join(lines[start + 1 : end]), said.group(1) if said else None)
        i = end + 1


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks."""
    out, inside, fence = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), match.group(2)
            continue
        if not inside:
            out.append((n, line))
    return out


def snippets(path: Path, text: str | None = None) -> list[Snippet]:
    """Every shell line of the page's shell code blocks (continuations joined) and every inline
    code span of its prose (a span may run over a line break)."""
    text = read(path) if text is None else text
    found = []
    for block in blocks(text):
        if block.info not in SHELL_INFO:
            continue
        pending, first = "", 0
        for n, line in enumerate(block.body.splitlines(), block.line):
            first = first or n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            whole, pending = (pending + line).strip(), ""
            if whole and not whole.startswith("#"):
                found.append(Snippet(path, first, whole, fenced=True))
            first = 0
    lines = prose(text)
    for paragraph in _paragraphs(lines):
        start, joined = paragraph[0][0], " ".join(line for _, line in paragraph)
        for match in INLINE_CODE.finditer(joined):
            found.append(Snippet(path, start, match.group(1).strip(), fenced=False))
    return found


def _paragraphs(lines: list[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
    paragraph: list[tuple[int, str]] = []
    for n, line in lines:
        if line.strip():
            paragraph.append((n, line))
        elif paragraph:
            yield paragraph
            paragraph = []
    if paragraph:
        yield paragraph


def commands(snippet: Snippet) -> list[list[str]]:
    """The snippet's commands as argument lists: split at `&&`, `;`, `|`, cut at a redirection,
    leading `NAME=value` environment assignments dropped."""
    try:
        tokens = shlex.split(snippet.text, comments=True)
    except ValueError:  # an unbalanced quote: prose in a span, not a command
        return []
    out, current, redirected = [], [], False
    for token in tokens:
        if token in SHELL_OPERATORS:
            out.append(current)
            current, redirected = [], False
        elif redirected or re.match(r"^\d?[<>]", token):
            redirected = True
        else:
            current.append(token)
    out.append(current)
    result = []
    for command in out:
        while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
            command = command[1:]
        if command:
            result.append(command)
    return result


# Tokens that stand for something the reader fills in: the command can be checked for its
# sub-command and flags, not parsed as a whole.
PLACEHOLDER = re.compile(r"\.\.\.|…|^[A-Z][A-Z0-9_]*$|[<>$]|^\[|\]$|^N$")


def has_placeholder(args: list[str]) -> bool:
    return any(PLACEHOLDER.search(a) for a in args)


# --- links and headings ---------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation
    removed (letters of any script, digits, `_` and `-` kept), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets `-1`, `-2` ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose(text):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            found.add(f"{base}-{count}" if count else base)
            seen[base] = count + 1
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link in the prose (not inside code)."""
    out = []
    for n, line in prose(text):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((n, match.group(1)))
    return out


def headings(text: str, level: int) -> list[str]:
    out = []
    for _, line in prose(text):
        match = HEADING.match(line)
        if match and len(match.group(1)) == level:
            out.append(match.group(2))
    return out


def table_under(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after `heading`, header and rule left out."""
    lines = text.splitlines()
    start = next(
        i for i, line in enumerate(lines) if HEADING.match(line) and HEADING.match(line).group(2) == heading
    )
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows or HEADING.match(line):
            break
    return [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]


def first_code(cell: str) -> str:
    """The first `code` of a table cell (its name), without the backticks."""
    match = INLINE_CODE.search(cell)
    return match.group(1) if match else cell


# --- quoted output ----------------------------------------------------------------------------


def output_matches(quoted: str, printed: str) -> str | None:
    """None if every non-empty line of `quoted` is a line of `printed`, in order (`...` inside a
    line stands for any text, a line of only `...` for any lines); else the first line that is not."""
    out = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for line in quoted.splitlines():
        line = line.rstrip()
        if not line.strip() or line.strip() == "...":
            continue
        pattern = re.compile(".*?".join(map(re.escape, line.split("..."))) + r"\Z")
        found = next((i for i in range(at, len(out)) if pattern.match(out[i])), None)
        if found is None:
            return line
        at = found + 1
    return None
