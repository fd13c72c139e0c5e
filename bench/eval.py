"""Multiple-choice scoring speed on the CPU, shared-prompt vs one row per option; lm-eval agreement.

    python -m bench.eval [--questions 50] [--checkpoint runs/demo/checkpoints] [--threads N]

1. Questions/s of `llm.eval` on the demo recipe's model shape and on the tiny recipe's (random
   weights, or the demo model's trained ones with --checkpoint), for the demo task of real text
   (`convert.demo.tasks`) in both styles: cloze (each option's sentence scored) and letter (C-Eval's
   format: the letters A-D scored after the listed options). Each line scores the same questions
   with shared-prompt rows (one row per question) and with one row per option (lm-eval's way), and
   prints the ratio and the largest log-likelihood difference between the two.
2. When lm-eval is installed: the demo-shaped model exported with `llm export`, scored by lm-eval
   and by `llm.eval` on the same task (0 and 3 shots): the largest per-option log-likelihood
   difference and the questions where both choose the same answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from convert.demo.tasks import write_demo_tasks
from llm.config import load_config
from llm.eval import harness
from llm.model import Transformer
from llm.weights.hf_export import export_hf
from llm.weights.read import load_model
from shards.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "demo" / "tokenizer.model"


def models(checkpoint: str | None) -> list[tuple[str, Transformer]]:
    demo = load_config(REPO / "recipes" / "demo.yaml").model
    tiny = load_config(REPO / "recipes" / "tiny.yaml").model
    demo_model = load_model(checkpoint) if checkpoint else Transformer(demo, seed=0)
    weights = "trained" if checkpoint else "random"
    return [(f"demo ({weights})", demo_model.eval()), ("tiny (random)", Transformer(tiny, seed=0).eval())]


def speed(model: Transformer, prepared, shared: bool) -> tuple[float, list[list[float]]]:
    harness.run(model, prepared, shared=shared)  # warm-up (first-call allocations)
    started = time.perf_counter()
    report = harness.run(model, prepared, shared=shared)
    seconds = time.perf_counter() - started
    return report.num_questions / seconds, [q.loglikelihoods for t in report.tasks for q in t.questions]


def speed_table(tasks_dir: Path, questions: int, checkpoint: str | None, tokenizer_path: Path) -> None:
    tokenizer = Tokenizer(tokenizer_path)
    print(
        f"{'model':<16} {'task':<10} {'shots':>5} {'shared q/s':>11} {'per-option q/s':>15} {'ratio':>6}  max |diff|"
    )
    for name, model in models(checkpoint):
        for style in ("cloze", "letter"):
            limit = questions if name.startswith("demo") else max(4, questions // 5)
            tasks = harness.load_tasks([str(tasks_dir / style)], max_questions=limit)
            for shots in (0, 3) if name.startswith("demo") else (0,):
                prepared = harness.prepare(tasks, tokenizer, shots, tokenizer.start_id)
                shared, lls_shared = speed(model, prepared, True)
                single, lls_single = speed(model, prepared, False)
                pairs = zip(sum(lls_shared, []), sum(lls_single, []), strict=True)
                diff = max(abs(a - b) for a, b in pairs)
                print(
                    f"{name:<16} {style:<10} {shots:>5} {shared:>11.1f} {single:>15.1f} "
                    f"{shared / single:>5.2f}x  {diff:.1e}",
                    flush=True,
                )


def agreement(
    tasks_dir: Path, questions: int, checkpoint: str | None, folder: Path, tokenizer_path: Path
) -> None:
    if importlib.util.find_spec("lm_eval") is None:
        print("lm-eval is not installed (pip install 'lm-eval[hf]'): agreement not measured")
        return
    from scenarios.lm_eval_compare import compare

    name, model = models(checkpoint)[0]
    hf = export_hf(model, folder / "hf", str(tokenizer_path))
    print(f"\nlm-eval agreement, {name} demo-shaped model exported to the HF layout, fp32:")
    print(f"{'shots':>5} {'questions':>9} {'max |ll diff|':>14} {'same answer':>12}  acc ours / lm-eval")
    for shots in (0, 3):
        found = compare(str(hf), [str(tasks_dir / "cloze"), str(tasks_dir / "letter")], shots, questions)
        accs = "  ".join(
            f"{key} {found.ours[key][0]:.3f}/{found.theirs[key][0]:.3f}" for key in sorted(found.ours)
        )
        print(f"{shots:>5} {found.questions:>9} {found.max_abs_diff:>14.2e} {found.same_choices:>12}  {accs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=50, help="questions per subject (demo shape)")
    parser.add_argument(
        "--checkpoint", help="score the demo model's trained weights (e.g. runs/demo/checkpoints)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="default: the demo's tokenizer")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.tokenizer.is_file():
        raise SystemExit(f"{args.tokenizer} is missing: run `make bench-eval` (it builds the demo tokenizer)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for style in ("cloze", "letter"):
            write_demo_tasks(str(folder / style), style=style, questions=args.questions)
        print(f"CPU threads: {torch.get_num_threads()}; demo task, {args.questions} questions per subject\n")
        speed_table(folder, args.questions, args.checkpoint, args.tokenizer)
        agreement(folder, min(args.questions, 20), args.checkpoint, folder, args.tokenizer)


if __name__ == "__main__":
    main()
