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

Protocols of a letter task (`Task.protocol`, named in `llm eval`'s table and JSON):
- lm-eval-ceval / lm-eval-cmmlu: lm-eval 0.4.13's stock `ceval-valid` and `cmmlu` tasks, so a
  figure compares with published ones. The question is stripped, the option cells are used as
  written, the letter is scored with a leading space (lm-eval's `target_delimiter " "`, in the
  few-shot answers too), and the description is each benchmark's
  ("以下是中国关于{subject}的单项选择题，请选出其中的正确答案。" / "以下是关于{subject}的单项选择题，请直接给出正确答案的选项。").
- compact: this project's earlier format: cells stripped, the letter right after "答案：" (as the
  text would read) and C-Eval's paper wording "以下是中国关于{subject}考试的单项选择题...". Its
  figures are comparable only with other runs of `compact`.
Cloze tasks have no stock counterpart: the option follows the question directly (protocol "cloze").
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.errors import ConfigError
from llm.eval.tasks import Question, Subject, Task

ANSWER_CUE = "答案："
EXAMPLE_SEPARATOR = "\n\n"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Protocol:
    description: str  # "{subject}" is replaced by the subject's shown name
    raw_cells: bool  # options as written (stock) or stripped
    answer_delimiter: str  # between the prompt and the scored continuation


PROTOCOLS = {
    "lm-eval-ceval": Protocol("以下是中国关于{subject}的单项选择题，请选出其中的正确答案。\n\n", True, " "),
    "lm-eval-cmmlu": Protocol("以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n", True, " "),
    "compact": Protocol("以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n", False, ""),
    "cloze": Protocol("", False, ""),
}


@dataclass(frozen=True)
class Prompt:
    context: str
    continuations: tuple[str, ...]
    answer: int
    id: str = ""  # the question's id (tasks.Question.id)
    delimiter: str = ""  # what each continuation starts with before the option's own text

    @property
    def lengths(self) -> list[int]:
        """Characters of each option's own text (lm-eval's acc_norm divides by these)."""
        return [len(c) - len(self.delimiter) for c in self.continuations]


def question_text(question: Question, style: str, protocol: str = "compact") -> str:
    if style == "cloze":
        return question.text
    options = question.cells if PROTOCOLS[protocol].raw_cells and question.cells else question.options
    lines = [question.text] + [f"{LETTERS[i]}. {option}" for i, option in enumerate(options)]
    return "\n".join(lines) + "\n" + ANSWER_CUE


def continuations(question: Question, style: str, protocol: str = "compact") -> tuple[str, ...]:
    """The scored texts, each after the protocol's delimiter (" A" for the stock protocols)."""
    texts = question.options if style == "cloze" else tuple(LETTERS[: len(question.options)])
    return tuple(PROTOCOLS[protocol].answer_delimiter + t for t in texts)


def description(task: Task, subject: Subject) -> str:
    template = task.description if task.description is not None else PROTOCOLS[task.protocol].description
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
        answer = continuations(example, task.style, task.protocol)[example.answer]
        parts.append(question_text(example, task.style, task.protocol) + answer + EXAMPLE_SEPARATOR)
    return "".join(parts)


def build_prompts(task: Task, subject: Subject, shots: int) -> list[Prompt]:
    """One prompt per question of `subject`, with `shots` examples (ConfigError if it has fewer)."""
    head = few_shot_block(task, subject, shots)
    prompts = []
    for question in subject.questions:
        options = continuations(question, task.style, task.protocol)
        empty = [LETTERS[i] for i, text in enumerate(options) if not text.strip()]
        if empty:
            raise ConfigError(
                f"{subject.source}, line {question.line}: option {empty[0]} is empty, and a cloze task "
                "scores the option's text; fill it or drop the question"
            )
        prompts.append(
            Prompt(
                head + question_text(question, task.style, task.protocol),
                options,
                question.answer,
                question.id,
                PROTOCOLS[task.protocol].answer_delimiter,
            )
        )
    return prompts
