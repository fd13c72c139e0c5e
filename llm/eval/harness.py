"""Evaluate a model on multiple-choice tasks: read, prompt, tokenize, score, count.

`prepare` does everything that does not need the model (reading the CSVs, building the prompts,
tokenizing): the training callback does it once at the start. `run` scores the prepared questions
(all tasks in one stream of batches) and returns a `Report`. `llm eval` and the training callback
are both these two calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from llm.errors import ConfigError
from llm.eval.prompts import Prompt, build_prompts
from llm.eval.results import QuestionResult, Report, SubjectResult, TaskResult
from llm.eval.scoring import Encoded, encode_question, is_truncated, score
from llm.eval.tasks import Task, load_task


@dataclass
class PreparedSubject:
    name: str
    prompts: list[Prompt]
    encoded: list[Encoded]


@dataclass
class PreparedTask:
    task: Task
    shots: int
    subjects: list[PreparedSubject]


def load_tasks(
    paths: Sequence[str],
    split: str | None = None,
    max_questions: int | None = None,
    protocol: str | None = None,
) -> list[Task]:
    """The tasks at `paths` (local or s3:// folders); ConfigError on a bad file or a repeated name.

    `protocol` (one of tasks.PROTOCOLS) overrides each letter task's own."""
    if not paths:
        raise ConfigError("no tasks given: pass task folders in C-Eval/CMMLU layout, e.g. --tasks data/ceval")
    if max_questions is not None and max_questions < 1:
        raise ConfigError(f"max_questions must be at least 1, got {max_questions}")
    tasks = [load_task(p, split, max_questions, protocol) for p in paths]
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"two task folders are both named {repeated[0]!r}; results are keyed by folder name"
        )
    return tasks


def prepare(tasks: Sequence[Task], tokenizer, shots: int, start_id: int | None) -> list[PreparedTask]:
    """Prompts and token ids of every question (`tokenizer` has `encode(text) -> list[int]`)."""
    if shots < 0:
        raise ConfigError(f"shots must be 0 or more, got {shots}")
    prepared = []
    for task in tasks:
        subjects = []
        for subject in task.subjects:
            prompts = build_prompts(task, subject, shots)
            encoded = [
                encode_question(
                    tokenizer, p.context, p.continuations, start_id, f"{subject.source}, line {q.line}"
                )
                for p, q in zip(prompts, subject.questions, strict=True)
            ]
            subjects.append(PreparedSubject(subject.name, prompts, encoded))
        prepared.append(PreparedTask(task, shots, subjects))
    return prepared


def run(
    model: nn.Module,
    prepared: Sequence[PreparedTask],
    *,
    batch_size: int = 8,
    shared: bool = True,
    rank: int = 0,
    world_size: int = 1,
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> Report:
    """Score every prepared question with `model` (a Transformer, possibly FSDP-wrapped)."""
    started = time.perf_counter()
    max_len = model.cfg.max_seq_len
    flat = [e for t in prepared for s in t.subjects for e in s.encoded]
    scores = iter(
        score(
            model,
            flat,
            max_len=max_len,
            batch_size=batch_size,
            shared=shared,
            rank=rank,
            world_size=world_size,
            sum_over_ranks=sum_over_ranks,
        )
    )
    results = []
    for t in prepared:
        task_result = TaskResult(t.task.name, t.task.split, t.task.style, t.shots, t.task.protocol)
        for s in t.subjects:
            questions = [
                QuestionResult(
                    answer=p.answer,
                    loglikelihoods=next(scores),
                    lengths=p.lengths,
                    truncated=is_truncated(e, max_len),
                    id=p.id,
                    prompt=p.context,
                    continuations=list(p.continuations),
                    merged=e.moved,
                    emptied=e.emptied,
                )
                for p, e in zip(s.prompts, s.encoded, strict=True)
            ]
            task_result.subjects.append(SubjectResult(s.name, questions))
        results.append(task_result)
    return Report(results, seconds=time.perf_counter() - started)
