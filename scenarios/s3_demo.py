"""`make demo-s3`: the demo streaming from object storage, preempted, and resumed from it.

    python -m scenarios.s3_demo --corpus data/demo/corpus.jsonl --tokenizer data/demo/tokenizer.model

1. starts a local S3 store (scenarios/local_s3.py: SeaweedFS on loopback, data in OUT/store);
2. converts the corpus into shards in s3://demo/shards (`python -m convert shards --out s3://...`);
3. trains the recipe (recipes/demo.yaml) streaming those shards, checkpoints in
   s3://demo/checkpoints/demo-s3; at batch `--interrupt-at` it sends SIGTERM, as a preempting
   scheduler does: the run saves at that batch and exits 143;
4. starts the same command again: it resumes from the checkpoint in the store and finishes;
5. ends with the eval loss beside the bigram baseline (scenarios/bigram.py, on the shards read back
   from the store) and the checkpoint's files listed in the store, then stops the store.

Everything stays on 127.0.0.1. The runs' own output goes to the terminal, or to `--log`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from scenarios import bigram
from scenarios.local_s3 import LocalS3, apply_env, restore_env

REPO = Path(__file__).resolve().parents[1]
BUCKET = "demo"
RUN = "demo-s3"
SHARDS = f"s3://{BUCKET}/shards"
CHECKPOINTS = f"s3://{BUCKET}/checkpoints/{RUN}"
SPAWN = subprocess.Popen  # the suite hands in its fork server's (tests/scenarios/test_s3_demo.py)
_MANIFEST = re.compile(r"manifests/ba(\d+)-rank\d+\.json$")


def say(text: str) -> None:
    print(f"[demo-s3] {text}", flush=True)


def launch(args: list[str], log, *, cwd: Path) -> subprocess.Popen:
    return SPAWN([sys.executable, *args], cwd=cwd, stdout=log, stderr=log, start_new_session=True)


def convert(corpus: Path, tokenizer: Path, seq_len: int, log, cwd: Path) -> None:
    say(f"converting {corpus} into shards in {SHARDS}")
    args = ["-m", "convert", "shards", str(corpus), "--format", "jsonl", "--tokenizer", str(tokenizer)]
    args += ["--seq-len", str(seq_len), "--val-fraction", "0.02", "--workers", "2", "--out", SHARDS]
    code = launch([*args, "--overwrite", "--no-progress"], log, cwd=cwd).wait()
    if code != 0:
        raise SystemExit(f"[demo-s3] the conversion failed (exit {code})")


def train_command(recipe: Path, tokenizer: Path, out: Path, extra: list[str]) -> list[str]:
    return [
        str(REPO / "train.py"),
        str(recipe),
        f"run_name={RUN}",
        f"run_dir={out / 'run'}",
        f"tokenizer.path={tokenizer}",
        f"data.train.0.remote={SHARDS}/train",
        f"data.eval.0.remote={SHARDS}/val",
        f"data.cache_root={out / 'cache'}",
        f"checkpoint.save_folder={CHECKPOINTS}",
        *task_folders(recipe),
        *extra,
    ]


def task_folders(recipe: Path) -> list[str]:
    """The recipe's task folders made absolute (the runs start in OUT, the recipe's paths are
    relative to where the demo was started)."""
    import yaml

    tasks = ((yaml.safe_load(recipe.read_text()).get("callbacks") or {}).get("eval_tasks") or {}).get("tasks")
    return (
        [f"callbacks.eval_tasks.tasks={json.dumps([str(Path(t).resolve()) for t in tasks])}"] if tasks else []
    )


def last_step(metrics: Path) -> int:
    """The newest step metrics.jsonl records (0 before the first)."""
    step = 0
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):
                pass  # a line being written
    return step


def interrupt(command: list[str], at: int, metrics: Path, log, cwd: Path, timeout: float) -> None:
    say(f"training {RUN}, shards streamed from {SHARDS}; SIGTERM at batch {at}")
    proc = launch(command, log, cwd=cwd)
    deadline = time.monotonic() + timeout
    while last_step(metrics) < at:
        if proc.poll() is not None:
            raise SystemExit(f"[demo-s3] the run ended (exit {proc.returncode}) before batch {at}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit(f"[demo-s3] batch {at} not reached in {timeout:.0f} s")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # the scheduler's notice: save where you are, then stop
    code = proc.wait(timeout=300)
    say(
        f"SIGTERM at batch {at}: the run saved a checkpoint at batch {saved_batch()} in {CHECKPOINTS}, exit {code}"
    )
    if code != 143:
        raise SystemExit(f"[demo-s3] the interrupted run exited {code}, not 143 (SIGTERM, saved)")


def saved_batch() -> int | None:
    """The newest batch with a manifest in the store (a checkpoint complete there)."""
    from storage import open_store

    batches = [
        int(m[1]) for rel in open_store(CHECKPOINTS).list("manifests/") if (m := _MANIFEST.search(rel))
    ]
    return max(batches, default=None)


def resume(command: list[str], log, cwd: Path) -> None:
    say(f"the same command again: it resumes from the checkpoint in {CHECKPOINTS}")
    code = launch(command, log, cwd=cwd).wait()
    if code != 0:
        raise SystemExit(f"[demo-s3] the resumed run failed (exit {code})")


def closing(store: LocalS3, recipe: Path, out: Path) -> None:
    """The eval figure beside the bigram baseline, and the checkpoint as the store holds it."""
    from storage import open_store

    shards = out / "shards"  # the baseline reads local splits: read back from the store
    source = open_store(SHARDS)
    for rel in source.list():
        source.download(rel, shards / rel)
    bigram.main(
        ["--shards", str(shards), "--metrics", str(out / "run" / "metrics.jsonl"), "--recipe", str(recipe)]
    )
    listing = open_store(CHECKPOINTS).list()
    say(f"{CHECKPOINTS} in the store (SeaweedFS at {store.endpoint}), {len(listing)} files:")
    for rel, size in sorted(listing.items()):
        print(f"  {size:>12,d}  {rel}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)  # each demo starts from an empty store and run folder
    out.mkdir(parents=True)
    recipe, tokenizer = Path(args.recipe).resolve(), Path(args.tokenizer).resolve()
    store = LocalS3(root=out / "store").start()
    say(
        f"local S3 store (SeaweedFS) at {store.endpoint}, ready in {store.started_in_s:.1f} s; data in {store.root}"
    )
    previous = apply_env(store.env)  # every process below reaches the store through these
    log = open(args.log, "ab") if args.log else None
    try:
        store.create_bucket(BUCKET)
        convert(Path(args.corpus).resolve(), tokenizer, args.seq_len, log, out)
        command = train_command(recipe, tokenizer, out, args.set)
        interrupt(command, args.interrupt_at, out / "run" / "metrics.jsonl", log, out, args.timeout)
        resume(command, log, out)
        closing(store, recipe, out)
    finally:
        if log is not None:
            log.close()
        restore_env(previous)
        store.stop()
        say("store stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="the demo corpus (JSON lines)")
    parser.add_argument("--tokenizer", required=True, help="its SentencePiece model")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "demo.yaml"))
    parser.add_argument("--out", default="runs/demo-s3", help="the store's data, the run folder, the cache")
    parser.add_argument("--seq-len", type=int, default=256, help="the shards' (= the recipe's max_seq_len)")
    parser.add_argument("--interrupt-at", type=int, default=300, help="the batch SIGTERM comes at")
    parser.add_argument("--set", action="append", default=[], help="a recipe override for both runs")
    parser.add_argument("--log", help="the runs' output to this file instead of the terminal")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to reach --interrupt-at")
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
