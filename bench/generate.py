"""Generation speed on the CPU: tokens/s with and without the KV cache, and the callback's cost.

    python -m bench.generate [--new-tokens 128] [--threads N]

1. The tiny recipe's shape (baby-llama2-chinese: vocab 64,793, dim 512, 8 layers, 8 heads, tied;
   random weights), one 16-token prompt, 128 new tokens, greedy: cached vs uncached tokens/s.
2. One call of the generation callback's work on the demo recipe's shape (vocab 4,096, dim 256,
   4 layers, 4 heads) with the demo settings: 3 prompts, 48 new tokens, top-k 50, temperature 0.8.
"""

from __future__ import annotations

import argparse
import time

import torch

from llm.generate import generate
from llm.model import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=64793, dim=512, n_layers=8, n_heads=8, max_seq_len=512, tie_embeddings=True)
DEMO = ModelConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, max_seq_len=256, tie_embeddings=True)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cache_speed(new_tokens: int) -> None:
    model = Transformer(TINY, seed=0).eval()
    prompt = [list(range(100, 116))]
    kwargs = dict(max_new_tokens=new_tokens, temperature=0)
    generate(model, prompt, max_new_tokens=4, temperature=0)  # warm-up
    cached = timed(lambda: generate(model, prompt, use_cache=True, **kwargs))
    uncached = timed(lambda: generate(model, prompt, use_cache=False, **kwargs))
    print(f"tiny recipe shape ({model.num_params():,} params), {new_tokens} new tokens, batch 1, greedy:")
    print(f"  with KV cache     {new_tokens / cached:8.1f} tokens/s  ({cached:.2f} s)")
    print(f"  without KV cache  {new_tokens / uncached:8.1f} tokens/s  ({uncached:.2f} s)")
    print(f"  speed-up          {uncached / cached:8.1f}x")


def callback_cost() -> None:
    model = Transformer(DEMO, seed=0)
    prompts = [[2, 10, 11], [2, 20, 21, 22], [2, 30]]  # EOS + 1-3 pieces, like the demo prompts
    kwargs = dict(max_new_tokens=48, temperature=0.8, top_k=50, seed=1234)
    generate(model, prompts, **kwargs)  # warm-up
    seconds = min(timed(lambda: generate(model, prompts, **kwargs)) for _ in range(3))
    print(f"demo recipe shape ({model.num_params():,} params): one callback call (3 prompts x 48 tokens)")
    print(f"  {seconds:.3f} s per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    cache_speed(args.new_tokens)
    callback_cost()


if __name__ == "__main__":
    main()
