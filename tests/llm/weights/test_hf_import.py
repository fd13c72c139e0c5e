"""`llm import --from hf`: Llama, Mistral and Qwen2 folders in transformers' layout.

The references are transformers' own models, built from configs at random (weights perturbed so a
wrong norm, bias or rotary base shows) and written with `save_pretrained`: one safetensors file,
shards with an index, or `pytorch_model.bin`. Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from llm.commands import main as llm_main
from llm.generate import generate
from llm.weights.read import load_model
from tests.support.export import transformers_warnings

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, SEQ = 64, 2, 4, 2, 96, 300, 64
THETA, EPS = 50000.0, 1e-6

# name -> (architecture, tied, how save_pretrained writes it)
CASES = {
    "llama-gqa-untied-sharded": ("llama", False, "sharded"),
    "llama-tied-safetensors": ("llama", True, "safetensors"),
    "mistral-gqa-untied-bin": ("mistral", False, "bin"),
    "qwen2-gqa-tied-sharded": ("qwen2", True, "sharded"),
    "qwen2-gqa-untied-sharded-bin": ("qwen2", False, "sharded-bin"),
}


def hf_model(arch: str, tied: bool, vocab: int = VOCAB, seed: int = 0, **config):
    """A random transformers model of `arch`, every weight perturbed away from its initial value."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
    config_class = getattr(transformers, f"{names[arch]}Config")
    model_class = getattr(transformers, f"{names[arch]}ForCausalLM")
    extra = {"sliding_window": None} if arch == "mistral" else {}
    cfg = config_class(
        vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
        rms_norm_eps=EPS, rope_theta=THETA, tie_word_embeddings=tied, bos_token_id=None,
        eos_token_id=None, **(extra | config),
    )  # fmt: skip
    model = model_class(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:  # biases too: transformers starts them at zero, where a lost bias would not show
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def save(model, folder: Path, layout: str) -> Path:
    shard = {"max_shard_size": "40KB"} if layout.startswith("sharded") else {}
    model.save_pretrained(folder, safe_serialization=not layout.endswith("bin"), **shard)
    return folder


def model_yaml(arch: str, tied: bool, **changes) -> dict:
    section = {
        "vocab_size": VOCAB, "dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
        "hidden_dim": HIDDEN, "max_seq_len": SEQ, "norm_eps": EPS, "rope_theta": THETA,
        "tie_embeddings": tied, "qkv_bias": arch == "qwen2",
    }  # fmt: skip
    return section | changes


def write_recipe(path: Path, model: dict) -> str:
    recipe = {
        "model": model,
        "tokenizer": {"path": "unused.model"},
        "data": {"train": [{"remote": "unused"}]},
    }
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def run_import(src: Path, recipe: str, out: Path) -> int:
    return llm_main(["import", "--from", "hf", str(src), "--recipe", recipe, "--out", str(out)])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_the_import_computes_transformers_logits_and_greedy_tokens(tmp_path, case):
    arch, tied, layout = CASES[case]
    hf = hf_model(arch, tied)
    src = save(hf, tmp_path / "hf", layout)
    if layout.startswith("sharded"):  # the index and several shards are really there
        assert len(list(src.glob("*.index.json"))) == 1 and len(list(src.glob("*-0000*-of-*"))) > 2
    recipe = write_recipe(tmp_path / "r.yaml", model_yaml(arch, tied))
    assert run_import(src, recipe, tmp_path / "w.pt") == 0
    ours = load_model(str(tmp_path / "w.pt"))  # the import records the shape
    with torch.no_grad():
        diff = (ours(TOKENS) - hf(TOKENS).logits).abs().max().item()
    assert diff < 1e-5
    prompt = TOKENS[:1, :5]
    mine = generate(ours, [prompt[0].tolist()], max_new_tokens=32, temperature=0)[0]
    with torch.no_grad():
        theirs = hf.generate(prompt, do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, 5:]
    assert mine == theirs.tolist() and len(mine) == 32


def test_a_larger_vocabulary_in_the_recipe_pads_rows_of_the_mean_embedding(tmp_path):
    hf = hf_model("llama", tied=False)
    src = save(hf, tmp_path / "hf", "safetensors")
    recipe = write_recipe(tmp_path / "r.yaml", model_yaml("llama", False, vocab_size=320))
    assert run_import(src, recipe, tmp_path / "w.pt") == 0
    ours = load_model(str(tmp_path / "w.pt"))
    with torch.no_grad():
        logits, theirs = ours(TOKENS), hf(TOKENS).logits
    assert logits.shape[-1] == 320 and (logits[..., :VOCAB] - theirs).abs().max().item() < 1e-5
    embedding = hf.model.embed_tokens.weight
    assert torch.allclose(ours.tok_embeddings.weight[VOCAB:], embedding.mean(0).expand(20, -1))
    assert torch.allclose(ours.output.weight[VOCAB:], hf.lm_head.weight.mean(0).expand(20, -1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_section_prints_the_section_the_import_accepts(tmp_path, capsys, arch):
    src = save(hf_model(arch, tied=True), tmp_path / "hf", "safetensors")
    assert llm_main(["import", "--from", "hf", str(src), "--model-section"]) == 0
    section = yaml.safe_load(capsys.readouterr().out)["model"]
    assert section == model_yaml(arch, True)
    recipe = write_recipe(tmp_path / "r.yaml", section)
    assert run_import(src, recipe, tmp_path / "w.pt") == 0
    assert not (tmp_path / "hf" / "w.pt").exists() and (tmp_path / "w.pt").is_file()


# --- what the model cannot compute, and a recipe that disagrees: one line, exit 2 ----------------


@pytest.mark.parametrize(
    "arch, edit, named",
    [
        ("llama", {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "architectures"),
        ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"head_dim": 32}, "head_dim"),
        ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
        ("mistral", {"sliding_window": 16}, "sliding_window=16"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 2},
            "sliding_window=16",
        ),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
            "sliding_window",
        ),
    ],
)
def test_what_the_model_cannot_compute_is_refused_naming_the_key(tmp_path, capsys, arch, edit, named):
    src = save(hf_model(arch, tied=False), tmp_path / "hf", "safetensors")
    config = json.loads((src / "config.json").read_text())
    if "max_window_layers" in edit:  # transformers derives layer_types from it when absent
        config.pop("layer_types", None)
    (src / "config.json").write_text(json.dumps(config | edit))
    recipe = write_recipe(tmp_path / "r.yaml", model_yaml(arch, False))
    assert run_import(src, recipe, tmp_path / "w.pt") == 2
    err = one_line_error(capsys)
    assert f"{named}" in err and "config.json" in err, err
    assert not (tmp_path / "w.pt").exists()


def test_sliding_windows_no_shorter_than_the_context_change_nothing_and_are_taken(tmp_path):
    hf = hf_model("mistral", tied=False, sliding_window=SEQ)
    src = save(hf, tmp_path / "hf", "safetensors")
    assert (
        run_import(src, write_recipe(tmp_path / "r.yaml", model_yaml("mistral", False)), tmp_path / "w.pt")
        == 0
    )
    with torch.no_grad():
        diff = (load_model(str(tmp_path / "w.pt"))(TOKENS) - hf(TOKENS).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize(
    "arch, change, config_says",
    [
        ("llama", {"dim": 128}, "hidden_size=64"),
        ("llama", {"n_kv_heads": 4}, "num_key_value_heads=2"),  # same q shapes, other k/v
        ("llama", {"n_heads": 8}, "num_attention_heads=4"),
        ("llama", {"rope_theta": 10000.0}, "rope_theta=50000.0"),
        ("llama", {"norm_eps": 1e-5}, "rms_norm_eps=1e-06"),
        ("llama", {"tie_embeddings": True}, "tie_word_embeddings=False"),
        ("qwen2", {"qkv_bias": False}, "q/k/v biases=True (Qwen2ForCausalLM)"),
        ("llama", {"qkv_bias": True}, "q/k/v biases=False (LlamaForCausalLM)"),
        ("llama", {"vocab_size": 200}, "vocab_size=300"),
    ],
)
def test_a_recipe_that_disagrees_with_config_json_is_refused_naming_both(
    tmp_path, capsys, arch, change, config_says
):
    src = save(hf_model(arch, tied=False), tmp_path / "hf", "safetensors")
    recipe = write_recipe(tmp_path / "r.yaml", model_yaml(arch, False, **change))
    assert run_import(src, recipe, tmp_path / "w.pt") == 2
    err = one_line_error(capsys)
    field, value = next(iter(change.items()))
    assert config_says in err and f"model.{field}={value}" in err and "config.json" in err, err
    assert not (tmp_path / "w.pt").exists()


def test_a_pickle_that_runs_code_is_refused_and_not_run(tmp_path, capsys):
    """pytorch_model.bin is read as weights only: a pickle asking for a callable is never unpickled."""
    src = save(hf_model("llama", tied=False), tmp_path / "hf", "bin")
    marker = tmp_path / "ran"
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "evil": _Touch(marker)}, src / "pytorch_model.bin")
    recipe = write_recipe(tmp_path / "r.yaml", model_yaml("llama", False))
    assert run_import(src, recipe, tmp_path / "w.pt") == 2
    assert "--trust" in one_line_error(capsys) and not marker.exists()


class _Touch:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_model_section_and_a_missing_recipe_are_one_line(tmp_path, capsys):
    src = save(hf_model("llama", tied=False), tmp_path / "hf", "safetensors")
    assert llm_main(["import", "--from", "baichuan", str(src), "--model-section"]) == 2
    assert "--from hf" in one_line_error(capsys)
    assert llm_main(["import", "--from", "hf", str(src), "--out", str(tmp_path / "w.pt")]) == 2
    assert "--recipe" in one_line_error(capsys)
    (src / "config.json").unlink()
    assert llm_main(["import", "--from", "hf", str(src), "--model-section"]) == 2
    assert "config.json is missing" in one_line_error(capsys)


# --- import -> train -> export -> transformers -------------------------------------------------


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_import_train_export_and_transformers_loads_it_without_a_warning(tmp_path, train_data, arch, tied):
    from transformers import AutoModelForCausalLM

    from llm.trainer import train
    from tests.support.training import load
    from tests.support.training import write_recipe as training_recipe

    hf = hf_model(arch, tied, vocab=train_data.vocab_size)
    src = save(hf, tmp_path / "hub", "sharded")
    model = model_yaml(arch, tied, vocab_size=train_data.vocab_size, max_seq_len=train_data.seq_len)
    recipe = training_recipe(tmp_path / "r.yaml", train_data, model=model)
    assert run_import(src, str(recipe), tmp_path / "imported.pt") == 0
    imported = load_model(str(tmp_path / "imported.pt")).state_dict()

    checkpoints = tmp_path / "run" / "checkpoints"
    cfg = load(
        recipe, f"checkpoint.load_path={tmp_path / 'imported.pt'}", "checkpoint.load_weights_only=true",
        "checkpoint.allow_untrusted_load_path=true", f"checkpoint.save_folder={checkpoints}",
        "checkpoint.save_interval=3ba", "training.max_duration=3ba", "scheduler.warmup=0ba",
        "optimizer.lr=1e-4", "scheduler.min_lr=1e-5", "data.eval=[]",
    )  # fmt: skip
    assert train(cfg).step == 3
    trained = load_model(str(checkpoints), str(recipe))
    moved = max((trained.state_dict()[k] - v).abs().max().item() for k, v in imported.items())
    assert 0 < moved < 1e-2  # three small steps away from the imported weights, not from a fresh init

    export = tmp_path / "export"
    rc = llm_main(["export", str(checkpoints), "--recipe", str(recipe), "--out", str(export)])
    assert rc == 0
    logging.Logger.warning_once.cache_clear()  # transformers says some things once per process
    with transformers_warnings() as said:
        reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert said == []
    assert type(reloaded).__name__ == ("Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")
    tokens = torch.randint(0, train_data.vocab_size, (2, train_data.seq_len), generator=torch.Generator())
    with torch.no_grad():
        assert (trained(tokens) - reloaded(tokens).logits).abs().max().item() < 1e-5
        assert torch.equal(load_model(str(export))(tokens), trained(tokens))  # and read back by ours
