"""`llm chat CHECKPOINT [--tokenizer T] [--prompt TEXT | --prompts-file F]`: ask a fine-tuned model.

    llm chat runs/demo-sft/checkpoints --tokenizer data/demo/tokenizer.model            # interactive
    llm chat runs/demo-sft/checkpoints --tokenizer data/demo/tokenizer.model < questions.txt   # piped
    llm chat runs/demo-sft/checkpoints --tokenizer data/demo/tokenizer.model --prompt '...' --temperature 0
    llm chat s3://bkt/ckpt/sft-001 --tokenizer tok.model --prompts-file questions.txt --json
    llm chat runs/demo-sft/export                  # an export: its own tokenizer (and chat template)

Each prompt is put in the chat template the model was fine-tuned with (`shards.chat_template`): the
one the checkpoint records (the trainer records it in every checkpoint of an SFT run; `llm export`
writes it beside an export), or `--template` (an SFT split folder such as data/sft/train, its
meta.json, or a JSON file with prompt and answer lists; needed for weights fine-tuned elsewhere,
e.g. imported from baby-llama2-chinese, or to ask a model before its fine-tuning). Generation uses
the KV cache, prints the answer as it is written, and stops at EOS or when the context is full.
Each prompt is a conversation of its own: the templates are single-turn, as in training.
Typed prompts get a `> ` prompt only on a terminal: piped in, stdout holds nothing but the answers.
The sampling flags are `llm generate`'s (`add_sampling_arguments`, defaults `llm.generate.Sampling`,
said by --help): sampled at temperature 0.8 unless `--temperature 0` (greedy, the same answer
every time).

CHECKPOINT is read as `llm generate` reads it (a file, a run's checkpoint folder, an `llm import`
output or an export; local or s3://; no code run from it without --trust), and the tokenizer as
`llm generate` finds it (--tokenizer, else the export's own, else the --recipe's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from llm.commands import add_tokenizer_argument, add_trust_argument, tokenizer_path
from llm.commands.generate import add_sampling_arguments, read_prompts, sampling_from, typed_prompts
from llm.errors import ConfigError
from llm.generate import Sampling, generate
from llm.weights.build import model_from_weights
from llm.weights.read import read_weights
from shards.chat_template import ChatTemplate, read_template
from shards.errors import ShardsError
from shards.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint file or run folder (local or s3://), or exported folder"
    )
    add_tokenizer_argument(parser)
    parser.add_argument("--prompt", action="append", default=[], help="ask this and exit (repeatable)")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line")
    parser.add_argument(
        "--template",
        help="chat template: an SFT split folder, its meta.json or a template JSON file "
        "(default: the one the checkpoint records)",
    )
    parser.add_argument("--json", action="store_true", help='one JSON line {"prompt", "answer"} per prompt')
    parser.add_argument("--recipe", help="recipe whose model: section gives the shape")
    add_sampling_arguments(parser)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    add_trust_argument(parser)


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompt, args.prompts_file)
    tokenizer = Tokenizer(tokenizer_path(args.checkpoint, args.tokenizer, args.recipe))
    given = read_template(args.template) if args.template else None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    weights = read_weights(args.checkpoint, trust=args.trust)
    template = given or recorded_template(weights.chat_template, args.checkpoint)
    model = model_from_weights(weights, args.checkpoint, args.recipe, device)
    tokenizer.check_fits(model.cfg.vocab_size)
    chat = Chat(model, tokenizer, template, sampling_from(args))
    if prompts:
        for prompt in prompts:
            chat.answer(prompt, json_line=args.json)
        return 0
    for prompt in typed_prompts():
        try:
            chat.answer(prompt, json_line=args.json)
        except (ConfigError, ShardsError) as err:  # a prompt too long or empty: say so and go on
            print(f"error: {err}", file=sys.stderr)
    return 0


def recorded_template(recorded: dict | None, checkpoint: str) -> ChatTemplate:
    if recorded is None:
        raise ConfigError(
            f"{checkpoint} records no chat template (not fine-tuned with data.kind: sft here): pass --template "
            "with the SFT shards' split folder (e.g. data/sft/train), its meta.json, or a template JSON file"
        )
    return ChatTemplate.from_dict(recorded, checkpoint)


class Chat:
    """Answers one prompt at a time with the model, printing the answer as it is written."""

    def __init__(self, model, tokenizer: Tokenizer, template: ChatTemplate, sampling: Sampling) -> None:
        self.model, self.tokenizer, self.template, self.sampling = model, tokenizer, template, sampling

    def answer(self, prompt: str, *, json_line: bool = False) -> str:
        ids = self.template.prompt_ids(self.tokenizer, prompt)  # with its template
        fitted = self.sampling.fitted([ids], self.model.cfg.max_seq_len)
        stream = None if json_line else TextStream(self.tokenizer)
        outputs = generate(
            self.model,
            [ids],
            eos_id=self.tokenizer.eos_id,
            on_step=stream.add if stream else None,
            **dataclasses.asdict(fitted),
        )
        text = self.tokenizer.decode(outputs[0])
        if stream:
            stream.close()
        else:
            print(json.dumps({"prompt": prompt, "answer": text}, ensure_ascii=False), flush=True)
        return text


class TextStream:
    """Prints the text of the tokens so far as each arrives (until EOS); a piece that ends inside a
    multi-byte character (byte fallback) waits for the rest of it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""
        self.ended = False

    def add(self, tokens) -> None:
        token = int(tokens[0])
        if self.ended or token == self.tokenizer.eos_id:
            self.ended = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids)
        sys.stdout.write((text[len(self.shown) :] if text.startswith(self.shown) else "") + "\n")
        sys.stdout.flush()
