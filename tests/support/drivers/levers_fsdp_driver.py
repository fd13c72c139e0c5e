"""Run under `composer -n 2`: every activation-checkpointing policy under FSDP2, same weights and data.

    composer -n 2 tests/support/drivers/levers_fsdp_driver.py OUT_FOLDER

Each rank writes OUT_FOLDER/rank<r>.json: per policy, the losses of two plain SGD steps, the full
gradients of a third step and how many blocks the policy wrapped; under `<policy>/<k>/documents`
the same with documents kept apart (EOS id 2), on the GPU's kernel (FlexAttention, eager here).
Under `loss/<plain|chunked>/<untied|tied>`: the chunked loss head (llm/loss.py) against the plain
one, with IGNORE_INDEX targets, z-loss and max-z loss: the losses, gradients and the all-gathers
of one step.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from llm.composer_model import LanguageModel, eos_documents  # noqa: E402
from llm.model import ModelConfig, Transformer, document_positions  # noqa: E402
from llm.parallelism import apply_activation_checkpointing  # noqa: E402

POLICIES = [("none", 0), ("full", 0), ("selective", 0), ("selective", 2)]
SMALL = ModelConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)
WRAPPER = "._checkpoint_wrapped_module"


def _loss(model: Transformer, tokens: torch.Tensor, documents: bool) -> torch.Tensor:
    inputs = tokens[:, :-1]
    if documents:
        ids = eos_documents(inputs, 2)
        logits = model(inputs, documents=ids, positions=document_positions(ids))
    else:
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def main(out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")  # ranks and addresses from the composer launcher's environment
    rank = dist.get_rank()
    results = {}
    for (policy, every), documents in itertools.product(POLICIES, (False, True)):
        model = Transformer(SMALL, seed=3)
        model.document_kernel = "flex"  # with documents: the block mask, as on GPUs
        wrapped = apply_activation_checkpointing(model, policy, every) if policy != "none" else 0
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        tokens = torch.randint(0, SMALL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
        tokens[:, 4] = tokens[1, 9] = 2  # an EOS: two documents in each row, three in one
        losses = []
        for _ in range(2):  # the second step runs on weights the first one updated
            loss = _loss(model, tokens, documents)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.item())
        _loss(model, tokens, documents).backward()
        grads = {
            n.replace(WRAPPER, ""): p.grad.full_tensor().flatten().tolist()
            for n, p in model.named_parameters()
        }
        key = f"{policy}/{every}" + ("/documents" if documents else "")
        results[key] = {"losses": losses, "grads": grads, "wrapped": wrapped}
    results.update(loss_heads(rank))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def loss_heads(rank: int) -> dict:
    """Each loss head under FSDP2 as the trainer builds it (a block per unit, the root holding the
    embedding, final norm and output): two SGD steps' losses, a third step's gradients and how
    many all-gathers its forward and backward made."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    results = {}
    for head, tied in itertools.product(("plain", "chunked"), (False, True)):
        cfg = ModelConfig(**{**SMALL.__dict__, "tie_embeddings": tied})
        lm = LanguageModel.from_config(
            cfg, seed=3, z_loss=1e-2, max_z_loss=2e-2, loss_chunk=12 if head == "chunked" else 0
        )
        for block in lm.model.layers:
            fully_shard(block)
        fully_shard(lm.model)
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
        mask = torch.ones_like(tokens, dtype=torch.bool)
        mask[0, 3:9] = False  # IGNORE_INDEX targets, as SFT's prompts
        batch = {"input_ids": tokens, "loss_mask": mask}
        losses = []
        for _ in range(2):
            loss = lm.loss(lm(batch), batch)["total"]
            loss.backward()
            with torch.no_grad():
                for p in lm.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.item())
        with CommDebugMode() as comm:
            lm.loss(lm(batch), batch)["total"].backward()
        gathers = sum(
            n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op) or "allgather" in str(op)
        )
        grads = {n: p.grad.full_tensor().flatten().tolist() for n, p in lm.model.named_parameters()}
        results[f"loss/{head}/{'tied' if tied else 'untied'}"] = {
            "losses": losses,
            "grads": grads,
            "all_gathers": gathers,
        }
    return results


if __name__ == "__main__":
    main(sys.argv[1])
