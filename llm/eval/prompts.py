"""Prompts for multiple-choice questions: the text scored, its continuations, few-shot examples.

A prompt is a context string plus one continuation per option; the model's log-probability of each
continuation given the context is the option's score (llm.eval.scoring). The context is

    description + (example + its answer + "\n\n") * shots + question

the way lm-evaluation-harness builds it (description, examples joined by a blank line, then the
question; no space between the question and the answer). Few-shot examples are the first `shots`
questions of the subject's dev split, in file order: C-Eval and CMMLU ship exactly five per subject
for this, and the same context comes out on every run and every rank.

Styles (task.json's "style"):
- letter: C-Eval's format. The question, one "X. option" line per option, then "答案："; the
  continuations are the letters.
- cloze: the question alone; the continuations are the options' own texts (for tasks such as
  "which sentence comes next", where the letters would tell a small model nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.errors import ConfigError
from llm.eval.tasks import Question, Subject, Task

LETTER_DESCRIPTION = "以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n"
ANSWER_CUE = "答案："
EXAMPLE_SEPARATOR = "\n\n"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Prompt:
    context: str
    continuations: tuple[str, ...]
    answer: int


def question_text(question: Question, style: str) -> str:
    if style == "cloze":
        return question.text
    lines = [question.text] + [f"{LETTERS[i]}. {option}" for i, option in enumerate(question.options)]
    return "\n".join(lines) + "\n" + ANSWER_CUE


def continuations(question: Question, style: str) -> tuple[str, ...]:
    return question.options if style == "cloze" else tuple(LETTERS[: len(question.options)])


def description(task: Task, subject: Subject) -> str:
    template = (
        task.description
        if task.description is not None
        else (LETTER_DESCRIPTION if task.style == "letter" else "")
    )
    return template.replace("{subject}", subject.shown)


def few_shot_block(task: Task, subject: Subject, shots: int) -> str:
    """The description and the first `shots` dev examples with their answers (shared by all questions)."""
    if shots > len(subject.examples):
        where = f"{len(subject.examples)} dev examples" if subject.examples else "no dev split"
        raise ConfigError(
            f"task {task.name}, subject {subject.name}: {shots} shots asked but it has {where} "
            f"({task.root}/dev/); use --shots {len(subject.examples)} or fewer"
        )
    parts = [description(task, subject)]
    for example in subject.examples[:shots]:
        answer = continuations(example, task.style)[example.answer]
        parts.append(question_text(example, task.style) + answer + EXAMPLE_SEPARATOR)
    return "".join(parts)


def build_prompts(task: Task, subject: Subject, shots: int) -> list[Prompt]:
    """One prompt per question of `subject`, with `shots` examples (ConfigError if it has fewer)."""
    head = few_shot_block(task, subject, shots)
    prompts = []
    for question in subject.questions:
        options = continuations(question, task.style)
        empty = [LETTERS[i] for i, text in enumerate(options) if not text]
        if empty:
            raise ConfigError(
                f"{subject.source}, line {question.line}: option {empty[0]} is empty, and a cloze task "
                "scores the option's text; fill it or drop the question"
            )
        prompts.append(Prompt(head + question_text(question, task.style), options, question.answer))
    return prompts
