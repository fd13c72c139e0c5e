"""The guard's defaults against clean runs and the failures they must catch: `make bench-guard`.

    python -m bench.guard [--runs demo,tiny,poison] [--batches 300] [--workdir DIR]

Each run is a real `train.py` process (through scenarios/resume_driver.py, whose
`LLM_TEST_GUARD_SCORES` adds the guard's measures of every step to its record), with the guard on
at its defaults (`guard.window` 100, `guard.warmup` 100; only `guard.skip` sized to the run) and a
checkpoint every 50 batches, over `make demo`'s shards and tokenizer:

- demo: recipes/demo.yaml (1.8 M parameters, 8 x 256 tokens a batch, shuffled) for `--batches`;
- tiny: recipes/tiny.yaml's model (dim 512, 8 layers, 8 heads) and optimizer over the demo's
  corpus in 64-token samples (`python -m convert shards`), 4 samples a batch (far noisier than its
  own 32 x 512: the harder case for false alarms; the CPU allows no more), its vocabulary the demo
  tokenizer's 4,096 (the rows past them are never read, and the logits over 64,793 took more than
  half of a CPU step), its 1,000 warm-up steps cut to a third of the run, for `--batches`;
- poison: `make demo-guard`'s recipe (scenarios/guard_demo.py: 2 layers, dim 64, 8 x 256 tokens a
  batch) over the demo's text with crawl garbage in 2 of the 8 samples of each of the 12 batches
  after batch 200 (scenarios/poison.py, `data.shuffle: false`), then the learning rate x1e8 for the
  two batches after 260 (the driver's `LLM_TEST_LR_SPIKE`): the issue's two misses.

Printed per run: the steps judged after the warm-up, the rollbacks (the guard's lines), and the
largest value each rule measured on a step it let through (the loss's robust z and ratio to the
median, the gradient norm's ratio, the weight norm's ratio to the previous step, the longest run
of losses equal to 6 digits), beside the thresholds; a clean run must show no rollback. For the
poisoned run also the first poisoned step's measures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llm.config import GuardConfig
from scenarios import guard_demo
from scenarios import resume as rs
from scenarios.guard_demo import DemoSettings
from scenarios.poison import write_poisoned_split

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"
DEMO_RECIPE = REPO / "recipes" / "demo.yaml"
TINY_RECIPE = REPO / "recipes" / "tiny.yaml"
TINY_SEQ_LEN = 64
TINY_VOCAB = 4096  # the demo tokenizer's pieces (recipes/demo.yaml's model.vocab_size)
POISON = (200, 212)  # the poisoned batches, data.skip's numbering
POISON_PER_BATCH = 2
COLLAPSE = (260, 262, 1e8)  # learning rate x1e8 for the batches after 260 up to 262
COMMON = [
    "guard.enabled=true", "checkpoint.save_interval=50ba", "checkpoint.num_to_keep=2",
    "callbacks.generate.enabled=false", "callbacks.eval_tasks.tasks=[]", "callbacks.loss_plot=false",
    "loggers.progress_bar=false", "training.eval_interval=100000ba",
]  # fmt: skip
MEASURES = ("loss_z", "loss_ratio", "grad_ratio", "weight_ratio", "flat")


@dataclass(frozen=True)
class Measured:
    """One run's guard: its steps judged after warm-up, its lines, and the largest let-through values."""

    name: str
    returncode: int
    judged: int
    lines: list[str]
    largest: dict[str, float]
    rows: list[dict]
    seconds: float


def thresholds(cfg: GuardConfig) -> dict[str, str]:
    """When each rule fires, or "off"."""

    def above(value: float, text: str) -> str:
        return text if value else "off"

    return {
        "loss_z": above(cfg.loss_z, f"> {cfg.loss_z:g} (and ratio > {1 + cfg.loss_rise:g})"),
        "loss_ratio": above(cfg.loss_factor, f"> {cfg.loss_factor:g}"),
        "grad_ratio": above(cfg.grad_factor, f"> {cfg.grad_factor:g}"),
        "weight_ratio": above(cfg.weight_factor, f"> {cfg.weight_factor:g}"),
        "flat": above(cfg.flat_steps, f">= {cfg.flat_steps}"),
    }


def measure(name: str, run: rs.Run, warmup: int) -> Measured:
    """The guard's measures of the steps it judged after `warmup` good steps and let through."""
    rows = [r for r in run.batches() if r.get("guard")]
    spikes = {int(line.split(" at batch ")[1].split()[0]) for line in _lines(run)}
    judged = [r for r in rows[warmup:] if r["batch"] not in spikes]
    largest = {k: max((r["guard"][k] for r in judged if r["guard"][k] is not None), default=float("nan"))
               for k in MEASURES}  # fmt: skip
    return Measured(name, run.returncode, len(judged), _lines(run), largest, rows, run.seconds)


def _lines(run: rs.Run) -> list[str]:
    return [line for line in run.output.splitlines() if line.startswith("[guard]")]


def train(recipe: Path, name: str, work: Path, overrides: list[str], env: dict | None = None) -> rs.Run:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    over = [
        f"run_name=bench-guard-{name}", f"run_dir={folder / 'run'}", f"checkpoint.save_folder={folder / 'ckpt'}",
        f"data.cache_root={folder / 'cache'}", *COMMON, *overrides,
    ]  # fmt: skip
    started = time.monotonic()
    proc, record, weights = rs.start(
        recipe,
        name,
        cwd=REPO,
        overrides=over,
        env={"LLM_TEST_GUARD_SCORES": "1", **(env or {})},
        folder=folder,
    )
    return rs.finish(proc, record, weights, started, timeout=6 * 3600)


def demo_run(work: Path, batches: int) -> rs.Run:
    return train(DEMO_RECIPE, "demo", work, [f"training.max_duration={batches}ba"])


def tiny_run(work: Path, batches: int) -> rs.Run:
    shards = work / "tiny-shards"
    if not (shards / "train" / "index.json").exists():
        subprocess.run(
            [sys.executable, "-m", "convert", "shards", str(DEMO / "corpus.jsonl"), "--format", "jsonl",
             "--tokenizer", str(DEMO / "tokenizer.model"), "--seq-len", str(TINY_SEQ_LEN), "--val-fraction", "0.02",
             "--out", str(shards), "--overwrite"],
            cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
    return train(
        TINY_RECIPE, "tiny", work,
        [
            f"tokenizer.path={DEMO / 'tokenizer.model'}", f"data.train.0.remote={shards / 'train'}",
            f"data.eval.0.remote={shards / 'val'}", "fsdp.enabled=false", f"model.max_seq_len={TINY_SEQ_LEN}",
            f"model.vocab_size={TINY_VOCAB}",
            "training.global_batch_size=4", "training.device_microbatch_size=4", "training.precision=fp32",
            f"training.max_duration={batches}ba", f"scheduler.warmup={batches // 3}ba",
            "training.eval_subset_num_batches=1", "training.device=cpu",
        ],
    )  # fmt: skip


def poison_run(work: Path, batches: int) -> tuple[rs.Run, set[str]]:
    texts = (json.loads(line)["text"] for line in (DEMO / "corpus.jsonl").open(encoding="utf-8"))
    split = write_poisoned_split(
        work / "poisoned" / "train", DEMO / "tokenizer.model", texts, seq_len=256, batch_size=8,
        num_batches=batches, window=POISON, per_batch=POISON_PER_BATCH,
    )  # fmt: skip
    settings = DemoSettings(max_batches=batches)
    recipe = guard_demo.write_recipe(
        work / "poison" / "recipe.yaml", split.folder.parent, DEMO / "tokenizer.model", settings
    )
    a, b = POISON
    run = train(
        recipe, "poison", work,
        [f"data.eval.0.remote={DEMO / 'shards' / 'val'}", "data.shuffle=false", f"guard.warmup={GuardConfig().warmup}",
         f"guard.skip={b - a - 1}"],
        env={"LLM_TEST_LR_SPIKE": f"{COLLAPSE[0]}:{COLLAPSE[1]}:{COLLAPSE[2]:g}"},
    )  # fmt: skip
    return run, set(split.garbage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guard", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="demo,tiny,poison", help="which runs, comma-separated")
    parser.add_argument(
        "--batches", type=int, default=300, help="batches per run (at least 300 for the claim)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="default: a temp folder, deleted at the end"
    )
    args = parser.parse_args(argv)
    missing = [
        p for p in (DEMO / "shards" / "train" / "index.json", DEMO / "tokenizer.model") if not p.exists()
    ]
    if missing:
        print(f"missing {missing[0]}: build the demo's inputs first (make data/demo/shards/train/index.json)",
              file=sys.stderr)  # fmt: skip
        return 2
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-guard-"))).resolve()
    cfg = GuardConfig()
    print(f"guard defaults: window {cfg.window}, warm-up {cfg.warmup} steps; in {work}")
    failed = False
    for name in args.runs.split(","):
        garbage: set[str] = set()
        if name == "demo":
            run = demo_run(work, args.batches)
        elif name == "tiny":
            run = tiny_run(work, args.batches)
        elif name == "poison":
            run, garbage = poison_run(work, args.batches)
        else:
            parser.error(f"unknown run {name!r}: demo, tiny or poison")
        result = measure(name, run, cfg.warmup)
        report(result, cfg, garbage)
        failed |= result.returncode != 0
    if not failed and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def report(result: Measured, cfg: GuardConfig, garbage: set[str]) -> None:
    print(f"\n{result.name}: exit {result.returncode}, {result.seconds:.0f} s, {result.judged} steps judged "
          f"after the warm-up and let through, {len(result.lines)} rollback(s)")  # fmt: skip
    limits = thresholds(cfg)
    for key in MEASURES:
        print(f"  largest {key:<13}{result.largest[key]:>10.4g}   rule: {limits[key]}")
    for line in result.lines:
        print(f"  {line}")
    poisoned = [r for r in result.rows if garbage & set(r.get("samples", []))]
    if poisoned:
        first = poisoned[0]
        g = first["guard"]
        print(f"  first poisoned batch {first['batch']} (of {len(poisoned)} trained on): loss {first['loss']:.4g}, "
              f"z {g['loss_z']:.4g}, ratio {g['loss_ratio']:.4g}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
