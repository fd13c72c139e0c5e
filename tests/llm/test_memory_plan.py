"""The dry-run memory plan, checked against arithmetic written out by hand."""

from __future__ import annotations

import pytest

from llm.memory_plan import GIB, MemoryPlanError, describe, plan_memory
from llm.model import ModelConfig, count_params

BAICHUAN_7B = ModelConfig(
    vocab_size=64000, dim=4096, n_layers=32, n_heads=32, hidden_dim=11008, max_seq_len=4096, norm_eps=1e-6
)
GB = 1e9


def test_small_model_plan_matches_hand_calculation_bf16():
    cfg = ModelConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16)
    plan = plan_memory(
        cfg, n_gpus=3, micro_batch=2, seq_len=16, compute="bf16", activation_checkpointing=True
    )
    # Block: 4 attention matrices 64x64, 3 SwiGLU matrices 64x96, 2 norms of 64.
    block = 4 * 64 * 64 + 3 * 64 * 96 + 2 * 64  # 34,944
    root = 100 * 64 + 100 * 64 + 64  # embedding, output, final norm: 12,864
    total = 2 * block + root  # 82,752
    assert total == 82_752
    shard = 27_584  # 82,752 / 3, exactly
    assert plan.weights == shard * 4
    assert plan.gradients == shard * 4
    assert plan.optimizer == shard * 8
    assert plan.gathered_params == 2 * (root + 2 * block)
    assert plan.gradient_buffers == 2 * root + (2 + 4) * block
    tokens = 2 * 16
    # Per layer: two norms (fp32 copy + bf16 normalised), attention 5 x h, SwiGLU h + 4 x f, in bf16.
    layer = 2 * tokens * 64 * (4 + 2) + tokens * 2 * 5 * 64 + tokens * 2 * (64 + 4 * 96)
    assert layer == tokens * (24 * 64 + 8 * 96)
    assert plan.activations_no_checkpointing == 2 * layer
    assert plan.activations_checkpointing == 2 * tokens * 64 * 2 + layer
    assert plan.loss_head == tokens * 64 * 6 + tokens * 64 * 2 + tokens * 100 * 14
    static = shard * 16 + 2 * (root + 2 * block) + 2 * root + 6 * block
    assert plan.total == static + plan.activations_checkpointing + plan.loss_head
    assert plan.host_memory_per_rank == 4 * 100 * 64
    assert plan.host_memory_per_rank_eager == 4 * total


def test_fp32_compute_doubles_activations_and_drops_the_reduce_copy():
    cfg = ModelConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16)
    plan = plan_memory(
        cfg, n_gpus=2, micro_batch=1, seq_len=8, compute="fp32", activation_checkpointing=False
    )
    block, root = 34_944, 12_864
    assert plan.gathered_params == 4 * (root + 2 * block)
    assert plan.gradient_buffers == 4 * root + 4 * block
    layer = 2 * 8 * 64 * 8 + 8 * 4 * 5 * 64 + 8 * 4 * (64 + 4 * 96)
    assert plan.activations_no_checkpointing == 2 * layer
    assert plan.total == plan.total_no_checkpointing


def test_7b_plan_on_8_gpus_matches_hand_calculation_and_fits_80gb():
    plan = plan_memory(
        BAICHUAN_7B, n_gpus=8, micro_batch=2, seq_len=4096, compute="bf16", activation_checkpointing=True
    )
    # 7,000,559,616 / 8 = 875,069,952 parameters per GPU.
    assert plan.weights == 3_500_279_808
    assert plan.gradients == 3_500_279_808
    assert plan.optimizer == 7_000_559_616
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # 202,383,360
    root = 2 * 64000 * 4096 + 4096  # 524,292,096
    assert plan.gathered_params == 2 * (524_292_096 + 2 * 202_383_360) == 1_858_117_632
    assert plan.gradient_buffers == 2 * root + 6 * block == 2_262_884_352
    tokens = 2 * 4096
    layer = tokens * (24 * 4096 + 8 * 11008)  # 186,368 bytes per token per layer
    assert layer == 1_526_726_656
    assert plan.activations_checkpointing == 32 * tokens * 4096 * 2 + layer == 3_674_210_304
    assert plan.activations_no_checkpointing == 32 * layer == 48_855_252_992
    assert plan.loss_head == tokens * 4096 * 8 + tokens * 64000 * 14 == 7_608_467_456
    expected_total = 2 * 3_500_279_808 + 7_000_559_616 + 1_858_117_632 + 2_262_884_352
    expected_total += 3_674_210_304 + 7_608_467_456
    assert plan.total == expected_total == 29_404_798_976
    assert plan.fits(80 * GB)
    assert plan.host_memory_per_rank == 4 * 64000 * 4096  # one embedding matrix, ~1 GiB
    assert plan.host_memory_per_rank_eager == 4 * 7_000_559_616


def test_7b_needs_sharding_and_checkpointing_to_fit():
    one_gpu = plan_memory(BAICHUAN_7B, n_gpus=1, micro_batch=1, seq_len=4096, activation_checkpointing=True)
    assert one_gpu.weights + one_gpu.gradients + one_gpu.optimizer == 16 * 7_000_559_616
    assert not one_gpu.fits(80 * GB)
    no_ckpt = plan_memory(BAICHUAN_7B, n_gpus=8, micro_batch=2, seq_len=4096, activation_checkpointing=False)
    assert not no_ckpt.fits(80 * GB)
    assert plan_memory(
        BAICHUAN_7B, n_gpus=8, micro_batch=1, seq_len=4096, activation_checkpointing=True
    ).fits(80 * GB)


def test_format_prints_a_readable_table_in_gib():
    plan = plan_memory(BAICHUAN_7B, n_gpus=8, micro_batch=1, seq_len=4096, activation_checkpointing=True)
    table = plan.format(gpu_gb=80)
    assert "8 GPU(s)" in table and "GiB" in table
    assert "AdamW state (2 x fp32, sharded)" in table
    assert f"{plan.optimizer / 1024**3:.2f} GiB" in table
    assert "TOTAL with full checkpointing" in table and "TOTAL with selective checkpointing" in table
    assert "fits" in table


def test_describe_reports_params_flops_and_tokens_per_step():
    summary = describe(BAICHUAN_7B, seq_len=4096, global_batch_tokens=512 * 4096)
    assert summary.params == 7_000_559_616
    assert summary.tokens_per_step == 2_097_152
    flops = 6 * (7_000_559_616 - 64000 * 4096) + 12 * 32 * 4096 * 4096
    assert summary.flops_per_token == flops
    assert summary.flops_per_step == flops * 2_097_152
    assert "7,000,559,616" in summary.format()


def test_count_params_splits_blocks_and_root():
    counts = count_params(BAICHUAN_7B)
    assert (counts.block, counts.root, counts.largest) == (202_383_360, 524_292_096, 64000 * 4096)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_gpus=0), "n_gpus must be a positive integer"),
        (dict(compute="fp16"), "compute must be 'bf16' or 'fp32'"),
        (dict(sharding="hybrid"), "only FSDP full sharding"),
    ],
)
def test_unmodelled_arguments_are_rejected(kwargs, message):
    args = dict(n_gpus=8, micro_batch=1, seq_len=4096) | kwargs
    with pytest.raises(MemoryPlanError, match=message):
        plan_memory(BAICHUAN_7B, **args)


def test_documents_apart_add_their_block_mask_and_per_row_rotary_tables_to_each_micro_batch():
    from llm.memory_plan import document_mask_bytes

    args = dict(n_gpus=8, micro_batch=4, seq_len=4096, compute="bf16", activation_checkpointing="full")
    causal = plan_memory(BAICHUAN_7B, **args)
    apart = plan_memory(BAICHUAN_7B, documents="document", **args)
    restarting = plan_memory(BAICHUAN_7B, documents="document+positions", **args)
    # 32 tiles of 128: 4 pairs of int32 counts [4, 32] and indices [4, 32, 32]; the document ids
    # padded to 4,096 and as given, int64; restarting positions: cos and sin per row, [4, 4096, 128] bf16.
    mask = 4 * (4 * 32 * 4 + 4 * 32 * 32 * 4) + 8 * 4 * (4096 + 4096)
    assert causal.document_mask == 0 and apart.document_mask == mask == 329_728
    assert restarting.document_mask == mask + 2 * 4 * 4096 * 128 * 2
    assert document_mask_bytes(BAICHUAN_7B, 4, 4096, 2, "document") == mask
    assert apart.total - causal.total == mask and apart.per_batch == apart.loss_head + mask
    assert (
        "document mask (block mask, documents)" in apart.format() and "document mask" not in causal.format()
    )


def test_the_share_of_causal_tiles_documents_visit_grows_with_their_length():
    from llm.memory_plan import document_attention

    shares = [document_attention(BAICHUAN_7B, 4096, n) for n in (128, 512, 2048, 10**9)]
    assert [round(s.tile_share, 2) for s in shares] == sorted(round(s.tile_share, 2) for s in shares)
    assert shares[0].tile_share < 0.2 and shares[-1].tile_share == 1.0 and shares[-1].step_share == 0.0
    # The attention term, 12 L h T, of which the causal kernel visits (n + 1) / 2n of the tiles.
    attention = 12 * 32 * 4096 * 4096 * 33 / 64
    assert shares[1].flops_saved == pytest.approx(attention * (1 - shares[1].tile_share))
    assert 0 < shares[1].step_share < attention / (6 * 6_740_000_000)


def test_the_chunked_loss_head_holds_one_chunks_logits_not_every_tokens():
    args = dict(n_gpus=8, micro_batch=4, seq_len=4096, compute="bf16", activation_checkpointing="selective")
    plain = plan_memory(BAICHUAN_7B, **args)
    chunked = plan_memory(BAICHUAN_7B, loss_chunk=512, **args)
    tokens = 4 * 4096
    assert plain.loss_head == tokens * 4096 * 8 + tokens * 64000 * 14  # 14.17 GiB
    assert chunked.loss_head == tokens * 4096 * 8 + 16 * tokens + 512 * 64000 * 10
    assert chunked.loss_head <= 1 * GIB < 14 * GIB < plain.loss_head
    assert chunked.loss_head_plain == plain.loss_head
    assert plain.total - chunked.total == plain.loss_head - chunked.loss_head
    # A chunk larger than the micro-batch holds the micro-batch's logits once.
    small = plan_memory(BAICHUAN_7B, loss_chunk=10**6, **{**args, "micro_batch": 1, "seq_len": 64})
    assert small.loss_head == 64 * 4096 * 8 + 16 * 64 + 64 * 64000 * 10
