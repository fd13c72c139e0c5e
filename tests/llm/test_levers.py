"""The GPU-efficiency levers on the CPU: checkpointing policies, float8 (emulated), the plan's choices."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llm.config import load_config
from llm.errors import ConfigError
from llm.memory_plan import (
    POLICY_LADDER,
    Blocks,
    auto_checkpointing,
    cheapest_policy,
    plan_memory,
    recompute_share,
)
from llm.model import ModelConfig, Transformer
from llm.parallelism import apply_activation_checkpointing, block_policies

SMALL = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=32)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "policy,every",
    [("full", 0), ("selective", 0), ("selective", 2), (["full", "selective", "none", "none"], 0)],
    ids=["full", "selective", "selective/2", "auto's per-block list"],
)
def test_each_policy_gives_the_losses_and_gradients_of_no_checkpointing(policy, every):
    reference = Transformer(SMALL, seed=3)
    model = copy.deepcopy(reference)
    wrapped = apply_activation_checkpointing(model, policy, every)
    assert wrapped == (2 if isinstance(policy, list) else SMALL.n_layers)
    tokens = torch.randint(
        0, SMALL.vocab_size, (2, SMALL.max_seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    loss_a, grads_a = _loss_and_grads(reference, tokens)
    loss_b, grads_b = _loss_and_grads(model, tokens)
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    names = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads_b.items()}
    assert names.keys() == grads_a.keys()
    for name, grad in grads_a.items():
        assert torch.allclose(grad, names[name], atol=1e-6), name
    assert model.state_dict().keys() == reference.state_dict().keys()  # checkpoints keep their names


def test_every_kth_block_is_recomputed_in_full():
    assert block_policies(4, "selective", 2) == ["selective", "full", "selective", "full"]
    assert block_policies(3, "full") == ["full"] * 3 and block_policies(2, "none") == ["none"] * 2


class _LiveTensors(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an op creates, to count what is still alive."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (weakref.ref(t), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if ref() is not None)


def _activation_bytes(policy: str) -> int:
    """Bytes of the tensors that the forward pass created and that are alive when backward starts."""
    cfg = ModelConfig(vocab_size=128, dim=128, n_layers=4, n_heads=4, max_seq_len=128)
    model = Transformer(cfg, seed=0)
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    mode = _LiveTensors()
    with mode:
        loss = model(tokens).float().pow(2).mean()
    live = mode.live_bytes()
    loss.backward()
    return live


def test_measured_activation_memory_orders_none_above_selective_above_full():
    torch.manual_seed(0)
    peaks = {p: _activation_bytes(p) for p in ("none", "selective", "full")}
    assert peaks["none"] > 1.1 * peaks["selective"] > 1.1 * peaks["full"], peaks


def test_the_plan_orders_the_policies_and_auto_recomputes_less_than_the_cheapest_fixed_one():
    cfg = load_config("recipes/7b.yaml")
    args = dict(n_gpus=8, micro_batch=cfg.training.device_microbatch_size, seq_len=4096, loss_chunk=512)
    totals = [
        plan_memory(cfg.model, activation_checkpointing=p, full_every=k, **args).total
        for p, k in POLICY_LADDER
    ]
    assert totals == sorted(totals, reverse=True)
    policy, every, plan = cheapest_policy(cfg.model, gpu_bytes=80e9, **args)
    assert (policy, every) == ("selective", 4)  # the best fixed policy with the chunked loss head: 8 in full
    assert cfg.fsdp.activation_checkpointing == "auto"
    blocks, auto = auto_checkpointing(cfg.model, gpu_bytes=80e9, **args)
    assert auto.fits(80e9) and blocks.full < 32 // every
    assert blocks == Blocks(whole=0, selective=29, full=3)
    # One block fewer in full does not fit; one more whole block neither.
    for fewer in (Blocks(0, 30, 2), Blocks(1, 28, 3)):
        assert not plan_memory(cfg.model, activation_checkpointing="auto", blocks=fewer, **args).fits(80e9)
    assert recompute_share(cfg.model, 4096, blocks.full) < recompute_share(cfg.model, 4096, 16) / 5
    # Compile excludes selective: whole blocks and full ones only.
    compiled, _ = auto_checkpointing(cfg.model, gpu_bytes=80e9, selective=False, **args)
    assert compiled.selective == 0 and compiled.whole + compiled.full == 32
    assert auto_checkpointing(cfg.model, gpu_bytes=8e9, **args) is None
    float8 = plan_memory(cfg.model, activation_checkpointing=policy, full_every=every, float8=True, **args)
    assert float8.gathered_params < plan.gathered_params


def test_auto_gives_each_block_the_plans_choice_for_the_world_size(capsys):
    from llm.trainer import auto_block_policies

    cfg = load_config("recipes/7b.yaml")
    assert auto_block_policies(cfg, "cpu", 8) == ["full"] * 3 + ["selective"] * 29  # on 80 GB, as llm inspect
    assert "[checkpointing] auto: 0 block(s) whole, 29 selective, 3 full (3.0% of the step's FLOPs" in (
        capsys.readouterr().out
    )
    # 7B on one 80 GB GPU fits nothing: every block in full
    assert auto_block_policies(cfg, "cpu", 1) == ["full"] * 32
    tiny = load_config("recipes/tiny.yaml")
    assert auto_block_policies(tiny, "cpu", 1) == ["none"] * 8


def test_checkpointing_setting_is_checked_and_the_old_switch_still_reads(tmp_path):
    assert (
        load_config("recipes/tiny.yaml", ["fsdp.activation_checkpointing=true"]).fsdp.activation_checkpointing
        == "full"
    )
    assert (
        load_config(
            "recipes/tiny.yaml", ["fsdp.activation_checkpointing=false"]
        ).fsdp.activation_checkpointing
        == "none"
    )
    with pytest.raises(ConfigError, match="none, full, selective, auto"):
        load_config("recipes/tiny.yaml", ["fsdp.activation_checkpointing=some"])
    with pytest.raises(ConfigError, match="selective only"):
        load_config("recipes/tiny.yaml", ["fsdp.checkpoint_full_every=2"])


@pytest.mark.slow  # two 200-step runs: about 10 s on one thread (float8 emulation is the slow half)
def test_float8_emulated_trains_like_fp32_and_keeps_ordinary_weights():
    from torchao.float8.float8_linear import Float8Linear

    from llm.config import Float8Config
    from llm.float8 import apply_float8

    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    base = Transformer(cfg, seed=1)
    f8 = copy.deepcopy(base)
    assert (
        apply_float8(f8, Float8Config(enabled=True, emulate=True), fsdp=False, device="cpu")
        == 7 * cfg.n_layers
    )
    assert not isinstance(f8.output, Float8Linear)  # embedding, output and norms stay high precision
    assert f8.state_dict().keys() == base.state_dict().keys()
    assert all(type(v) is torch.Tensor for v in f8.state_dict().values())
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 16, (200, 4, cfg.max_seq_len + 1), generator=g)  # a learnable 16-token subset
    curves = []
    for model in (base, f8):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for tokens in data:
            loss, _ = _loss_and_grads(model, tokens)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        curves.append(losses)
    last = [sum(c[-20:]) / 20 for c in curves]
    assert last[0] < curves[0][0] - 1.0  # it learned
    assert abs(last[1] - last[0]) < 0.05 * last[0], last  # stated tolerance: 5% of the fp32 loss


def test_float8_without_hardware_or_emulation_is_one_config_error():
    from llm.float8 import check_float8

    with pytest.raises(ConfigError, match="emulate=true"):
        check_float8(emulate=False, device="cpu")
