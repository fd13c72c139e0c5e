"""Documents in a packed sample kept apart (`model.attention=document`, `model.positions=document`):
each document scores as if it were run alone, on the CPU's kernel (SDPA with a boolean mask) and on
the GPU's (FlexAttention's block mask, eager here), under activation checkpointing; the default
stays today's causal path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from llm.composer_model import Documents, LanguageModel, eos_documents
from llm.model import ModelConfig, Transformer, document_block_mask, document_mask, document_positions
from llm.parallelism import apply_activation_checkpointing

CFG = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, hidden_dim=48)
EOS = 2
# A window of packed documents: the tail of one cut by the window's start, then three, each opened
# by the EOS that ends the one before (as our prompts open with it), the last cut by the window's end.
DOCS = [[5, 9, 14, 7], [EOS, 11, 3, 8, 21, 30, 17, 6], [EOS, 40, 41], [EOS, 12, 13, 15, 16]]


def packed() -> torch.Tensor:
    return torch.tensor([sum(DOCS, [])])


def offsets() -> list[int]:
    starts, at = [], 0
    for doc in DOCS:
        starts.append(at)
        at += len(doc)
    return starts


def wrapper(restart: bool, seed: int = 3) -> LanguageModel:
    return LanguageModel.from_config(
        CFG, seed=seed, documents=Documents(eos_id=EOS, restart_positions=restart)
    )


def alone(model: Transformer, restart: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document run by itself (from position 0, or from its offset in the window) and scored on
    its next tokens, the last one on the EOS after it: the logits and losses of every position,
    documents one after another."""
    logits, losses = [], []
    for k, (start, doc) in enumerate(zip(offsets(), DOCS, strict=True)):
        tokens = torch.tensor([doc + ([EOS] if k + 1 < len(DOCS) else [])])
        positions = None if restart else torch.arange(start, start + tokens.shape[1] - 1)
        out = model(tokens[:, :-1], positions=positions)[0]
        logits.append(out)
        losses.append(F.cross_entropy(out, tokens[0, 1:], reduction="none"))
    return torch.cat(logits), torch.cat(losses)


def packed_run(lm: LanguageModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrapper's logits and losses at every position of the packed row."""
    batch = {"input_ids": packed()}
    logits = lm(batch)[0]
    return logits, F.cross_entropy(logits, packed()[0, 1:], reduction="none")


@pytest.mark.parametrize("restart", [True, False], ids=["positions restart", "positions of the window"])
@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_a_packed_sample_scores_and_trains_each_document_as_if_run_alone(restart, kernel):
    """Token for token: the losses, the logits (so the z-loss terms too) and the gradients."""
    lm, reference = wrapper(restart), wrapper(restart)
    lm.model.document_kernel = kernel
    (logits, got), (want_logits, want) = packed_run(lm), alone(reference.model, restart)
    assert got.shape == want.shape == (packed().shape[1] - 1,)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert torch.allclose(logits, want_logits, atol=1e-5, rtol=0), (logits - want_logits).abs().max()
    got.sum().backward()
    want.sum().backward()
    for (name, a), b in zip(lm.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5), (name, (a.grad - b.grad).abs().max())


def test_by_default_documents_see_each_other_exactly_as_before():
    """No setting: the causal kernel over the whole window, positions of the window, bit for bit the
    call the wrapper made before documents existed, though the sample holds three EOS tokens."""
    default, masked = LanguageModel.from_config(CFG, seed=3), wrapper(restart=True)
    batch = {"input_ids": packed()}
    assert default.documents_of(batch) == (None, False)
    assert torch.equal(default(batch), default.model(packed()[:, :-1]))
    assert not torch.allclose(default(batch), masked(batch), atol=1e-3)  # the masked path differs


def test_rows_holding_one_document_each_take_the_causal_kernel():
    lm = wrapper(restart=True)
    # An EOS first (it opens the row's only document) or last (the next document is not an input).
    one = torch.tensor([[EOS, 9, 14, 7, 8, 3], [4, 4, 4, 4, 4, EOS]])
    assert lm.documents_of({"input_ids": one}) == (None, False)
    documents, restart = lm.documents_of({"input_ids": packed()})
    assert restart and documents.tolist() == [[0] * 4 + [1] * 8 + [2] * 3 + [3] * 4]


def test_each_eos_opens_a_document_and_positions_restart_there():
    tokens = torch.tensor([[7, EOS, 8, 9, EOS, EOS, 3]])
    documents = eos_documents(tokens, EOS)
    assert documents.tolist() == [[0, 1, 1, 1, 2, 3, 3]]
    assert document_positions(documents).tolist() == [[0, 0, 1, 2, 0, 0, 1]]
    mask = document_mask(documents, "sdpa")[0, 0].int()
    assert mask[3].tolist() == [0, 1, 1, 1, 0, 0, 0]  # the document the first EOS opened
    assert mask[4].tolist() == [0, 0, 0, 0, 1, 0, 0]  # an EOS right after an EOS: a document of one
    assert mask[6].tolist() == [0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize(("length", "tile"), [(255, 128), (256, 128), (1000, 128), (70, 16)])
def test_the_block_mask_from_tile_edges_equals_flex_attentions_own(length, tile):
    """`document_block_mask` reads each tile's first and last document; `create_block_mask`
    evaluates the mask on every pair: the same tiles, full and partial, in the same order."""
    generator = torch.Generator().manual_seed(length)
    documents = torch.sort(torch.randint(0, 7, (3, length), generator=generator), dim=1).values
    documents[0] = 0  # a row of one document

    def same_document(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (kv <= q)

    ours = document_block_mask(documents, tile)
    theirs = create_block_mask(same_document, 3, None, length, length, device="cpu", BLOCK_SIZE=tile)
    assert ours.seq_lengths == theirs.seq_lengths == (length, length)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_blocks_train_like_plain_ones_on_both_kernels(policy):
    """Selective checkpointing runs its blocks under a dispatch mode that FlexAttention cannot run
    under in torch 2.7: the attention is kept out of it (llm/model.py's `flex_attention`)."""
    grads = {}
    for kernel in ("sdpa", "flex"):
        for checkpointed in (False, True):
            lm = wrapper(restart=True)
            lm.model.document_kernel = kernel
            if checkpointed:
                assert apply_activation_checkpointing(lm.model, policy) == CFG.n_layers
            packed_run(lm)[1].sum().backward()
            grads[kernel, checkpointed] = [p.grad for p in lm.parameters()]
    for key, got in grads.items():
        for a, b in zip(got, grads["sdpa", False], strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), key


def test_eval_loss_keeps_the_documents_apart_as_training_does():
    lm = wrapper(restart=True)
    batch = {"input_ids": packed()}
    with torch.no_grad():
        outputs = lm(batch)
        metric = lm.get_metrics(is_train=False)["LanguageCrossEntropy"]
        lm.update_metric(batch, outputs, metric)
        assert metric.compute().item() == pytest.approx(lm.loss(outputs, batch).item(), rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_compiled_flex_attention_agrees_with_the_cpus_sdpa_path(dtype):
    """The GPU path (compiled FlexAttention over the block mask, also inside a compiled block)
    against the CPU path (SDPA with a boolean mask) on the same GPU, 4,095-token rows."""
    from llm.parallelism import compile_blocks

    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=2, max_seq_len=4096)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 512, (2, 4096), generator=generator)
    tokens[tokens % 97 == 0] = EOS  # documents of about 97 tokens
    batch = {"input_ids": tokens.cuda()}
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    outputs = {}
    for kernel, compiled in (("sdpa", False), ("flex", False), ("flex", True)):
        lm = LanguageModel.from_config(cfg, seed=3, documents=Documents(EOS, True)).cuda().to(dtype)
        lm.model.document_kernel = kernel
        if compiled:
            compile_blocks(lm.model)
        loss = lm.loss(lm(batch), batch)
        loss.backward()
        outputs[kernel, compiled] = (loss.float(), lm.model.layers[0].attention.wq.weight.grad.float())
    for key, (loss, grad) in outputs.items():
        ref_loss, ref_grad = outputs["sdpa", False]
        assert loss.item() == pytest.approx(ref_loss.item(), rel=tolerance), key
        assert torch.allclose(grad, ref_grad, atol=tolerance, rtol=tolerance * 10), key
