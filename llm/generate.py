"""Text continuation for our Transformer: the one implementation behind the callback and `llm generate`.

Prompts of different lengths run as one batch: they are left-padded and the padding is masked
(`Transformer.forward(..., attention_mask=...)`), so every row's last prompt token sits in the same
column and one forward pass per step serves all rows. With `use_cache=True` the prompt is run once
(prefill) and each step feeds only the newest token through a KV cache; without it every step
re-reads the whole sequence. Both give the same tokens.

Sampling draws from its own `torch.Generator`: the global RNG that training uses is never touched,
and the same seed gives the same text on every rank (FSDP needs all ranks to run the same steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llm.errors import ConfigError

PAD_ID = 0  # any id works: padded positions are masked out of attention


@dataclass(frozen=True)
class Sampling:
    """How a command picks new tokens: `llm generate`'s and `llm chat`'s settings, one default each
    (their flags are made from these: `llm.commands.generate.add_sampling_arguments`)."""

    max_new_tokens: int = 256  # at most this many new tokens, and never past the model's context
    temperature: float = 0.8  # 0: greedy, the same text every time
    top_k: int = 50  # sample among the k most likely tokens; 0: all
    top_p: float = 1.0  # and among the fewest whose probability reaches p; 1: all
    seed: int | None = None  # None: a fresh sample each time (seeded from the OS)

    def fitted(self, prompts: Sequence[Sequence[int]], context: int) -> Sampling:
        """These settings with `max_new_tokens` cut to the room the longest prompt leaves in a
        `context`-token model; ConfigError if it leaves none."""
        longest = max(len(p) for p in prompts)
        if longest >= context:
            raise ConfigError(
                f"the prompt takes {longest} tokens, the model's whole context of {context}: shorten it"
            )
        return dataclasses.replace(self, max_new_tokens=min(self.max_new_tokens, context - longest))


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    sync_tokens: Callable[[Tensor], Tensor] | None = None,
    on_step: Callable[[Tensor], None] | None = None,
) -> list[list[int]]:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens; returns the new tokens.

    `temperature=0` is greedy; otherwise logits are divided by it, cut to the `top_k` most likely
    (0 = all) and to the smallest set whose probability reaches `top_p`, then sampled. A row stops
    at `eos_id` (the EOS itself is not returned); the batch stops when every row has. `seed=None`
    seeds from the OS. `sync_tokens`, if given, maps the chosen tokens `[B]` to the ones all ranks
    use (e.g. a broadcast from rank 0), keeping distributed ranks in lockstep. `on_step`, if given,
    receives each step's tokens `[B]` as they are chosen (`llm chat` streams them this way).
    The model's train/eval mode is restored afterwards.
    """
    _check_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _generate(
                model,
                prompts,
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                eos_id,
                seed,
                use_cache,
                sync_tokens,
                on_step,
            )
    finally:
        model.train(was_training)


def _generate(
    model, prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed, use_cache, sync, on_step
):
    device = _device_of(model)
    tokens, mask = left_pad(prompts, device)
    # A mask costs an explicit [B, 1, T, S] tensor; equal-length prompts can use the causal kernel.
    prompt_mask = None if bool(mask.all()) else mask
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # from the OS; torch.seed() would re-seed the global RNG instead
    else:
        generator.manual_seed(seed)
    batch = len(prompts)
    cache = model.new_cache(batch, tokens.shape[1] + max_new_tokens, device=device) if use_cache else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens: list[Tensor] = []
    step_input = tokens
    for step in range(max_new_tokens):
        if cache is not None:
            logits = model(step_input, cache=cache, attention_mask=prompt_mask if step == 0 else None)
        else:
            logits = model(tokens, attention_mask=prompt_mask)
        chosen = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        if sync is not None:
            chosen = sync(chosen)
        new_tokens.append(chosen)
        if on_step is not None:
            on_step(chosen)
        if eos_id is not None:
            finished |= chosen == eos_id
            if bool(finished.all()):
                break
        step_input = chosen[:, None]
        tokens = torch.cat([tokens, step_input], dim=1)
        if prompt_mask is not None:
            prompt_mask = torch.cat([prompt_mask, torch.ones_like(step_input, dtype=torch.bool)], dim=1)
    return _cut_at_eos(torch.stack(new_tokens, dim=1).tolist() if new_tokens else [[]] * batch, eos_id)


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """`[B, T]` token ids right-aligned (left-padded with PAD_ID) and the bool mask of real tokens."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = True
    return tokens.to(device), mask.to(device)


def sample_next(
    logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> Tensor:
    """One token per row from `logits [B, V]`; greedy when temperature is 0."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    # Inverse-CDF sampling with one uniform draw per row: the draws depend only on the generator,
    # not on the probabilities, so two runs whose logits differ by rounding pick the same tokens.
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Zero every token outside the smallest most-likely set whose total probability reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _cut_at_eos(rows: list[list[int]], eos_id: int | None) -> list[list[int]]:
    if eos_id is None:
        return rows
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters())
    return param.device


def _check_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p) -> None:
    if not prompts:
        raise ConfigError("no prompts given: pass at least one prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i} is empty: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if top_k < 0 or not 0.0 < top_p <= 1.0 or temperature < 0:
        raise ConfigError(
            f"sampling settings out of range: temperature={temperature} (>= 0), top_k={top_k} (>= 0), "
            f"top_p={top_p} (in (0, 1])"
        )
    longest = max(len(p) for p in prompts) + max_new_tokens
    limit = model.cfg.max_seq_len
    if longest > limit:
        raise ConfigError(
            f"the longest prompt plus max_new_tokens is {longest} tokens, beyond the model's context "
            f"of {limit}: shorten the prompt or lower max_new_tokens"
        )
    vocab = model.cfg.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
