"""`llm generate CHECKPOINT [--tokenizer T] (--prompt TEXT | --prompts-file F | --interactive) [--json]`.

    llm generate runs/demo/checkpoints --tokenizer data/demo/tokenizer.model \
        --prompt 床前明月光 --prompt 感冒的症状是
    llm generate s3://bkt/ckpt/ep0-ba2000-rank0.pt --tokenizer tok.model --prompts-file prompts.txt --json
    llm generate exported/ --interactive             # the export's own tokenizer.model or tokenizer.json

CHECKPOINT is a checkpoint file, a run's checkpoint folder (its newest verified checkpoint), an
`llm import` output or an `llm export` folder. The model's shape comes from --recipe if given,
else from what the checkpoint records (the generation callback and `llm import` store it; an
export has config.json). The tokenizer is --tokenizer (a SentencePiece .model, a Hugging Face
tokenizer.json or a folder holding one), else the one an exported folder holds, else the
--recipe's tokenizer.path.

Each prompt's continuation is printed after it, a blank line between them; with `--json`, one JSON
object per line, `{"prompt": ..., "continuation": ...}`, for scripts (a continuation may itself
hold blank lines). The sampling flags are `llm chat`'s (`add_sampling_arguments`, defaults
`llm.generate.Sampling`, said by --help): new tokens never go past the model's context, and
`--temperature 0` is greedy. Typed prompts (`--interactive`) get a `> `
prompt only on a terminal: piped in, stdout holds nothing but the continuations.

Checkpoints are read without running code from them (`llm.weights`): a file inside a run folder
must match its manifest; a pickle that needs more than weights is refused unless --trust.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from llm.commands import add_tokenizer_argument, add_trust_argument, tokenizer_path
from llm.errors import ConfigError
from llm.generate import Sampling, generate
from llm.weights.read import load_model
from shards.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint file or run folder (local or s3://), or exported folder"
    )
    add_tokenizer_argument(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line")
    parser.add_argument("--interactive", action="store_true", help="read prompts from the terminal")
    parser.add_argument(
        "--json", action="store_true", help='one JSON line {"prompt", "continuation"} per prompt'
    )
    parser.add_argument("--recipe", help="recipe whose model: section gives the shape")
    add_sampling_arguments(parser)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    add_trust_argument(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling flags of `llm generate` and `llm chat`: one set, `llm.generate.Sampling`'s defaults."""
    default = Sampling()
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-new-tokens",
        type=int,
        default=default.max_new_tokens,
        help=f"at most this many new tokens, never past the model's context (default {default.max_new_tokens})",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=default.temperature,
        help=f"0 = greedy, the same text every time (default {default.temperature:g}: sampled)",
    )
    group.add_argument(
        "--top-k",
        type=int,
        default=default.top_k,
        help=f"sample among the k most likely tokens; 0 = all (default {default.top_k})",
    )
    group.add_argument(
        "--top-p",
        type=float,
        default=default.top_p,
        help=f"and among the fewest whose probability reaches p; 1 = all (default {default.top_p:g})",
    )
    group.add_argument("--seed", type=int, default=default.seed, help="fix the sample (default: a fresh one)")


def sampling_from(args: argparse.Namespace) -> Sampling:
    """The `Sampling` that the flags of `add_sampling_arguments` ask for."""
    return Sampling(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sampling)})


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompt, args.prompts_file)
    if not prompts and not args.interactive:
        raise ConfigError("no prompts: pass --prompt TEXT, --prompts-file FILE or --interactive")
    tokenizer = Tokenizer(tokenizer_path(args.checkpoint, args.tokenizer, args.recipe))
    ids = [tokenizer.encode_prompt(p) for p in prompts]  # empty prompts fail before the slow load
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = load_model(args.checkpoint, args.recipe, device=device, trust=args.trust)
    tokenizer.check_fits(model.cfg.vocab_size)
    sampling = sampling_from(args)

    def continue_prompts(texts: list[str], token_ids: list[list[int]]) -> None:
        fitted = sampling.fitted(token_ids, model.cfg.max_seq_len)
        outputs = generate(model, token_ids, eos_id=tokenizer.eos_id, **dataclasses.asdict(fitted))
        show(texts, [tokenizer.decode(out) for out in outputs], as_json=args.json)

    if prompts:
        continue_prompts(prompts, ids)
    if args.interactive:
        for prompt in typed_prompts():
            continue_prompts([prompt], [tokenizer.encode_prompt(prompt)])
    return 0


def read_prompts(given: list[str], prompts_file: str | None) -> list[str]:
    prompts = list(given)
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {prompts_file} does not exist")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts


def show(prompts: list[str], texts: list[str], as_json: bool = False) -> None:
    for prompt, text in zip(prompts, texts, strict=True):
        if as_json:
            print(json.dumps({"prompt": prompt, "continuation": text}, ensure_ascii=False), flush=True)
        else:
            print(f"{prompt}\033[1m{text}\033[0m" if sys.stdout.isatty() else f"{prompt}{text}")
            print()


def typed_prompts() -> Iterator[str]:
    """Prompts read one per line until an empty line or the end of input. The `> ` prompt and the
    hint go out only when stdin is a terminal: piped in, stdout holds nothing but the answers."""
    terminal = sys.stdin.isatty()
    if terminal:
        print("type a prompt and press Enter; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            prompt = input("> " if terminal else "")
        except EOFError:
            return
        if not prompt.strip():
            return
        yield prompt
