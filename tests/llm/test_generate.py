"""Generation with a KV cache: same tokens as without, batching, EOS, seeds, sampling filters."""

from __future__ import annotations

import pytest
import torch

from llm.errors import ConfigError
from llm.generate import generate, sample_next
from llm.model import ModelConfig, Transformer

PROMPTS = [[5, 17, 3, 99, 42, 7], [11], [8, 8, 120, 64]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = Transformer(cfg, seed=3)
    # Larger weights than the 0.02 init give peaked, prompt-dependent distributions, so a
    # padding or caching mistake changes the chosen tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def test_cached_and_uncached_greedy_give_the_same_tokens(model):
    cached = generate(model, PROMPTS, max_new_tokens=20, temperature=0, use_cache=True)
    uncached = generate(model, PROMPTS, max_new_tokens=20, temperature=0, use_cache=False)
    assert cached == uncached
    assert all(len(row) == 20 for row in cached)


def test_cached_and_uncached_sampling_with_one_seed_give_the_same_tokens(model):
    kwargs = dict(max_new_tokens=20, temperature=1.0, top_k=40, top_p=0.9, seed=7)
    assert generate(model, PROMPTS, use_cache=True, **kwargs) == generate(
        model, PROMPTS, use_cache=False, **kwargs
    )


def test_batched_prompts_of_different_lengths_match_one_prompt_at_a_time(model):
    batched = generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    alone = [generate(model, [p], max_new_tokens=12, temperature=0)[0] for p in PROMPTS]
    assert batched == alone


def test_the_seed_fixes_the_sample_and_different_seeds_differ(model):
    a = generate(model, PROMPTS, max_new_tokens=16, temperature=1.5, seed=1)
    b = generate(model, PROMPTS, max_new_tokens=16, temperature=1.5, seed=1)
    c = generate(model, PROMPTS, max_new_tokens=16, temperature=1.5, seed=2)
    assert a == b
    assert a != c


def test_generation_leaves_the_global_rng_and_train_mode_alone(model):
    model.train()
    before = torch.get_rng_state()
    generate(model, PROMPTS, max_new_tokens=5, temperature=1.0, seed=None)
    generate(model, PROMPTS, max_new_tokens=5, temperature=1.0, seed=3)
    assert torch.equal(before, torch.get_rng_state())
    assert model.training
    model.eval()
    generate(model, PROMPTS, max_new_tokens=2, temperature=0)
    assert not model.training


def test_a_row_stops_at_eos_and_the_batch_stops_when_all_rows_have(model):
    free = generate(model, PROMPTS, max_new_tokens=10, temperature=0)
    eos = free[0][3]  # row 0 reaches "EOS" at its 4th token
    stopped = generate(model, PROMPTS, max_new_tokens=10, temperature=0, eos_id=eos)
    assert stopped[0] == free[0][:3]
    for full, cut in zip(free, stopped, strict=True):
        assert cut == (full[: full.index(eos)] if eos in full else full)
    # All rows end at once when EOS is each row's first choice: no further forward passes.
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        firsts = [row[0] for row in free]
        out = generate(model, [PROMPTS[0]], max_new_tokens=10, temperature=0, eos_id=firsts[0])
    finally:
        handle.remove()
    assert out == [[]] and len(calls) == 1


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=1, seed=5) == greedy
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5) == greedy


def test_sampling_follows_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_next(logits, 1.0, 0, 1.0, gen), minlength=4).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    top_k = torch.bincount(sample_next(logits, 1.0, 2, 1.0, gen), minlength=4).float() / 4000
    assert top_k[2:].sum() == 0 and abs(top_k[0] - 0.625) < 0.03
    top_p = torch.bincount(sample_next(logits, 1.0, 0, 0.9, gen), minlength=4).float() / 4000
    assert top_p[3] == 0 and top_p[2] > 0  # 0.5 + 0.3 < 0.9, so the third token stays


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([], {}, "no prompts"),
        ([[1] * 60], {"max_new_tokens": 10}, "beyond the model's context"),
        ([[1, 500]], {}, "outside the model's vocabulary"),
        ([[1]], {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_arguments_raise_one_clear_error(model, prompts, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        generate(model, prompts, **{"max_new_tokens": 4, **kwargs})
