"""The guard's demo: a run derailed at a known batch, trained through with the guard off and on.

    python -m scenarios.guard_demo --shards data/demo/shards --tokenizer data/demo/tokenizer.model \
        --out runs/guard-demo                                            (make demo-guard)

Three runs of one small recipe over the same shards, each a real `train.py` process (through the
resume harness's driver, scenarios/resume_driver.py, for its test hook):

1. clean: the recipe as it is;
2. guard off: the learning rate of the batches in the window [spike_from, spike_from + spike_batches)
   multiplied by `spike_factor` (the driver's `LLM_TEST_LR_SPIKE`): a few updates far too large,
   the kind that derails a run, at a batch known in advance;
3. guard on: the same, with the guard at its defaults (but `guard.skip` and `guard.warmup` sized to
   the run): it sees the weight norm jump at the first oversized update, rolls back to the
   checkpoint before the window and skips it.

It prints each run's final eval loss, the guard's line and the batches skipped, and draws the three
runs in one figure (`llm plot`'s, which marks rollbacks and skipped windows). The test
(tests/scenarios/test_guard_demo.py) runs it at a smaller size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from scenarios import resume


@dataclass(frozen=True)
class DemoSettings:
    """The demo's model and run; the derailed window in batches (data.skip's numbering)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    batch_size: int = 8
    max_batches: int = 300
    save_interval: int = 50
    lr: float = 3e-3
    spike_from: int = 200  # the batches after the first 200 ...
    spike_batches: int = 3  # ... up to batch 203 train at spike_factor x the learning rate
    spike_factor: float = 300.0
    guard_skip: int = 10  # guard.skip: the batches skipped after the spike's own
    guard_warmup: int = 50
    eval_batches: int = 8  # validation batches per evaluation


@dataclass(frozen=True)
class DemoRun:
    """One run: its exit code, final losses, the guard's lines and the windows it skipped."""

    name: str
    returncode: int
    eval_loss: float | None
    train_loss: float | None
    skipped: list[list[int]]
    guard_lines: list[str]
    run_dir: Path
    seconds: float


@dataclass(frozen=True)
class DemoResult:
    clean: DemoRun
    off: DemoRun
    on: DemoRun
    spike: tuple[int, int]  # the window of oversized updates [from, to)
    factor: float  # their learning rate's multiplier
    figure: Path

    @property
    def runs(self) -> list[DemoRun]:
        return [self.clean, self.off, self.on]

    def table(self) -> str:
        lines = [
            f"learning rate x{self.factor:g} in batches {self.spike[0]}-{self.spike[1]} "
            f"(windows a-b as data.skip's [a, b): the batches after the first a, up to b)",
            f"{'run':<10}{'eval loss':>10}{'train loss':>12}  batches skipped",
        ]
        for run in self.runs:
            skipped = ", ".join(f"{a}-{b}" for a, b in run.skipped) or "-"
            lines.append(f"{run.name:<10}{_num(run.eval_loss):>10}{_num(run.train_loss):>12}  {skipped}")
        return "\n".join([*lines, *self.on.guard_lines, f"figure: {self.figure}"])


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def write_recipe(path: Path, shards: Path, tokenizer: Path, s: DemoSettings) -> Path:
    """The demo's recipe over `shards` (train/ and val/): a small model, a checkpoint every save_interval."""
    meta = json.loads((shards / "train" / "meta.json").read_text())
    recipe = {
        "run_name": "guard-demo",
        "model": {
            "vocab_size": meta["vocab_size"], "dim": s.dim, "n_layers": s.n_layers, "n_heads": s.n_heads,
            "max_seq_len": meta["seq_len"], "tie_embeddings": True,
        },
        "tokenizer": {"path": str(tokenizer)},
        "data": {"train": [{"remote": str(shards / "train")}], "eval": [{"remote": str(shards / "val")}]},
        "optimizer": {"lr": s.lr},
        "scheduler": {"warmup": f"{max(1, s.max_batches // 20)}ba", "min_lr": s.lr / 10},
        "training": {
            "global_batch_size": s.batch_size, "device_microbatch_size": s.batch_size,
            "max_duration": f"{s.max_batches}ba", "eval_interval": f"{s.max_batches}ba",
            "eval_subset_num_batches": s.eval_batches, "log_interval": 5, "device": "cpu",
        },
        "checkpoint": {"save_interval": f"{s.save_interval}ba", "num_to_keep": 2},
        "guard": {"skip": s.guard_skip, "warmup": s.guard_warmup},
        "callbacks": {"generate": {"enabled": False}, "memory_monitor": False},
        "loggers": {"progress_bar": False},
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    return path


def train(
    recipe: Path, name: str, out: Path, *, guard: bool, spike: str | None, timeout: float = 1800
) -> DemoRun:
    """One training process (the harness's driver: `train.py` plus the learning-rate hook)."""
    run_dir = out / "runs" / name
    overrides = [
        f"run_name={name}", f"run_dir={run_dir}", f"checkpoint.save_folder={out / 'checkpoints' / name}",
        f"data.cache_root={out / 'cache'}", f"guard.enabled={str(guard).lower()}",
    ]  # fmt: skip
    env = {"LLM_TEST_LR_SPIKE": spike} if spike else None
    started = time.monotonic()
    result = resume.run(recipe, name, cwd=out, overrides=overrides, env=env, timeout=timeout)
    rows = _metrics(run_dir / "metrics.jsonl")
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    config = (
        yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    )
    return DemoRun(
        name=name,
        returncode=result.returncode,
        eval_loss=evals[-1] if evals else None,
        train_loss=losses[-1] if losses else None,
        skipped=(config.get("data") or {}).get("skip", []),
        guard_lines=[line for line in result.output.splitlines() if line.startswith("[guard]")],
        run_dir=run_dir,
        seconds=time.monotonic() - started,
    )


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_demo(shards: Path, tokenizer: Path, out: Path, s: DemoSettings = DemoSettings()) -> DemoResult:
    """The three runs and the figure (module docstring); `out` holds all of it."""
    from llm.plots import load_run, plot_compare

    out.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(out / "recipe.yaml", shards, tokenizer, s)
    window = (s.spike_from, s.spike_from + s.spike_batches)
    spike = f"{window[0]}:{window[1]}:{s.spike_factor:g}"
    clean = train(recipe, "clean", out, guard=False, spike=None)
    off = train(recipe, "guard-off", out, guard=False, spike=spike)
    on = train(recipe, "guard-on", out, guard=True, spike=spike)
    runs = [load_run(str(r.run_dir)) for r in (clean, off, on) if (r.run_dir / "metrics.jsonl").exists()]
    title = f"learning rate x{s.spike_factor:g} in batches {window[0]}-{window[1]}: guard off and on"
    figure = plot_compare(runs, out / "compare.png", title)
    return DemoResult(clean, off, on, window, s.spike_factor, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scenarios.guard_demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shards", type=Path, default=Path("data/demo/shards"), help="holds train/ and val/")
    parser.add_argument("--tokenizer", type=Path, default=Path("data/demo/tokenizer.model"))
    parser.add_argument("--out", type=Path, default=Path("runs/guard-demo"))
    args = parser.parse_args(argv)
    result = run_demo(args.shards.resolve(), args.tokenizer.resolve(), args.out.resolve())
    print(result.table())
    failed = [r.name for r in result.runs if r.returncode != 0]
    if failed:
        print(f"runs that failed: {', '.join(failed)} (their logs are in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
