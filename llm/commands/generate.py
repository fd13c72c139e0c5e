"""`llm generate CHECKPOINT --tokenizer T.model (--prompt TEXT | --prompts-file F | --interactive)`.

    llm generate runs/demo/checkpoints --tokenizer data/demo/tokenizer.model \
        --prompt 床前明月光 --prompt 感冒的症状是
    llm generate s3://bkt/ckpt/ep0-ba2000-rank0.pt --tokenizer tok.model --prompts-file prompts.txt
    llm generate exported/ --tokenizer exported/tokenizer.model --interactive

CHECKPOINT is a checkpoint file, a run's checkpoint folder (its newest verified checkpoint), an
`llm import` output or an `llm export` folder. The model's shape comes from --recipe if given,
else from what the checkpoint records (the generation callback and `llm import` store it; an
export has config.json).

Checkpoints are read without running code from them (`llm.weights`): a file inside a run folder
must match its manifest; a pickle that needs more than weights is refused unless --trust.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from llm.commands import add_trust_argument
from llm.errors import ConfigError
from llm.generate import generate
from llm.weights.read import load_model
from shards.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint file or run folder (local or s3://), or exported folder"
    )
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model the model was trained with")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line")
    parser.add_argument("--interactive", action="store_true", help="read prompts from the terminal")
    parser.add_argument("--recipe", help="recipe whose model: section gives the shape")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="fix the sample (default: random)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    add_trust_argument(parser)


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompt, args.prompts_file)
    if not prompts and not args.interactive:
        raise ConfigError("no prompts: pass --prompt TEXT, --prompts-file FILE or --interactive")
    tokenizer = Tokenizer(args.tokenizer)
    ids = [tokenizer.encode_prompt(p) for p in prompts]  # empty prompts fail before the slow load
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_model(args.checkpoint, args.recipe, device=device, trust=args.trust)
    tokenizer.check_fits(model.cfg.vocab_size)
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eos_id,
        seed=args.seed,
    )

    def continue_prompts(texts: list[str], token_ids: list[list[int]]) -> None:
        outputs = generate(model, token_ids, **sampling)
        show(texts, [tokenizer.decode(out) for out in outputs])

    if prompts:
        continue_prompts(prompts, ids)
    if args.interactive:
        interact(tokenizer, continue_prompts)
    return 0


def read_prompts(given: list[str], prompts_file: str | None) -> list[str]:
    prompts = list(given)
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {prompts_file} does not exist")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts


def show(prompts: list[str], texts: list[str]) -> None:
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"{prompt}\033[1m{text}\033[0m" if sys.stdout.isatty() else f"{prompt}{text}")
        print()


def interact(tokenizer: Tokenizer, continue_prompts: Callable[[list[str], list[list[int]]], None]) -> None:
    print("type a prompt and press Enter; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            return
        if not prompt.strip():
            return
        continue_prompts([prompt], [tokenizer.encode_prompt(prompt)])
