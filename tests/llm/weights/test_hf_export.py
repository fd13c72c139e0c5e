"""Export to the Hugging Face Llama layout: transformers loads it and computes our logits."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from llm.commands import main as llm_main
from llm.model import ModelConfig, Transformer
from llm.weights.composer_layout import save_composer_weights
from llm.weights.hf_export import export_hf
from llm.weights.read import load_model
from tests.support.export import transformers_warnings

CONFIGS = {
    "tied": ModelConfig(vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=True),
    "untied-gqa": ModelConfig(
        vocab_size=2000,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=96,
        max_seq_len=32,
        norm_eps=1e-6,
        rope_theta=50000.0,
        tie_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, chinese_documents) -> str:
    from convert.tokens.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tok.model"
    train_tokenizer(chinese_documents[:60], vocab_size=2000, out=str(out), character_coverage=0.98)
    return str(out)


def _perturbed(cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg, seed=11)
    with torch.no_grad():  # norms away from 1 so a wrongly mapped norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_for_causal_lm_gives_our_logits(tmp_path, tokenizer_path, name):
    from transformers import LlamaForCausalLM

    cfg = CONFIGS[name]
    model = _perturbed(cfg)
    out = export_hf(model, tmp_path / "hf", tokenizer_path)
    hf = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    assert hf.config.num_key_value_heads == cfg.kv_heads
    assert hf.config.rope_theta == cfg.rope_theta and hf.config.rms_norm_eps == cfg.norm_eps


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_gets_the_mode_of_a_new_file(tmp_path, tokenizer_path, umask):
    """model.safetensors was 0600 (safetensors writes through a temporary file of its own) while
    the other files were 0644: a serving container or another user could not read the weights."""
    import os
    import stat

    previous = os.umask(umask)
    try:
        out = export_hf(_perturbed(CONFIGS["tied"]), tmp_path / "hf", tokenizer_path)
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {k: oct(v) for k, v in modes.items()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_exported_tokenizer_encodes_like_ours(tmp_path, tokenizer_path):
    from transformers import AutoTokenizer, LlamaTokenizer

    from shards.tokenizer import Tokenizer

    out = export_hf(_perturbed(CONFIGS["tied"]), tmp_path / "hf", tokenizer_path)
    text = "北京市经济发展很快"
    ours = Tokenizer(tokenizer_path)
    # Untouched, both HF tokenizers start the text with our start token (EOS), as our commands do.
    for hf_tok in (LlamaTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(out)):
        assert hf_tok.encode(text) == ours.encode_prompt(text) == [ours.eos_id, *ours.encode(text)]
        assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text)
        assert hf_tok.eos_token_id == hf_tok.bos_token_id == ours.eos_id
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eos_id


def test_llm_export_command_from_a_checkpoint_and_reload(tmp_path, tokenizer_path):
    cfg = CONFIGS["untied-gqa"]
    model = _perturbed(cfg)
    ckpt = save_composer_weights(dict(model.state_dict()), cfg, tmp_path / "w.pt")
    rc = llm_main(["export", str(ckpt), "--tokenizer", tokenizer_path, "--out", str(tmp_path / "hf")])
    assert rc == 0
    reloaded = load_model(str(tmp_path / "hf"))  # the exported folder is itself loadable
    tokens = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(model(tokens), reloaded(tokens))


def test_transformers_greedy_generation_of_the_export_equals_llm_generate(tmp_path, tokenizer_path):
    """No edit of the export: its tokenizer and generation_config.json give our ids and our stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm.generate import generate
    from shards.tokenizer import Tokenizer

    model = _perturbed(CONFIGS["untied-gqa"])
    out = export_hf(model, tmp_path / "hf", tokenizer_path)
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    tok = Tokenizer(tokenizer_path)
    for prompt in ("中国", "我们要发展经济"):
        ours = generate(
            model, [tok.encode_prompt(prompt)], max_new_tokens=12, temperature=0, eos_id=tok.eos_id
        )[0]
        inputs = hf_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            theirs = hf.generate(**inputs, do_sample=False, max_new_tokens=12)[0, inputs.input_ids.shape[1] :]
        theirs = theirs.tolist()
        if tok.eos_id in theirs:  # HF keeps the EOS it stopped at; llm generate cuts it
            theirs = theirs[: theirs.index(tok.eos_id)]
        assert ours == theirs, prompt
    assert hf.generation_config.eos_token_id == tok.eos_id == hf.generation_config.bos_token_id


def test_the_exports_files_name_the_same_special_ids(tmp_path, tokenizer_path):
    """config.json once said bos_token_id 1 while the tokenizer files and generation_config.json said 2."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from shards.tokenizer import Tokenizer

    out = export_hf(_perturbed(CONFIGS["tied"]), tmp_path / "hf", tokenizer_path)
    config, generation = AutoConfig.from_pretrained(out), GenerationConfig.from_pretrained(out)
    hf_tok, ours = AutoTokenizer.from_pretrained(out), Tokenizer(tokenizer_path)
    for name, expected in (("bos", ours.start_id), ("eos", ours.eos_id), ("pad", ours.unk_id)):
        named = [getattr(x, f"{name}_token_id") for x in (config, generation, hf_tok)]
        assert named == [expected] * 3, name
    assert hf_tok.pad_token_id != hf_tok.eos_token_id  # so generate() needs no attention mask


def test_transformers_loads_the_export_and_generates_greedily_without_a_warning(tmp_path, tokenizer_path):
    """Untouched: no "generation flags are not valid: ['temperature']", no "attention mask is not set"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm.generate import generate
    from shards.tokenizer import Tokenizer

    model = _perturbed(CONFIGS["untied-gqa"])
    out = export_hf(model, tmp_path / "hf", tokenizer_path)
    logging.Logger.warning_once.cache_clear()  # transformers says some things once per process
    with transformers_warnings() as said:
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(out)("我们要发展经济", return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = hf.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1] :].tolist()
            by_default = hf.generate(ids)[0, ids.shape[1] :].tolist()  # greedy, up to the context
    assert said == []
    tok = Tokenizer(tokenizer_path)
    ours = generate(model, [ids[0].tolist()], max_new_tokens=12, temperature=0, eos_id=tok.eos_id)[0]
    assert greedy[: len(ours)] == ours and by_default[:12] == greedy
    assert ids.shape[1] + len(by_default) <= CONFIGS["untied-gqa"].max_seq_len


def test_a_model_trained_with_documents_apart_exports_as_a_plain_llama(tmp_path, tokenizer_path):
    """Keeping documents apart is a training-time choice: the checkpoint records the recipe's model
    section with it, and the export is the same plain LlamaForCausalLM, computing the same logits."""
    import dataclasses

    from transformers import LlamaForCausalLM

    from llm.config import ModelSection

    cfg = CONFIGS["untied-gqa"]
    section = ModelSection(**dataclasses.asdict(cfg), attention="document", positions="document")
    model = _perturbed(cfg)
    ckpt = save_composer_weights(dict(model.state_dict()), section, tmp_path / "w.pt")
    assert torch.load(ckpt, weights_only=False)["llm_model_config"]["attention"] == "document"
    out = tmp_path / "hf"
    assert llm_main(["export", str(ckpt), "--tokenizer", tokenizer_path, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "positions" not in config and "document" not in json.dumps(config)
    hf = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
