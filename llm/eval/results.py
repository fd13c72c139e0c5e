"""Accuracy from option log-likelihoods: per subject, per task, as a table, JSON and metric names.

A question counts as right when its answer has the highest log-likelihood (`acc`), and for
`acc_norm` when it has the highest log-likelihood per character of the option's text, lm-eval's
length normalisation (it matters for cloze tasks; letters are all one character). Ties go to the
first option. A question that needed its prompt/option boundary moved back (an option merged
with the prompt's last token, llm/eval/scoring.py) counts as `merged`. A task's `acc` is over all its questions (each question weighs the same, as lm-eval's
group scores); `acc_macro` is the mean of its subjects' accuracies (C-Eval's leaderboard average).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


@dataclass
class QuestionResult:
    answer: int
    loglikelihoods: list[float]
    lengths: list[int]  # characters of each option's own text
    truncated: bool = False
    id: str = ""
    prompt: str = ""  # the context scored (written to JSON only when asked)
    continuations: list[str] = field(default_factory=list)
    merged: int = 0  # prompt tokens scored with the options (0: the plain split)
    emptied: bool = False  # an option would have had no token of its own

    @property
    def pred(self) -> int:
        return argmax(self.loglikelihoods)

    @property
    def pred_norm(self) -> int:
        return argmax([ll / max(1, n) for ll, n in zip(self.loglikelihoods, self.lengths, strict=True)])


@dataclass
class SubjectResult:
    name: str
    questions: list[QuestionResult]

    @property
    def acc(self) -> float:
        return sum(q.pred == q.answer for q in self.questions) / len(self.questions)

    @property
    def acc_norm(self) -> float:
        return sum(q.pred_norm == q.answer for q in self.questions) / len(self.questions)

    @property
    def truncated(self) -> int:
        return sum(q.truncated for q in self.questions)

    @property
    def merged(self) -> int:
        return sum(q.merged > 0 for q in self.questions)

    @property
    def emptied(self) -> int:
        return sum(q.emptied for q in self.questions)


@dataclass
class TaskResult:
    name: str
    split: str
    style: str
    shots: int
    protocol: str = "compact"
    subjects: list[SubjectResult] = field(default_factory=list)

    @property
    def questions(self) -> list[QuestionResult]:
        return [q for s in self.subjects for q in s.questions]

    @property
    def acc(self) -> float:
        qs = self.questions
        return sum(q.pred == q.answer for q in qs) / len(qs)

    @property
    def acc_norm(self) -> float:
        qs = self.questions
        return sum(q.pred_norm == q.answer for q in qs) / len(qs)

    @property
    def acc_macro(self) -> float:
        return sum(s.acc for s in self.subjects) / len(self.subjects)

    @property
    def truncated(self) -> int:
        return sum(s.truncated for s in self.subjects)

    @property
    def merged(self) -> int:
        return sum(s.merged for s in self.subjects)

    @property
    def emptied(self) -> int:
        return sum(s.emptied for s in self.subjects)


@dataclass
class Report:
    tasks: list[TaskResult]
    seconds: float = 0.0

    @property
    def num_questions(self) -> int:
        return sum(len(t.questions) for t in self.tasks)

    @property
    def truncated(self) -> int:
        return sum(t.truncated for t in self.tasks)

    @property
    def merged(self) -> int:
        return sum(t.merged for t in self.tasks)

    @property
    def emptied(self) -> int:
        return sum(t.emptied for t in self.tasks)

    def metrics(self, prefix: str = "tasks") -> dict[str, float]:
        """Flat metric names for loggers: tasks/<task>/acc, .../acc_norm, .../<subject>/acc."""
        out: dict[str, float] = {}
        for t in self.tasks:
            out[f"{prefix}/{t.name}/acc"] = t.acc
            out[f"{prefix}/{t.name}/acc_norm"] = t.acc_norm
            for s in t.subjects:
                out[f"{prefix}/{t.name}/{s.name}/acc"] = s.acc
        return out

    def table(self) -> str:
        """A plain-text table: one line per subject, then the task's totals."""
        lines = [f"{'task / subject':<40} {'questions':>9} {'acc':>7} {'acc_norm':>8} {'truncated':>9}"]
        for t in self.tasks:
            title = f"{t.name} ({t.split}, {t.style}, {t.shots}-shot, protocol {t.protocol})"
            lines.append(title)
            for s in t.subjects:
                lines.append(
                    f"  {s.name:<38} {len(s.questions):>9} {s.acc:>7.4f} {s.acc_norm:>8.4f} {s.truncated:>9}"
                )
            lines.append(
                f"  {'all (by question)':<38} {len(t.questions):>9} {t.acc:>7.4f} {t.acc_norm:>8.4f} "
                f"{t.truncated:>9}"
            )
            if len(t.subjects) > 1:
                lines.append(f"  {'mean of subjects':<38} {'':>9} {t.acc_macro:>7.4f}")
        return "\n".join(lines)

    def to_json(self, prompts: bool = False) -> dict[str, Any]:
        """Everything, per question its id; with `prompts`, also the prompt and continuations scored."""
        return {
            "questions": self.num_questions,
            "seconds": self.seconds,
            "truncated": self.truncated,
            "merged": self.merged,
            "tasks": {
                t.name: {
                    "split": t.split,
                    "style": t.style,
                    "protocol": t.protocol,
                    "shots": t.shots,
                    "acc": t.acc,
                    "acc_norm": t.acc_norm,
                    "acc_macro": t.acc_macro,
                    "truncated": t.truncated,
                    "merged": t.merged,
                    "subjects": {
                        s.name: {
                            "questions": len(s.questions),
                            "acc": s.acc,
                            "acc_norm": s.acc_norm,
                            "truncated": s.truncated,
                            "merged": s.merged,
                            "details": [_details(q, prompts) for q in s.questions],
                        }
                        for s in t.subjects
                    },
                }
                for t in self.tasks
            },
        }


def _details(q: QuestionResult, prompts: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": q.id,
        "answer": q.answer,
        "pred": q.pred,
        "loglikelihoods": q.loglikelihoods,
        "truncated": q.truncated,
        "merged": q.merged,
    }
    if prompts:
        out |= {"prompt": q.prompt, "continuations": q.continuations}
    return out
