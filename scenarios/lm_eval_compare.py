"""Score the same exported model on the same task with lm-evaluation-harness and with `llm.eval`.

Shared by the agreement test (tests/llm/eval/test_eval_lm_harness.py) and `make bench-eval`, which prints the
figures. lm-eval (`pip install 'lm-eval[hf]'`) reads the `llm export` folder with its Hugging Face
backend and a YAML task written here for each subject: the same CSV files, the same prompt (the
description, the first `shots` dev examples joined by a blank line, the question), the same
continuations. Our scorer starts every prompt with the tokenizer's EOS, the document boundary our
models train on; lm-eval gets the same start from the export itself (`llm export` names that EOS
as the tokenizer's BOS and adds it), with no edit: `lm_eval --model hf` as a user would run it.

`compare(..., stock=True)` uses lm-eval's OWN stock task definitions instead (`ceval-valid_<subject>`,
`cmmlu_<subject>` from the installed lm_eval/tasks folder), re-pointed only at local CSV copies:
that is how `llm eval`'s default protocols are checked against the published ones.

Nothing is downloaded: the model, tokenizer and CSVs are local, and the Hugging Face libraries run
offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE).

`demo_task_files()` writes the same task configs for the demo's task (`data/demo/tasks/zh-demo`,
paths relative to the folder lm_eval runs in) and a group `zh_demo` over its subjects: the files
shipped in recipes/lm-eval, so that `lm_eval --include_path recipes/lm-eval --tasks zh_demo` scores an
export of the demo model as `llm eval` does (docs/eval.md). Written by
`python -m scenarios.lm_eval_compare --write-demo-tasks recipes/lm-eval`, after `make demo`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from llm.eval import harness
from llm.eval.prompts import ANSWER_CUE, LETTERS, PROTOCOLS, description
from llm.eval.tasks import Subject, Task
from llm.weights.read import load_model
from shards.tokenizer import Tokenizer


@dataclass
class Agreement:
    questions: int
    max_abs_diff: float  # the largest |ours - lm-eval| over every option's log-likelihood
    same_choices: int  # questions where both pick the same option
    ours: dict[str, tuple[float, float]]  # "task/subject" -> (acc, acc_norm)
    theirs: dict[str, tuple[float, float]]
    theirs_ll: dict[str, list[list[float]]]  # lm-eval's per-question option log-likelihoods


def lm_eval_yaml(task: Task, subject: Subject, name: str, shots: int) -> dict:
    """An lm-eval task config scoring `subject` as `llm.eval` does (its task's protocol)."""
    letters = list(LETTERS[: len(subject.questions[0].options)])
    protocol = PROTOCOLS[task.protocol]
    if task.style == "cloze":
        text, choices = "{{question.strip()}}", "{{[" + ", ".join(f"{x}.strip()" for x in letters) + "]}}"
    else:
        cell = "{{{{{}}}}}" if protocol.raw_cells else "{{{{{}.strip()}}}}"
        options = "".join(f"\n{x}. " + cell.format(x) for x in letters)
        text, choices = "{{question.strip()}}" + options + "\n" + ANSWER_CUE, letters
    split_dir = Path(subject.source).parent
    config = {
        "task": name,
        "dataset_path": "csv",
        "dataset_kwargs": {
            "data_files": {
                "val": subject.source,
                "dev": str(split_dir.parent / "dev" / Path(subject.source).name),
            }
        },
        "test_split": "val",
        "output_type": "multiple_choice",
        "doc_to_text": text,
        "doc_to_choice": choices,
        "doc_to_target": "{{" + repr(letters) + ".index(answer)}}",
        "target_delimiter": protocol.answer_delimiter,
        "fewshot_delimiter": "\n\n",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    if shots or subject.examples:  # the first dev examples, in order, for any --num_fewshot
        config |= {"fewshot_split": "dev", "fewshot_config": {"sampler": "first_n"}}
    header = description(task, subject)
    if header:
        config["description"] = header
    return config


def stock_yaml(task: Task, subject: Subject, name: str) -> dict:
    """lm-eval's stock task for `subject` (C-Eval or CMMLU), its data files swapped for local copies."""
    import lm_eval

    family = {"lm-eval-ceval": "ceval", "lm-eval-cmmlu": "cmmlu"}[task.protocol]
    stock = Path(lm_eval.__file__).parent / "tasks" / family
    stock /= f"ceval-valid_{subject.name}.yaml" if family == "ceval" else f"cmmlu_{subject.name}.yaml"
    split = "val" if family == "ceval" else "test"
    source = Path(subject.source)
    dev = next((source.parent.parent / "dev").glob(f"{subject.name}*.csv"))
    return {
        "include": str(stock),
        "task": name,
        "dataset_path": "csv",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(source), "dev": str(dev)}},
    }


def compare(
    hf_dir: str,
    task_roots: list[str],
    shots: int,
    limit: int,
    batch_size: int = 8,
    stock: bool = False,
    protocol: str | None = None,
    lm_eval_side: Agreement | None = None,
) -> Agreement:
    """Score with both and compare (local task folders whose subjects have a dev/ twin if shots > 0).

    `stock`: lm-eval runs its own ceval-valid / cmmlu task definitions (tasks named like them);
    `protocol` is the one `llm.eval` uses (None: each task's own). `lm_eval_side`: an earlier
    comparison of the same export, tasks, shots and limit, whose lm-eval scores are reused (lm-eval
    does not depend on `protocol`)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = harness.load_tasks(task_roots, None if stock else "val", limit, protocol)
    tokenizer = Tokenizer(Path(hf_dir) / "tokenizer.model")
    model = load_model(hf_dir)
    report = harness.run(
        model, harness.prepare(tasks, tokenizer, shots, tokenizer.start_id), batch_size=batch_size
    )
    ours_ll = {
        f"{t.name}/{s.name}": [q.loglikelihoods for q in s.questions]
        for t in report.tasks
        for s in t.subjects
    }
    ours = {f"{t.name}/{s.name}": (s.acc, s.acc_norm) for t in report.tasks for s in t.subjects}
    if stock:
        # lm-eval's protocol is fixed by its yaml, whatever llm.eval was asked to use.
        tasks = harness.load_tasks(task_roots, None, limit)
    if lm_eval_side is not None:
        theirs_ll, theirs = lm_eval_side.theirs_ll, lm_eval_side.theirs
    else:
        theirs_ll, theirs = run_lm_eval(hf_dir, tasks, shots, limit, batch_size, stock)
    diffs = [
        abs(a - b)
        for key in ours_ll
        for qa, qb in zip(ours_ll[key], theirs_ll[key], strict=True)
        for a, b in zip(qa, qb, strict=True)
    ]
    same = sum(
        _argmax(qa) == _argmax(qb)
        for key in ours_ll
        for qa, qb in zip(ours_ll[key], theirs_ll[key], strict=True)
    )
    return Agreement(sum(map(len, ours_ll.values())), max(diffs), same, ours, theirs, theirs_ll)


def run_lm_eval(
    hf_dir: str, tasks: list[Task], shots: int, limit: int, batch_size: int, stock: bool = False
) -> tuple[dict[str, list[list[float]]], dict[str, tuple[float, float]]]:
    """lm-eval's per-question option log-likelihoods and (acc, acc_norm), keyed "task/subject"."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    names = {}
    with tempfile.TemporaryDirectory() as folder:
        for task in tasks:
            for subject in task.subjects:
                name = re.sub(r"\W", "_", f"llm_agree_{task.name}_{subject.name}")
                names[name] = f"{task.name}/{subject.name}"
                config = (
                    stock_yaml(task, subject, name) if stock else lm_eval_yaml(task, subject, name, shots)
                )
                (Path(folder) / f"{name}.yaml").write_text(json.dumps(config, ensure_ascii=False))
        # What `lm_eval --model hf --model_args pretrained=<export>` does: the export untouched.
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": hf_dir, "dtype": "float32"},
            device="cpu",
            batch_size=batch_size,
            tasks=sorted(names),
            num_fewshot=shots,
            # Only the tasks written here (stock ones include lm-eval's yaml by path): indexing
            # every built-in task costs about 10 s each time.
            task_manager=TaskManager(include_path=folder, include_defaults=False),
            log_samples=True,
            limit=limit,
            verbosity="ERROR",
        )
    lls, accs = {}, {}
    for name, key in names.items():
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        lls[key] = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        found = results["results"][name]
        accs[key] = (found["acc,none"], found["acc_norm,none"])
    return lls, accs


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


DEMO_TASK = "data/demo/tasks/zh-demo"  # where `make demo` writes the demo's task
DEMO_GROUP = "zh_demo"
_HEADER = (
    "# lm-eval {kind} for the demo's task ({task}, written by `make demo`), scored as `llm eval`\n"
    "# scores it; run lm_eval from the repository's root (docs/eval.md). Written by\n"
    "# `python -m scenarios.lm_eval_compare --write-demo-tasks recipes/lm-eval`; do not edit.\n"
)


def demo_task_files(task_root: str = DEMO_TASK) -> dict[str, str]:
    """recipes/lm-eval's files: file name -> text. One lm-eval task per subject of the task at
    `task_root` (its CSVs named by that path, as given) and the group `zh_demo`, whose acc is over
    all questions (weight_by_size), as `llm eval`'s task figure."""
    (task,) = harness.load_tasks([task_root], "val")
    files, names = {}, []
    for subject in task.subjects:
        name = f"{DEMO_GROUP}_{subject.name}"
        names.append(name)
        config = lm_eval_yaml(task, subject, name, shots=0)
        files[f"{name}.yaml"] = _HEADER.format(kind="task", task=task_root) + _dump(config)
    group = {
        "group": DEMO_GROUP,
        "task": names,
        "aggregate_metric_list": [
            {"metric": metric, "aggregation": "mean", "weight_by_size": True}
            for metric in ("acc", "acc_norm")
        ],
    }
    files[f"{DEMO_GROUP}.yaml"] = _HEADER.format(kind="group", task=task_root) + _dump(group)
    return files


class _Dumper(yaml.SafeDumper):
    """Strings with a line break double-quoted (`"\\n\\n"`), not folded over several lines."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style='"' if "\n" in text else None
    ),
)


def _dump(config: dict) -> str:
    return yaml.dump(config, Dumper=_Dumper, allow_unicode=True, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scenarios.lm_eval_compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--write-demo-tasks",
        metavar="FOLDER",
        required=True,
        help="write the demo task's lm-eval configs there",
    )
    parser.add_argument("--task", default=DEMO_TASK, help=f"the demo task's folder (default {DEMO_TASK})")
    args = parser.parse_args(argv)
    out = Path(args.write_demo_tasks)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in demo_task_files(args.task).items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
