"""`llm import --from {baby-llama2,baichuan} SRC --recipe R --out OUT.pt`.

Converts the weights (`llm.weights.baby_llama2`, `llm.weights.baichuan`), refusing a source whose own configuration
contradicts the recipe, and writes a checkpoint the trainer loads with
`checkpoint.load_path=OUT.pt checkpoint.load_weights_only=true`. SRC is read without running code
from it (a `.pth`/`.bin` pickle that needs more than weights is refused unless --trust).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from torch import Tensor

from llm.commands import add_trust_argument
from llm.config import load_config
from llm.weights.baby_llama2 import import_baby_llama2
from llm.weights.baichuan import import_baichuan
from llm.weights.composer_layout import save_composer_weights

# --from -> (source, recipe's model config, trust=...) -> our tensors
IMPORTERS: dict[str, Callable[..., dict[str, Tensor]]] = {
    "baby-llama2": import_baby_llama2,
    "baichuan": import_baichuan,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="baby-llama2-chinese .pth, or a Baichuan-7B folder / weights file")
    parser.add_argument("--from", dest="source", required=True, choices=sorted(IMPORTERS))
    parser.add_argument("--recipe", required=True, help="the recipe to continue training with")
    parser.add_argument("--out", required=True, help="output .pt for checkpoint.load_path")
    add_trust_argument(parser)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe).model
    tensors = IMPORTERS[args.source](args.src, cfg, trust=args.trust)
    out = save_composer_weights(tensors, cfg, args.out)
    print(
        f"wrote {out} ({len(tensors)} tensors); train from it with checkpoint.load_path={out} "
        f"checkpoint.load_weights_only=true checkpoint.allow_untrusted_load_path=true"
    )
    return 0
