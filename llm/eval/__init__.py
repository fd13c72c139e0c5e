"""Multiple-choice evaluation: C-Eval / CMMLU-layout tasks scored by log-likelihood.

    tasks.py     the CSV layout (folder or s3://): subjects, questions, dev examples
    prompts.py   prompt formats (letter, cloze) and the deterministic few-shot block
    scoring.py   token split, shared-prompt packing, batched scoring, ranks
    results.py   accuracy per subject and task, table, JSON, metric names
    harness.py   prepare (no model needed) + run: what `llm eval` and the training callback call

During training: `llm/callbacks/task_eval.py`; after it: `llm eval` (`llm/commands/eval.py`).
"""
