"""`make demo-sft`'s last step: how often the demo model answers held-out reviews right, before and
after its fine-tuning, next to always answering the majority label.

The answers come from `llm chat --prompts-file ... --json --temperature 0`, the command a user runs,
once for the pretrained checkpoint (given the SFT shards' chat template with --template, as it
records none) and once for the fine-tuned one (which records its template). An answer is right
when it is exactly the label (正面 or 负面) once surrounding spaces are stripped. Accuracy is also
printed per review length (LENGTH_BUCKETS, characters), with each bucket's share of 正面: a model
that answers well only on the short reviews it was tuned on shows here.

    python -m scenarios.sft_demo --heldout data/demo/sft/heldout.jsonl --tokenizer data/demo/tokenizer.model \
        --template data/demo/sft/shards/train --before runs/demo/checkpoints --after runs/demo-sft/checkpoints
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

LENGTH_BUCKETS = ((1, 50), (51, 100), (101, 200), (201, 400))


def review_length(prompt: str) -> int:
    """Characters of the review inside a demo prompt (`convert.demo.sft.prompt_for`)."""
    from convert.demo.sft import QUESTION

    return len(prompt.removeprefix("评论：").removesuffix(" " + QUESTION))


def by_length(prompts: list[str], answers: list[str], labels: list[str]) -> dict[str, dict]:
    """Per length bucket: accuracy, count and the share of 正面 labels (what always-正面 would score)."""
    out = {}
    for low, high in LENGTH_BUCKETS:
        chosen = [i for i, p in enumerate(prompts) if low <= review_length(p) <= high]
        if chosen:
            row = score([answers[i] for i in chosen], [labels[i] for i in chosen])
            row["positive_share"] = sum(labels[i] == "正面" for i in chosen) / len(chosen)
            out[f"{low}-{high}"] = row
    return out


def fits(pairs: list[dict], tokenizer: str, template: str, max_tokens: int) -> list[dict]:
    """The pairs whose prompt, in the chat template, leaves room for an answer in `max_tokens`."""
    from shards.chat_template import read_template
    from shards.tokenizer import Tokenizer

    tok, chat = Tokenizer(tokenizer), read_template(template)
    return [p for p in pairs if len(chat.prompt_ids(tok, p["prompt"])) + 4 <= max_tokens]


def score(answers: list[str], labels: list[str]) -> dict:
    """Accuracy (exact label), and the share of answers that are one of the labels at all."""
    names = set(labels)
    right = sum(a.strip() == label for a, label in zip(answers, labels, strict=True))
    is_label = sum(a.strip() in names for a in answers)
    return {"accuracy": right / len(labels), "label_share": is_label / len(labels), "n": len(labels)}


def majority(labels: list[str]) -> tuple[str, float]:
    label, count = Counter(labels).most_common(1)[0]
    return label, count / len(labels)


def chat_answers(checkpoint: str, prompts_file: Path, tokenizer: str, template: str | None) -> list[str]:
    """`llm chat` on every prompt (greedy), as a subprocess; the answers in order."""
    command = [sys.executable, "-m", "llm", "chat", checkpoint, "--tokenizer", tokenizer,
               "--prompts-file", str(prompts_file), "--json", "--temperature", "0", "--max-new-tokens", "4"]  # fmt: skip
    if template:
        command += ["--template", template]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"llm chat failed on {checkpoint}: {done.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line)["answer"] for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scenarios.sft_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", required=True, help="JSON lines of {prompt, answer}")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument(
        "--template", required=True, help="the SFT split whose chat template the model learned"
    )
    parser.add_argument("--before", required=True, help="the pretrained checkpoint (or run folder)")
    parser.add_argument("--after", required=True, help="the fine-tuned checkpoint (or run folder)")
    parser.add_argument("--out", help="also write the figures here as JSON")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="the model's context: longer prompts are skipped"
    )
    args = parser.parse_args(argv)

    pairs = [json.loads(line) for line in Path(args.heldout).read_text(encoding="utf-8").splitlines() if line]
    fitting = fits(pairs, args.tokenizer, args.template, args.max_tokens)
    if len(fitting) < len(pairs):
        print(
            f"{len(pairs) - len(fitting)} held-out reviews do not fit {args.max_tokens} tokens with the template: skipped"
        )
    pairs = fitting
    prompts, labels = [p["prompt"] for p in pairs], [p["answer"] for p in pairs]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
        before = chat_answers(args.before, prompts_file, args.tokenizer, args.template)
        after = chat_answers(args.after, prompts_file, args.tokenizer, None)
    before_row, after_row = score(before, labels), score(after, labels)
    rows = {f"before SFT ({args.before})": before_row, f"after SFT ({args.after})": after_row}
    label, share = majority(labels)
    baseline = f"always {label} (the majority label)"
    width = max(len(name) for name in [*rows, baseline])
    print(f"SFT demo: {len(labels)} held-out reviews (never fine-tuned on), greedy answers of `llm chat`")
    print(f"  {'model':<{width}}  {'accuracy':>8}  {'answers a label':>15}")
    for name, row in rows.items():
        print(f"  {name:<{width}}  {row['accuracy']:>8.1%}  {row['label_share']:>15.1%}")
    print(f"  {baseline:<{width}}  {share:>8.1%}")
    buckets = by_length(prompts, after, labels)
    print("  after SFT, by review length (characters):")
    for name, row in buckets.items():
        print(
            f"    {name:>9}: {row['accuracy']:>6.1%} of {row['n']:>4} (正面 share {row['positive_share']:.0%})"
        )
    for prompt, answer, expected in list(zip(prompts, after, labels, strict=True))[:3]:
        print(f"  e.g. {prompt} -> {answer!r} (label {expected})")
    if args.out:
        figures = {
            "before": before_row,
            "after": after_row,
            "majority": {"label": label, "accuracy": share},
            "after_by_length": buckets,
            "before_answers": before[:20],
        }
        Path(args.out).write_text(json.dumps(figures, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
