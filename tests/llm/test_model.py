"""The model: sizes of the reference recipes, causality, GQA, tying, KV cache, deterministic init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from llm.model import ModelConfig, ModelConfigError, Transformer, init_parameter_

BABY_LLAMA = ModelConfig(
    vocab_size=64793, dim=512, n_layers=8, n_heads=8, max_seq_len=512, tie_embeddings=True, norm_eps=1e-5
)
BAICHUAN_7B = ModelConfig(
    vocab_size=64000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    hidden_dim=11008,
    max_seq_len=4096,
    norm_eps=1e-6,
    tie_embeddings=False,
)


def tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=64, hidden_dim=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def test_baby_llama2_chinese_shape_has_exactly_58_479_616_parameters():
    assert BABY_LLAMA.ffn_hidden_dim == 1376
    with torch.device("meta"):
        model = Transformer(BABY_LLAMA)
    assert model.num_params() == 58_479_616


def test_baichuan_7b_shape_has_exactly_7_000_559_616_parameters_without_allocating():
    with torch.device("meta"):
        model = Transformer(BAICHUAN_7B)
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == 7_000_559_616
    assert model.num_params(exclude_embeddings=True) == 7_000_559_616 - 2 * 64000 * 4096


def test_parameter_names_and_shapes_follow_llama2c():
    cfg = tiny(n_kv_heads=2)
    shapes = {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}
    hd = 8
    expected = {
        "tok_embeddings.weight": (97, 32),
        "norm.weight": (32,),
        "output.weight": (97, 32),
    }
    for i in range(2):
        expected |= {
            f"layers.{i}.attention_norm.weight": (32,),
            f"layers.{i}.attention.wq.weight": (4 * hd, 32),
            f"layers.{i}.attention.wk.weight": (2 * hd, 32),
            f"layers.{i}.attention.wv.weight": (2 * hd, 32),
            f"layers.{i}.attention.wo.weight": (32, 4 * hd),
            f"layers.{i}.ffn_norm.weight": (32,),
            f"layers.{i}.feed_forward.w1.weight": (48, 32),
            f"layers.{i}.feed_forward.w2.weight": (32, 48),
            f"layers.{i}.feed_forward.w3.weight": (48, 32),
        }
    assert shapes == expected


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = Transformer(tiny(), seed=1)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 97) and a.dtype == torch.float32
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().amax() > 1e-4


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
    gqa = Transformer(tiny(n_kv_heads=2), seed=2)
    mha = Transformer(tiny(), seed=3)
    state = gqa.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            kv = state[f"layers.{i}.attention.{w}.weight"].view(2, 8, 32)
            # Query head h reads kv head h // 2: repeat each kv head twice, in place.
            state[f"layers.{i}.attention.{w}.weight"] = kv.repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=0, atol=1e-5)


def test_tied_embeddings_share_one_parameter_also_after_meta_materialisation():
    model = Transformer(tiny(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == Transformer(tiny()).num_params() - 97 * 32
    with torch.device("meta"):
        late = Transformer(tiny(tie_embeddings=True))
    late.to_empty(device="cpu")
    late.init_weights(0)
    assert late.output.weight.data_ptr() == late.tok_embeddings.weight.data_ptr()
    late(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    assert late.tok_embeddings.weight.grad is late.output.weight.grad


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_cached_prefill_decode_and_chunks_match_the_full_forward(kv_heads):
    model = Transformer(tiny(n_kv_heads=kv_heads), seed=4)
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(batch_size=3, max_len=32)
    with torch.no_grad():
        full = model(tokens)
        pieces = [
            model(tokens[:, a:b], cache=cache) for a, b in [(0, 9), (9, 10), (10, 14), (14, 15), (15, 20)]
        ]
    assert cache.pos == 20
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5
    cache.reset()
    with torch.no_grad():
        again = model(tokens[:, :5], cache=cache)
    assert (again - full[:, :5]).abs().max() < 1e-5


def test_left_padded_prompts_decode_like_unpadded_ones():
    model = Transformer(tiny(n_kv_heads=2), seed=5)
    gen = torch.Generator().manual_seed(3)
    short, long = torch.randint(3, 97, (1, 4), generator=gen), torch.randint(3, 97, (1, 7), generator=gen)
    pad = torch.zeros(1, 3, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, short], 1), long])
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False
    nxt = torch.tensor([[5], [6]])
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        prefill = model(batch, cache=cache, attention_mask=mask)
        step = model(nxt, cache=cache)
        alone = model(torch.cat([short, nxt[:1]], 1))
        uncached = model(batch, attention_mask=mask)
    assert (prefill[0, -1] - alone[0, 3]).abs().max() < 1e-5
    assert (step[0, 0] - alone[0, 4]).abs().max() < 1e-5
    assert (uncached[0, 3:] - alone[0, :4]).abs().max() < 1e-5
    assert torch.isfinite(prefill).all()


def test_overfilling_the_cache_is_a_clear_error():
    model = Transformer(tiny())
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="KV cache is full"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_init_equals_direct_cpu_build_bit_for_bit(tie):
    cfg = tiny(tie_embeddings=tie, n_kv_heads=2)
    direct = Transformer(cfg, seed=11)
    with torch.device("meta"):
        late = Transformer(cfg)
    late.to_empty(device="cpu")
    late.init_weights(11)
    for (name, a), (_, b) in zip(direct.state_dict().items(), late.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = Transformer(cfg, seed=12)
    assert not torch.equal(other.layers[0].attention.wq.weight, direct.layers[0].attention.wq.weight)
    assert torch.equal(other.norm.weight, direct.norm.weight)  # ones either way


def test_composer_style_per_module_materialisation_equals_direct_build():
    """Composer's FSDP calls to_empty(recurse=False), re-ties, then param_init_fn per module."""
    cfg = tiny(tie_embeddings=True)
    direct = Transformer(cfg, seed=7)
    with torch.device("meta"):
        late = Transformer(cfg, seed=7)
    for module in reversed(list(late.modules())):  # children first, as FSDP materialises
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            if module is late.tok_embeddings:
                late.output.weight = late.tok_embeddings.weight
            late.param_init_fn(module)
    for (name, a), (_, b) in zip(direct.state_dict().items(), late.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_init_value_depends_only_on_seed_name_and_shape():
    cfg = tiny()
    a, b = torch.empty(48, 32), torch.empty(48, 32, dtype=torch.float64)
    init_parameter_("layers.1.feed_forward.w1.weight", a, 3, cfg)
    init_parameter_("layers.1.feed_forward.w1.weight", b, 3, cfg)
    assert torch.equal(a, b.float())
    init_parameter_("layers.0.feed_forward.w1.weight", b, 3, cfg)
    assert not torch.equal(a, b.float())


def test_init_std_is_002_and_residual_projections_are_scaled_down():
    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=8, n_heads=4, max_seq_len=64)
    model = Transformer(cfg, seed=0)
    residual_std = 0.02 / math.sqrt(16)
    block = model.layers[3]
    for weight, std in [
        (model.tok_embeddings.weight, 0.02),
        (model.output.weight, 0.02),
        (block.attention.wq.weight, 0.02),
        (block.feed_forward.w3.weight, 0.02),
        (block.attention.wo.weight, residual_std),
        (block.feed_forward.w2.weight, residual_std),
    ]:
        assert weight.std().item() == pytest.approx(std, rel=0.03)
        assert abs(weight.mean().item()) < std * 0.05
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


def test_flops_per_token_by_hand():
    cfg = tiny()  # V=97, D=32, L=2, hidden 48, untied
    model = Transformer(cfg)
    per_block = 4 * 32 * 32 + 3 * 32 * 48 + 2 * 32
    matmul_params = 2 * per_block + 32 + 97 * 32  # blocks + final norm + output projection
    assert model.flops_per_token(16) == 6 * matmul_params + 12 * 2 * 32 * 16
    assert model.flops_per_token() == 6 * matmul_params + 12 * 2 * 32 * 64
    assert model.flops_per_batch(4, 16) == 4 * 16 * (6 * matmul_params + 12 * 2 * 32 * 16)
    tied = Transformer(tiny(tie_embeddings=True))
    assert tied.flops_per_token(16) == model.flops_per_token(16)


def test_7b_flops_per_token_by_hand():
    with torch.device("meta"):
        model = Transformer(BAICHUAN_7B)
    n = 7_000_559_616 - 64000 * 4096  # the input embedding is a lookup, not a matmul
    assert model.flops_per_token(4096) == 6 * n + 12 * 32 * 4096 * 4096


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(dim=30, n_heads=4), "divisible by model.n_heads"),
        (dict(n_kv_heads=3), "multiple of model.n_kv_heads"),
        (dict(n_layers=0), "model.n_layers must be a positive integer"),
        (dict(dim=12, n_heads=4), "must be even"),
        (dict(norm_eps=0.0), "model.norm_eps must be > 0"),
    ],
)
def test_bad_configs_are_rejected_with_a_message_naming_the_field(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        Transformer(tiny(**fields))


def test_forward_under_bf16_autocast_returns_fp32_logits_close_to_fp32():
    model = Transformer(tiny(n_kv_heads=2), seed=6)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.05


def test_training_forward_traces_as_one_graph():
    model = Transformer(tiny(), seed=8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(compiled(tokens), model(tokens))


def test_blocks_are_transformer_blocks_in_a_module_list():
    model = Transformer(tiny())
    assert isinstance(model.layers, nn.ModuleList)
    assert {type(b).__name__ for b in model.layers} == {"TransformerBlock"}
