"""`llm export`: write a checkpoint in the Hugging Face Llama layout.

The folder loads with `transformers.LlamaForCausalLM.from_pretrained(out)` and
`LlamaTokenizer.from_pretrained(out)`:
    config.json              LlamaForCausalLM config (shape, rope_theta, rms_norm_eps, tying, GQA)
    model.safetensors        weights under Llama names (no lm_head when tied: HF re-ties it)
    tokenizer.model          the SentencePiece model, copied
    tokenizer_config.json    LlamaTokenizer settings and the special tokens
Our rotary embeddings already use HF's rotate_half layout, so q/k rows are copied as they are.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from torch import Tensor

from llm.checkpoint_io import LoadedWeights, write_json
from llm.errors import ConfigError
from llm.model import ModelConfig

# ours -> Hugging Face Llama, per layer and at the top level
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{LAYER_NAMES[rest]}"


def our_name(hf: str) -> str | None:
    for ours, theirs in TOP_NAMES.items():
        if hf == theirs:
            return ours
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for ours, theirs in LAYER_NAMES.items():
            if parts[3] == theirs:
                return f"layers.{parts[2]}.{ours}"
    return None


def to_hf_state_dict(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out = {hf_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return out


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(data: dict) -> ModelConfig:
    heads = data["num_attention_heads"]
    return ModelConfig(
        vocab_size=data["vocab_size"],
        dim=data["hidden_size"],
        n_layers=data["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=data.get("num_key_value_heads") or heads,
        hidden_dim=data["intermediate_size"],
        max_seq_len=data.get("max_position_embeddings", 2048),
        norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=data.get("rope_theta", 10000.0),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
    )


def read_hf_folder(folder: Path) -> LoadedWeights:
    """Weights and config of a folder written by `export` (a single model.safetensors)."""
    import json

    from safetensors.torch import load_file

    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"{folder} has config.json but no model.safetensors")
    cfg = config_from_hf(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    tensors = {}
    for name, tensor in load_file(str(weights_file)).items():
        ours = our_name(name)
        if ours is None:
            raise ConfigError(f"{weights_file}: unexpected tensor {name} for a Llama model")
        tensors[ours] = tensor
    return LoadedWeights(tensors, cfg)


def export(model, tokenizer_path: str | None, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` (a Transformer) and its tokenizer into `out` in the HF Llama layout."""
    from safetensors.torch import save_file

    from llm.tokenizer import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tok is not None:
        tok.check_fits(model.cfg.vocab_size)
    tensors = {n: p.to(dtype) for n, p in model.state_dict().items()}
    save_file(to_hf_state_dict(tensors, model.cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    bos, eos = (tok.bos_id, tok.eos_id) if tok else (None, None)
    write_json(out / "config.json", hf_config(model.cfg, bos, eos, str(dtype).removeprefix("torch.")))
    if tok is not None:
        write_tokenizer_files(tok, out, model.cfg.max_seq_len)
    return out


def write_tokenizer_files(tok, out: Path, max_len: int) -> None:
    shutil.copyfile(tok.path, out / "tokenizer.model")
    sp = tok._sp

    def piece(i: int | None) -> str | None:
        return sp.id_to_piece(i) if i is not None else None

    special = {
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(tok.eos_id),
        "unk_token": piece(sp.unk_id()),
    }
    special = {k: v for k, v in special.items() if v is not None}
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            # Our prompts start a document after EOS (see Tokenizer.encode_prompt), not after BOS.
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            # HF must add the "▁" word prefix exactly when SentencePiece itself does.
            "add_prefix_space": _adds_dummy_prefix(tok.path),
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            **special,
        },
    )
    write_json(out / "special_tokens_map.json", special)


def _adds_dummy_prefix(model_file: Path) -> bool:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    return bool(proto.normalizer_spec.add_dummy_prefix)


# --- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="Composer checkpoint (.pt, local or s3://) or `llm import` output")
    parser.add_argument("--recipe", help="the recipe the model was trained with (its model: section)")
    parser.add_argument("--tokenizer", help="SentencePiece .model to ship with the export")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")


def run(args: argparse.Namespace) -> int:
    from llm.checkpoint_io import load_model

    model = load_model(args.checkpoint, args.recipe)
    out = export(model, args.tokenizer, args.out, getattr(torch, args.dtype))
    print(f"exported {model.num_params():,} parameters to {out} (Hugging Face Llama layout)")
    return 0
