"""SFT with the real trainer: from a pretrained run or an imported baby-llama2-chinese checkpoint, on
real SFT shards of labelled reviews; autoresume, the generation callback, `llm chat` afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from composer.core import Callback

from llm.commands import main as llm_main
from llm.errors import ConfigError
from llm.weights.read import read_weights
from shards.chat_template import ChatTemplate
from tests.support.sft import SFT_SEQ_LEN
from tests.support.training import load, read_metrics, recipe_dict

PROMPT = "评论：房间很干净，服务也很热情。 这条评论是正面还是负面？"


def sft_recipe(path: Path, train_data, shards: Path, *, run_dir: Path, load_path=None, **training) -> Path:
    """A CPU-sized SFT recipe over `shards`, starting from `load_path` (weights only) if given."""
    recipe = recipe_dict(train_data, run_dir)
    recipe["model"]["max_seq_len"] = SFT_SEQ_LEN
    recipe["data"].update(
        kind="sft", train=[{"remote": str(shards / "train")}], eval=[{"remote": str(shards / "val")}]
    )
    recipe["training"].update({"max_duration": "8ba", "eval_interval": "4ba", **training})
    recipe["scheduler"]["warmup"] = "2ba"
    recipe["checkpoint"] = {"save_folder": str(run_dir / "ckpt"), "save_interval": "4ba", "num_to_keep": -1}
    if load_path:
        recipe["checkpoint"].update(
            load_path=str(load_path), load_weights_only=True, allow_untrusted_load_path=True
        )
    recipe["callbacks"] = {
        "generate": {"prompts": [PROMPT], "interval": "4ba", "max_new_tokens": 6, "temperature": 0.0}
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    return path


def fit(cfg, callbacks=()):
    """Build, fit and close a trainer; returns (final weights, the trainer's callbacks)."""
    from llm.trainer import build_trainer

    trainer = build_trainer(cfg, extra_callbacks=list(callbacks))
    try:
        trainer.fit()
        return {
            k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()
        }, trainer.state.callbacks
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, train_data) -> Path:
    """A short pretraining run's checkpoint folder (plain text shards, 64-token samples)."""
    from llm.trainer import train

    root = tmp_path_factory.mktemp("pretrained")
    recipe = recipe_dict(train_data, root / "run")
    recipe["training"].update(max_duration="4ba", eval_interval="4ba")
    recipe["scheduler"]["warmup"] = "1ba"
    recipe["data"]["eval"] = []
    recipe["checkpoint"] = {"save_folder": str(root / "ckpt"), "save_interval": "4ba"}
    (root / "r.yaml").write_text(yaml.safe_dump(recipe, allow_unicode=True))
    train(load(root / "r.yaml"))
    return root / "ckpt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train_data, sft_shards, pretrained):
    """An uninterrupted 8-step SFT run from the pretrained folder: (recipe, final weights, callbacks)."""
    root = tmp_path_factory.mktemp("sft-reference")
    recipe = sft_recipe(root / "r.yaml", train_data, sft_shards, run_dir=root / "run", load_path=pretrained)
    weights, callbacks = fit(load(recipe))
    return recipe, weights, callbacks


def test_sft_from_a_pretrained_run_folder_learns_answers_and_records_its_template(
    reference, sft_shards, capsys
):
    recipe, _, callbacks = reference
    cfg = load(recipe)
    run_dir = Path(cfg.run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]  # eval loss over answer tokens falls
    meta = json.loads((sft_shards / "train" / "meta.json").read_text())
    template = ChatTemplate.from_dict(meta["chat_template"], "meta")
    # The checkpoint records the template (so `llm chat` needs no --template) and the shape.
    recorded = read_weights(str(run_dir / "ckpt"))
    assert (
        recorded.chat_template == meta["chat_template"] and recorded.model_config.max_seq_len == SFT_SEQ_LEN
    )
    # The generation callback put its prompt in the template, as `llm chat` does.
    from llm.callbacks.generation import GenerationCallback
    from shards.tokenizer import Tokenizer

    generation = next(cb for cb in callbacks if isinstance(cb, GenerationCallback))
    assert generation._prompt_ids == [template.prompt_ids(Tokenizer(cfg.tokenizer.path), PROMPT)]
    sampled = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in sampled] == [4, 8]
    # ... and `llm chat` on the run folder answers the same, greedily.
    capsys.readouterr()
    args = [str(run_dir / "ckpt"), "--tokenizer", cfg.tokenizer.path, "--prompt", PROMPT, "--json"]
    assert llm_main(["chat", *args, "--temperature", "0", "--max-new-tokens", "6"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer == {"prompt": PROMPT, "answer": sampled[-1]["text"]}


def test_an_interrupted_sft_run_resumes_from_its_own_checkpoint_bit_identically(
    tmp_path, reference, train_data, sft_shards, pretrained, capsys
):
    """With load_path set, a restart must take the run's own newest checkpoint, not the pretrained one."""

    class Crash(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 6:
                raise RuntimeError("simulated crash after the checkpoint at batch 4")

    recipe = sft_recipe(
        tmp_path / "r.yaml", train_data, sft_shards, run_dir=tmp_path / "run", load_path=pretrained
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(load(recipe), [Crash()])
    first = capsys.readouterr().err
    # The pretrained run's folder stands for its newest verified checkpoint.
    assert f"from checkpoint.load_path={pretrained / 'ep0-ba4-rank0.pt'} (weights only)" in first
    weights, _ = fit(load(recipe))
    assert "resuming run 'test' from the checkpoint at batch 4" in capsys.readouterr().err
    expected = reference[1]
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


class GradRecorder(Callback):
    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def after_train_batch(self, state, logger):
        self.grads = {n: p.grad.detach().clone() for n, p in state.model.named_parameters()}


def test_micro_batches_are_weighted_by_their_answer_tokens(tmp_path, train_data, sft_shards):
    """One step over 4 micro-batches gives the gradient of one full batch: the mean over all answer
    tokens (a mean of per-micro-batch means would weight a micro-batch with few answers too much)."""
    grads = {}
    for micro in (8, 2):
        recipe = sft_recipe(tmp_path / f"{micro}" / "r.yaml", train_data, sft_shards, run_dir=tmp_path / f"{micro}",
                            device_microbatch_size=micro, max_duration="1ba", grad_clip_norm=0)  # fmt: skip
        cfg = load(recipe, "scheduler.warmup=0ba", "data.eval=[]", "callbacks.generate.enabled=false")
        recorder = GradRecorder()
        fit(cfg, [recorder])
        grads[micro] = recorder.grads
    for name, grad in grads[8].items():
        torch.testing.assert_close(
            grads[2][name], grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_shards_of_the_other_kind_are_refused_in_one_line(tmp_path, train_data, sft_shards):
    from llm.data import check_streams

    sft = load(sft_recipe(tmp_path / "sft.yaml", train_data, sft_shards, run_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"these are SFT shards .* set data.kind: sft") as refused:
        check_streams(
            load(
                sft_recipe(tmp_path / "p.yaml", train_data, sft_shards, run_dir=tmp_path / "b"),
                "data.kind=pretrain",
            )
        )
    assert "\n" not in str(refused.value)
    plain = str(train_data.train)
    with pytest.raises(ConfigError, match=r"these are pretraining shards .*python -m convert sft") as refused:
        check_streams(load(sft_recipe(tmp_path / "s.yaml", train_data, sft_shards, run_dir=tmp_path / "c"),
                           f"data.train.0.remote={plain}", "model.max_seq_len=64"))  # fmt: skip
    assert "\n" not in str(refused.value)
    check_streams(sft)  # the matching pair is accepted


def test_a_checkpoint_imported_from_baby_llama2_fine_tunes_and_chats(
    tmp_path, train_data, sft_shards, capsys
):
    """baby-llama2-chinese's pretrained `.pth` (llama2.c layout) -> `llm import` -> SFT -> `llm chat`."""
    from llm.model import Transformer

    recipe = sft_recipe(
        tmp_path / "r.yaml", train_data, sft_shards, run_dir=tmp_path / "run", max_duration="4ba"
    )
    cfg = load(recipe)
    # A llama2.c checkpoint: its names are ours, its q/k rows in llama2.c's interleaved rotary order.
    state = Transformer(cfg.model, seed=5).state_dict()
    args = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "vocab_size": train_data.vocab_size,
            "norm_eps": 1e-5, "max_seq_len": SFT_SEQ_LEN}  # fmt: skip
    torch.save({"model": state, "model_args": args}, tmp_path / "epoch_0.pth")
    imported = tmp_path / "pretrained.pt"
    assert llm_main(["import", "--from", "baby-llama2", str(tmp_path / "epoch_0.pth"), "--recipe", str(recipe),
                     "--out", str(imported)]) == 0  # fmt: skip
    start = read_weights(str(imported)).tensors
    cfg = load(recipe, f"checkpoint.load_path={imported}", "checkpoint.load_weights_only=true",
               "checkpoint.allow_untrusted_load_path=true", "callbacks.generate.enabled=false")  # fmt: skip
    from llm.trainer import build_trainer

    trainer = build_trainer(cfg)
    try:
        loaded = trainer.state.model.model.state_dict()
        assert all(torch.equal(loaded[k], start[k]) for k in start)  # training starts from the import
        trainer.fit()
        assert int(trainer.state.timestamp.batch) == 4
        assert not torch.equal(trainer.state.model.model.norm.weight, start["norm.weight"])
    finally:
        trainer.close()
    capsys.readouterr()
    ckpt = str(Path(cfg.checkpoint.save_folder))
    assert llm_main(["chat", ckpt, "--tokenizer", cfg.tokenizer.path, "--prompt", PROMPT, "--temperature", "0",
                     "--max-new-tokens", "4"]) == 0  # fmt: skip
    assert capsys.readouterr().out.endswith("\n")
