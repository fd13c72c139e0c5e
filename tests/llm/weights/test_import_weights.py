"""Importing baby-llama2-chinese and Baichuan-7B weights: our logits equal the original layout's.

Each reference forward below is written from that layout's published definition (llama2.c's
model.py with complex-number interleaved RoPE; Baichuan-7B's modeling file with the fused W_pack
projection and rotate_half RoPE), independently of llm.model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from llm.commands import main as llm_main
from llm.errors import ConfigError
from llm.weights.baby_llama2 import import_baby_llama2
from llm.weights.read import load_model

DIM, LAYERS, HEADS, HIDDEN, VOCAB, SEQ = 64, 2, 4, 96, 300, 32

RECIPE = """
model: {{vocab_size: {vocab}, dim: {dim}, n_layers: {layers}, n_heads: {heads}, hidden_dim: {hidden},
        max_seq_len: {seq}, norm_eps: {eps}, tie_embeddings: {tied}}}
tokenizer: {{path: unused.model}}
data: {{train: [{{remote: unused}}]}}
"""


def write_recipe(
    path,
    *,
    tied,
    eps,
    dim=DIM,
    n_layers=LAYERS,
    n_heads=HEADS,
    hidden_dim=HIDDEN,
    vocab_size=VOCAB,
    norm_eps=None,
):
    eps = eps if norm_eps is None else norm_eps
    text = RECIPE.format(
        vocab=vocab_size,
        dim=dim,
        layers=n_layers,
        heads=n_heads,
        hidden=hidden_dim,
        seq=SEQ,
        eps=eps,
        tied=str(tied).lower(),
    )
    path.write_text(text)
    return str(path)


def run_import(source, src, recipe, out):
    return llm_main(["import", "--from", source, str(src), "--recipe", recipe, "--out", str(out)])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def attend(q, k, v):
    """q, k, v [B, T, H, hd] -> [B, T, H*hd], causal."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[2]
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def randn(*shape, gen, std=0.1):
    return torch.randn(*shape, generator=gen) * std


# --- llama2.c / baby-llama2-chinese -------------------------------------------------------------


def llama2c_weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    sd = {
        "tok_embeddings.weight": randn(VOCAB, DIM, gen=gen, std=0.5),
        "norm.weight": 1 + randn(DIM, gen=gen),
    }
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "wo"):
            sd[p + f"attention.{name}.weight"] = randn(DIM, DIM, gen=gen)
        sd[p + "feed_forward.w1.weight"] = randn(HIDDEN, DIM, gen=gen)
        sd[p + "feed_forward.w2.weight"] = randn(DIM, HIDDEN, gen=gen)
        sd[p + "feed_forward.w3.weight"] = randn(HIDDEN, DIM, gen=gen)
        sd[p + "attention_norm.weight"] = 1 + randn(DIM, gen=gen)
        sd[p + "ffn_norm.weight"] = 1 + randn(DIM, gen=gen)
    sd["output.weight"] = sd["tok_embeddings.weight"]  # baby-llama2-chinese ties them
    return sd


def llama2c_forward(sd, tokens, eps=1e-5, theta=10000.0):
    hd = DIM // HEADS
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    cis = torch.polar(
        torch.ones(tokens.shape[1], hd // 2), torch.outer(torch.arange(tokens.shape[1]).float(), freqs)
    )

    def rope(x):  # consecutive pairs (2j, 2j+1) as complex numbers
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis[None, :, None]).flatten(3)

    x = sd["tok_embeddings.weight"][tokens]
    b, t = tokens.shape
    for i in range(LAYERS):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["attention_norm.weight"], eps)
        q, k, v = (h @ w[f"attention.{n}.weight"].T for n in ("wq", "wk", "wv"))
        q, k, v = (z.view(b, t, HEADS, hd) for z in (q, k, v))
        x = x + attend(rope(q), rope(k), v) @ w["attention.wo.weight"].T
        h = rms(x, w["ffn_norm.weight"], eps)
        gate, up = h @ w["feed_forward.w1.weight"].T, h @ w["feed_forward.w3.weight"].T
        x = x + (F.silu(gate) * up) @ w["feed_forward.w2.weight"].T
    return rms(x, sd["norm.weight"], eps) @ sd["output.weight"].T


@pytest.mark.parametrize("layout", ["plain", "compiled-in-model-key"])
def test_baby_llama2_import_gives_the_llama2c_logits(tmp_path, layout):
    sd = llama2c_weights()
    saved = sd if layout == "plain" else {"model": {f"_orig_mod.{k}": v for k, v in sd.items()}}
    torch.save(saved, tmp_path / "pretrain.pth")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5)
    out = tmp_path / "imported.pt"
    assert (
        llm_main(
            [
                "import",
                "--from",
                "baby-llama2",
                str(tmp_path / "pretrain.pth"),
                "--recipe",
                recipe,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    model = load_model(str(out))  # no recipe needed: the import records the shape
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - llama2c_forward(sd, tokens)).abs().max().item()
    assert diff < 1e-4


# --- Baichuan-7B ------------------------------------------------------------------------------


def baichuan_weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": randn(VOCAB, DIM, gen=gen, std=0.5),
        "model.norm.weight": 1 + randn(DIM, gen=gen),
        "lm_head.weight": randn(VOCAB, DIM, gen=gen, std=0.5),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.W_pack.weight"] = randn(3 * DIM, DIM, gen=gen)
        sd[p + "self_attn.o_proj.weight"] = randn(DIM, DIM, gen=gen)
        sd[p + "self_attn.rotary_emb.inv_freq"] = torch.ones(DIM // HEADS // 2)  # a buffer in .bin files
        sd[p + "mlp.gate_proj.weight"] = randn(HIDDEN, DIM, gen=gen)
        sd[p + "mlp.down_proj.weight"] = randn(DIM, HIDDEN, gen=gen)
        sd[p + "mlp.up_proj.weight"] = randn(HIDDEN, DIM, gen=gen)
        sd[p + "input_layernorm.weight"] = 1 + randn(DIM, gen=gen)
        sd[p + "post_attention_layernorm.weight"] = 1 + randn(DIM, gen=gen)
    return sd


def baichuan_forward(sd, tokens, eps=1e-6, theta=10000.0):
    hd = DIM // HEADS
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.cat([torch.outer(torch.arange(tokens.shape[1]).float(), inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]

    def rope(x):  # rotate_half: dimension j pairs with j + hd/2
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    x = sd["model.embed_tokens.weight"][tokens]
    b, t = tokens.shape
    for i in range(LAYERS):
        w = {
            k.removeprefix(f"model.layers.{i}."): v
            for k, v in sd.items()
            if k.startswith(f"model.layers.{i}.")
        }
        h = rms(x, w["input_layernorm.weight"], eps)
        q, k, v = (h @ w["self_attn.W_pack.weight"].T).view(b, t, 3, HEADS, hd).unbind(2)
        x = x + attend(rope(q), rope(k), v) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"], eps)
        x = (
            x
            + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
            @ w["mlp.down_proj.weight"].T
        )
    return rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


BAICHUAN_CONFIG = {  # the fields of Baichuan-7B's config.json, at the test's size
    "architectures": ["BaiChuanForCausalLM"],
    "model_type": "baichuan",
    "hidden_act": "silu",
    "hidden_size": DIM,
    "intermediate_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def write_baichuan(folder, sd, layout, config=True):
    folder.mkdir()
    if config:
        (folder / "config.json").write_text(json.dumps(BAICHUAN_CONFIG))
    if layout == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
        return
    from safetensors.torch import save_file

    names = sorted(sd)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["bin", "sharded-safetensors"])
def test_baichuan_import_gives_the_baichuan_logits(tmp_path, layout):
    sd = baichuan_weights()
    write_baichuan(tmp_path / "baichuan", sd, layout)
    recipe = write_recipe(tmp_path / "r.yaml", tied=False, eps=1e-6)
    out = tmp_path / "imported.pt"
    assert (
        llm_main(
            [
                "import",
                "--from",
                "baichuan",
                str(tmp_path / "baichuan"),
                "--recipe",
                recipe,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    model = load_model(str(out), recipe)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(tokens) - baichuan_forward(sd, tokens)).abs().max().item()
    assert diff < 1e-4


# --- bad input ---------------------------------------------------------------------------------


def test_a_checkpoint_of_another_shape_names_the_mismatching_tensors(tmp_path):
    torch.save(llama2c_weights(), tmp_path / "pretrain.pth")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5, dim=128)
    from llm.config import load_config

    with pytest.raises(ConfigError) as err:
        import_baby_llama2(tmp_path / "pretrain.pth", load_config(recipe).model)
    message = str(err.value)
    assert "tok_embeddings.weight: checkpoint (300, 64) vs model (300, 128)" in message
    assert "recipe" in message


def test_a_missing_source_is_one_clear_error(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5)
    rc = llm_main(
        [
            "import",
            "--from",
            "baichuan",
            str(tmp_path / "nope"),
            "--recipe",
            recipe,
            "--out",
            str(tmp_path / "o.pt"),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("source", ["baby-llama2", "baichuan"])
def test_training_starts_from_the_imported_weights(tmp_path, source):
    """Composer loads the import with load_weights_only (as checkpoint.load_path does) and trains."""
    from composer import Trainer
    from torch.utils.data import DataLoader

    from llm.composer_model import LanguageModel
    from llm.config import load_config

    if source == "baby-llama2":
        torch.save(llama2c_weights(), tmp_path / "src.pth")
        src, recipe = tmp_path / "src.pth", write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5)
    else:
        write_baichuan(tmp_path / "src", baichuan_weights(), "bin")
        src, recipe = tmp_path / "src", write_recipe(tmp_path / "r.yaml", tied=False, eps=1e-6)
    out = tmp_path / "imported.pt"
    assert llm_main(["import", "--from", source, str(src), "--recipe", recipe, "--out", str(out)]) == 0
    expected = load_model(str(out)).state_dict()

    model = LanguageModel.from_config(load_config(recipe).model, seed=99)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ + 1,))} for _ in range(4)]
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=2),
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        max_duration="2ba",
        device="cpu",
        load_path=str(out),
        load_weights_only=True,
        progress_bar=False,
    )
    loaded = trainer.state.model.model.state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2
    assert not torch.equal(trainer.state.model.model.norm.weight, expected["norm.weight"])
    trainer.close()


# --- the source's own configuration against the recipe ------------------------------------------


@pytest.mark.parametrize(
    "field, value, source_says",
    [
        ("norm_eps", 1e-5, "rms_norm_eps=1e-06"),
        ("n_heads", 8, "num_attention_heads=4"),  # same tensor shapes, other logits
        ("dim", 128, "hidden_size=64"),
        ("n_layers", 3, "num_hidden_layers=2"),
        ("hidden_dim", 128, "intermediate_size=96"),
        ("vocab_size", 320, "vocab_size=300"),
    ],
)
def test_a_recipe_contradicting_baichuans_config_json_is_refused_naming_both_values(
    tmp_path, capsys, field, value, source_says
):
    write_baichuan(tmp_path / "baichuan", baichuan_weights(), "bin")
    recipe = write_recipe(tmp_path / "r.yaml", tied=False, eps=1e-6, **{field: value})
    assert run_import("baichuan", tmp_path / "baichuan", recipe, tmp_path / "o.pt") == 2
    err = one_line_error(capsys)
    assert "config.json" in err and source_says in err and f"model.{field}={value}" in err
    assert not (tmp_path / "o.pt").exists()


def test_a_baichuan_folder_without_config_json_is_refused(tmp_path, capsys):
    write_baichuan(tmp_path / "baichuan", baichuan_weights(), "bin", config=False)
    recipe = write_recipe(tmp_path / "r.yaml", tied=False, eps=1e-6)
    assert run_import("baichuan", tmp_path / "baichuan", recipe, tmp_path / "o.pt") == 2
    assert "config.json" in one_line_error(capsys)


def test_a_tied_recipe_refuses_baichuans_separate_lm_head_and_names_the_fix(tmp_path, capsys):
    write_baichuan(tmp_path / "baichuan", baichuan_weights(), "bin")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-6)
    assert run_import("baichuan", tmp_path / "baichuan", recipe, tmp_path / "o.pt") == 2
    err = one_line_error(capsys)
    assert "lm_head" in err and "model.tie_embeddings: false" in err
    assert not (tmp_path / "o.pt").exists()


def test_a_tied_recipe_takes_a_source_whose_output_equals_its_embedding(tmp_path):
    sd = baichuan_weights()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    write_baichuan(tmp_path / "baichuan", sd, "bin")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-6)
    assert run_import("baichuan", tmp_path / "baichuan", recipe, tmp_path / "o.pt") == 0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (load_model(str(tmp_path / "o.pt"))(tokens) - baichuan_forward(sd, tokens)).abs().max()
    assert diff.item() < 1e-4


def test_a_tied_recipe_refuses_a_baby_llama2_checkpoint_with_its_own_output_matrix(tmp_path, capsys):
    sd = llama2c_weights()
    sd["output.weight"] = sd["output.weight"] + 0.01  # trained untied
    torch.save(sd, tmp_path / "pretrain.pth")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5)
    assert run_import("baby-llama2", tmp_path / "pretrain.pth", recipe, tmp_path / "o.pt") == 2
    err = one_line_error(capsys)
    assert "output.weight" in err and "model.tie_embeddings: false" in err


@pytest.mark.parametrize(
    "field, value, source_says",
    [
        ("dim", 128, "dim=64"),
        ("n_layers", 3, "n_layers=2"),
        ("vocab_size", 320, "vocab_size=300"),
        ("hidden_dim", 128, "hidden_dim=96"),
    ],
)
def test_a_recipe_contradicting_the_baby_llama2_tensor_shapes_is_refused_naming_both_values(
    tmp_path, capsys, field, value, source_says
):
    torch.save(llama2c_weights(), tmp_path / "pretrain.pth")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5, **{field: value})
    assert run_import("baby-llama2", tmp_path / "pretrain.pth", recipe, tmp_path / "o.pt") == 2
    err = one_line_error(capsys)
    assert source_says in err and f"model.{field}={value}" in err
    assert not (tmp_path / "o.pt").exists()


def test_llama2c_model_args_are_checked_against_the_recipe_too(tmp_path, capsys):
    """llama2.c's train.py saves model_args: the head count, which no tensor shape reveals."""
    args = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": HEADS, "vocab_size": VOCAB}
    torch.save({"model": llama2c_weights(), "model_args": args}, tmp_path / "ckpt.pt")
    recipe = write_recipe(tmp_path / "r.yaml", tied=True, eps=1e-5, n_heads=8)
    assert run_import("baby-llama2", tmp_path / "ckpt.pt", recipe, tmp_path / "o.pt") == 2
    err = one_line_error(capsys)
    assert "n_heads=4" in err and "model.n_heads=8" in err
