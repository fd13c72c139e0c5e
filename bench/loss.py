"""The loss head's peak memory and time on the CPU, forward + backward: the plain path (fp32 logits of
every token, then the cross-entropy) against the chunked one (`llm.loss`), and against checkpointing
each chunk with `torch.utils.checkpoint` (the alternative `llm.loss` did not take).

    python -m bench.loss [--vocab 64000] [--tokens 16384] [--dim 128] [--chunks 512,1024,4096]

Each contender runs in a fresh process, so the process's peak RSS (ru_maxrss) less its RSS with the
inputs allocated is that contender's peak. The plain path needs about 3 fp32 [tokens, vocab] tensors
at once (13 GB at 16,384 x 64,000): where MemAvailable is short of that, it runs at the largest
number of tokens that fits (halving) and its figure at --tokens is scaled linearly (its memory is
[tokens, vocab] tensors), marked "scaled". --plain-tokens forces the plain path's size.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llm.loss import IGNORE_INDEX, chunked_loss_terms

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _plain(hidden, weight, targets, chunk):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def _chunked(hidden, weight, targets, chunk):
    terms = chunked_loss_terms(hidden, weight, targets, chunk)
    return terms.cross_entropy / terms.count


def _checkpointed(hidden, weight, targets, chunk):
    def piece(h, t):
        return F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    total = sum(
        checkpoint(piece, hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
        for s in range(0, targets.shape[0], chunk)
    )
    return total / (targets != IGNORE_INDEX).sum()


CONTENDERS = {"plain": _plain, "chunked": _chunked, "checkpoint": _checkpointed}


def one(name: str, tokens: int, vocab: int, dim: int, chunk: int) -> dict:
    """Run one contender in this process; its peak above the inputs and its seconds."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.02).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    hidden.grad = torch.zeros_like(hidden)  # the gradients' own memory is the same for every contender
    weight.grad = torch.zeros_like(weight)
    base = _rss()
    start = time.perf_counter()
    loss = CONTENDERS[name](hidden, weight, targets, chunk)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": max(0, peak - base), "seconds": seconds, "loss": loss.item()}


def run_one(name: str, tokens: int, vocab: int, dim: int, chunk: int) -> dict:
    cmd = [sys.executable, "-m", "bench.loss", "--one", name, "--tokens", str(tokens)]
    cmd += ["--vocab", str(vocab), "--dim", str(dim), "--chunks", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=64000)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunks", default="512,1024,4096")
    parser.add_argument("--plain-tokens", type=int, default=0)
    parser.add_argument("--one", choices=sorted(CONTENDERS))
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.vocab, args.dim, chunks[0])))
        return 0
    plain_tokens = args.plain_tokens or args.tokens
    while not args.plain_tokens and 4 * plain_tokens * args.vocab * 4 > 0.6 * _mem_available():
        plain_tokens //= 2
    print(
        f"loss head, forward + backward, fp32: {args.tokens:,} tokens x vocabulary {args.vocab:,} x dim "
        f"{args.dim}; {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    plain = run_one("plain", plain_tokens, args.vocab, args.dim, 0)
    scale = args.tokens / plain_tokens
    note = "" if scale == 1 else f" (scaled x{scale:g} from {plain_tokens:,} tokens: MemAvailable)"
    plain_peak, plain_s = plain["peak"] * scale, plain["seconds"] * scale
    print(f"  {'plain':<22}{plain_peak / MIB:>10,.0f} MiB {plain_s:>8.2f} s{note}")
    for chunk in chunks:
        for name in ("chunked", "checkpoint"):
            r = run_one(name, args.tokens, args.vocab, args.dim, chunk)
            print(
                f"  {name + f' {chunk}':<22}{r['peak'] / MIB:>10,.0f} MiB {r['seconds']:>8.2f} s   "
                f"{plain_peak / max(r['peak'], 1):5.1f}x less memory, {plain_s / r['seconds']:4.2f}x the speed"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
