"""`llm import --from {baby-llama2,baichuan,hf} SRC --recipe R --out OUT.pt`; `llm import --from hf SRC --model-section`.

Converts the weights (`llm.weights.baby_llama2`, `llm.weights.baichuan`, `llm.weights.hf` for a
Llama / Mistral / Qwen2 folder in transformers' layout), refusing a source whose own configuration
contradicts the recipe, and writes a checkpoint the trainer loads with
`checkpoint.load_path=OUT.pt checkpoint.load_weights_only=true`. SRC is read without running code
from it (a `.pth`/`.bin` pickle that needs more than weights is refused unless --trust).
`--model-section` prints the recipe's `model:` section that fits a Hugging Face folder instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from torch import Tensor

from llm.commands import add_trust_argument
from llm.config import load_config
from llm.errors import ConfigError
from llm.weights.baby_llama2 import import_baby_llama2
from llm.weights.baichuan import import_baichuan
from llm.weights.composer_layout import save_composer_weights
from llm.weights.hf import import_hf, model_section

# --from -> (source, recipe's model config, trust=...) -> our tensors
IMPORTERS: dict[str, Callable[..., dict[str, Tensor]]] = {
    "baby-llama2": import_baby_llama2,
    "baichuan": import_baichuan,
    "hf": import_hf,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        help="baby-llama2-chinese .pth, a Baichuan-7B folder / weights file, or (hf) a folder in transformers' "
        "layout: LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM (config.json + safetensors or .bin)",
    )
    parser.add_argument("--from", dest="source", required=True, choices=sorted(IMPORTERS))
    parser.add_argument("--recipe", help="the recipe to continue training with (its model section must fit)")
    parser.add_argument("--out", help="output .pt for checkpoint.load_path")
    parser.add_argument(
        "--model-section",
        action="store_true",
        help="with --from hf: print the recipe's model: section that fits SRC (from its config.json) and "
        "write nothing",
    )
    add_trust_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.model_section:
        if args.source != "hf":
            raise ConfigError("--model-section reads a Hugging Face config.json: use it with --from hf")
        print(model_section(args.src), end="")
        return 0
    if not (args.recipe and args.out):
        raise ConfigError(
            "llm import needs --recipe and --out (with --from hf, --model-section prints the recipe's "
            "model section first)"
        )
    cfg = load_config(args.recipe).model
    tensors = IMPORTERS[args.source](args.src, cfg, trust=args.trust)
    out = save_composer_weights(tensors, cfg, args.out)
    print(
        f"wrote {out} ({len(tensors)} tensors); train from it with checkpoint.load_path={out} "
        f"checkpoint.load_weights_only=true checkpoint.allow_untrusted_load_path=true"
    )
    return 0
