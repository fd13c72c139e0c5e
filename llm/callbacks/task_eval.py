"""Score multiple-choice tasks (C-Eval / CMMLU layout) every N batches and at the end of training.

The tasks are read, prompted and tokenized once, at the start of training (a bad CSV stops the
run before its first step, with one line naming the file); each call then scores every question
(`llm.eval.harness.run`). Rank 0 prints the table, appends one line per subject to
`<run_dir>/tasks.jsonl` (step, task, subject, questions, acc, acc_norm, truncated) and logs
`tasks/<task>/acc`, `tasks/<task>/acc_norm` and `tasks/<task>/<subject>/acc` to the loggers
(metrics.jsonl, TensorBoard).

Under DDP or FSDP every rank takes part: each scores its share of the batches, the same number of
forward passes on every rank (FSDP gathers parameters in each), and one all-reduce gives every rank
all scores. Training is not changed: scoring draws no random numbers (few-shot examples are the
first of each dev split), runs without gradients, and restores the model's train mode.

The end-of-training call runs at the last batch's end (not at fit end), so its numbers reach
metrics.jsonl with that step; a run stopping early on SIGTERM/SIGINT never reaches it, and its
preemption checkpoint is not delayed.
"""

from __future__ import annotations

import json
from pathlib import Path

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist
from torch import Tensor

from llm.callbacks.generation import transformer_of
from llm.config import EvalTasksCallbackConfig
from llm.eval.harness import PreparedTask, load_tasks, prepare, run
from llm.eval.results import Report
from llm.run_dir import RunDir
from shards.tokenizer import Tokenizer


class TaskEvalCallback(Callback):
    """Scores the recipe's `callbacks.eval_tasks` (`settings`) with the run's tokenizer, written to
    `run_dir`'s tasks.jsonl."""

    def __init__(self, settings: EvalTasksCallbackConfig, tokenizer_path: str, run_dir: str | Path):
        self.task_paths = list(settings.tasks)
        self.tokenizer_path = tokenizer_path
        self.results_path = RunDir(run_dir).tasks
        self.shots, self.split, self.max_questions = settings.shots, settings.split, settings.max_questions
        self.batch_size, self.shared_prompt = settings.batch_size, settings.shared_prompt
        self._should_run = create_interval_scheduler(
            settings.interval,
            include_end_of_training=True,
            checkpoint_events=False,
            final_events={Event.BATCH_END},
        )
        self._prepared: list[PreparedTask] = []
        self._last_step = -1
        self.last_report: Report | None = None

    # --- Composer events ----------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        tokenizer = Tokenizer(self.tokenizer_path)
        tokenizer.check_fits(transformer_of(state.model).cfg.vocab_size)
        tasks = load_tasks(self.task_paths, self.split, self.max_questions)
        self._prepared = prepare(tasks, tokenizer, self.shots, tokenizer.start_id)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._should_run(state, Event.BATCH_END) and self._last_step != int(state.timestamp.batch):
            self.run(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._should_run(state, Event.EPOCH_END) and self._last_step != int(state.timestamp.batch):
            self.run(state, logger)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass  # nothing to restore: the schedule follows the training timestamp

    # --- the work --------------------------------------------------------------------------------

    def run(self, state: State, logger: Logger) -> Report:
        """Score every task now (all ranks); returns the report (the same on every rank)."""
        from composer.core.precision import get_precision_context

        with get_precision_context(state.precision):
            report = run(
                transformer_of(state.model),
                self._prepared,
                batch_size=self.batch_size,
                shared=self.shared_prompt,
                rank=dist.get_global_rank(),
                world_size=dist.get_world_size(),
                sum_over_ranks=_sum_over_ranks,
            )
        self._last_step = int(state.timestamp.batch)
        self.last_report = report
        if dist.get_global_rank() == 0:
            self._write(self._last_step, report, logger)
        return report

    def _write(self, step: int, report: Report, logger: Logger) -> None:
        print(f"[tasks] step {step} ({report.num_questions} questions, {report.seconds:.1f} s)", flush=True)
        print(report.table(), flush=True)
        if report.truncated:
            print(f"[tasks] warning: {report.truncated} prompts were cut from the left to fit the context")
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        with self.results_path.open("a", encoding="utf-8") as f:
            for t in report.tasks:
                for s in t.subjects:
                    row = {"step": step, "task": t.name, "subject": s.name, "questions": len(s.questions)}
                    row |= {"acc": s.acc, "acc_norm": s.acc_norm, "truncated": s.truncated}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        logger.log_metrics({**report.metrics(), "tasks/seconds": report.seconds}, step=step)


def _sum_over_ranks(totals: Tensor) -> Tensor:
    dist.all_reduce(totals, reduce_operation="SUM")
    return totals


def task_eval_callbacks(ctx) -> list[Callback]:
    """For `llm.trainer.CALLBACK_BUILDERS`: the callback when the recipe names tasks."""
    if not ctx.cfg.callbacks.eval_tasks.tasks:
        return []
    return [TaskEvalCallback(ctx.cfg.callbacks.eval_tasks, ctx.cfg.tokenizer.path, ctx.cfg.run_dir)]
