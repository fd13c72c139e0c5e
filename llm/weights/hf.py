"""The Hugging Face Llama family's layout, both ways: Llama, Mistral and Qwen2 (and Baichuan-7B's W_pack).

One adapter, two directions:
- Names. `HF_TOP` / `HF_LAYER` map ours (llama2.c's) to transformers'; `to_hf` for `llm export`
  (`llm.weights.hf_export`), `from_hf` for reading a folder and for the imports (Baichuan-7B fuses
  q, k and v into one `W_pack` matrix, split here for `llm.weights.baichuan`).
- config.json. `hf_config` writes one: `LlamaForCausalLM`, or `Qwen2ForCausalLM` for a model with
  q/k/v biases (Llama's `attention_bias` would put one on o_proj too). `config_from_hf` reads one
  key by key (`HF_CONFIG`; an absent key as the architecture's transformers class assumes it,
  `FAMILIES`) and refuses in one line, naming the key, what our model cannot compute: another
  architecture (mixture-of-experts, ...), another activation, rope scaling, biases other than
  Qwen2's q/k/v ones, a head size other than dim / n_heads, a sliding window shorter than the
  context, quantized weights.
- `llm import --from hf` (`import_hf`): a folder in transformers' layout (`config.json`; safetensors,
  one file or shards with `model.safetensors.index.json`; or `pytorch_model.bin`, read as weights
  only) checked against the recipe as every import is (`llm.weights.importing`); a recipe's
  vocabulary may be larger than the checkpoint's (rows padded, `pad_vocab`). `model_section`
  writes the recipe's `model:` section for such a folder (`llm import --from hf SRC --model-section`).

transformers ships no importable map for these layouts (its conversions are repository scripts,
absent from the installed package) and is no dependency of training: nothing here imports it. Our
rotary embeddings already use HF's rotate_half layout, so q/k rows are copied as they are.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.model import ModelConfig
from llm.weights.build import LoadedWeights, drop_tied_output
from llm.weights.importing import SourceValue, check_fits, existing, refuse_contradictions
from llm.weights.safe_load import read_tensor_file
from shards.chat_template import TEMPLATE_FILE

# ours -> Hugging Face Llama, per layer and at the top level
HF_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # Qwen2 (model.qkv_bias)
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FUSED_QKV = "self_attn.W_pack.weight"  # Baichuan-7B: [q; k; v] stacked along the rows
FROM_HF_LAYER = {hf: ours for ours, hf in HF_LAYER.items()}
FROM_HF_TOP = {hf: ours for ours, hf in HF_TOP.items()}

# ModelConfig field -> config.json key (the same in Llama, Mistral, Qwen2 and Baichuan-7B)
HF_CONFIG = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim")  # no default stands in for these
# what transformers' LlamaConfig assumes for an absent key
HF_DEFAULTS = {"max_seq_len": 2048, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False}


@dataclass(frozen=True)
class Family:
    """An architecture of the Llama family: its model_type, what its transformers config class
    assumes for absent keys (our field names), and whether its attention has q/k/v biases."""

    model_type: str
    defaults: dict[str, Any]
    qkv_bias: bool = False


FAMILIES = {
    "LlamaForCausalLM": Family("llama", HF_DEFAULTS),
    "MistralForCausalLM": Family("mistral", HF_DEFAULTS | {"n_kv_heads": 8, "max_seq_len": 131072}),
    "Qwen2ForCausalLM": Family("qwen2", HF_DEFAULTS | {"max_seq_len": 32768}, qkv_bias=True),
    # read back from a folder (`llm generate`); imported with its own checks by llm.weights.baichuan
    "BaiChuanForCausalLM": Family("baichuan", HF_DEFAULTS | {"max_seq_len": 4096}),
}
IMPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # `llm import --from hf`


def to_hf(tensors: dict[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """Our tensors under Hugging Face Llama names, on the CPU (no lm_head when `tied`)."""
    out = {}
    for name, tensor in tensors.items():
        if name in HF_TOP:
            hf = HF_TOP[name]
        else:
            _, index, rest = name.split(".", 2)
            hf = f"model.layers.{index}.{HF_LAYER[rest]}"
        out[hf] = tensor.detach().to("cpu").contiguous()
    if tied:
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return out


def from_hf(tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Our tensors from Hugging Face Llama-family or Baichuan-7B names (W_pack split into q, k, v)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        if name in FROM_HF_TOP:
            out[FROM_HF_TOP[name]] = tensor
            continue
        parts = name.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"]:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
        prefix, rest = f"layers.{parts[2]}.", parts[3]
        if rest == FUSED_QKV:
            for ours, part in zip(("wq", "wk", "wv"), tensor.chunk(3, dim=0), strict=True):
                out[f"{prefix}attention.{ours}.weight"] = part
        elif rest in FROM_HF_LAYER:
            out[prefix + FROM_HF_LAYER[rest]] = tensor
        else:
            raise ConfigError(f"{source}: unexpected tensor {name} for a Llama model")
    return out


class SpecialIds(NamedTuple):
    """The BOS, EOS and pad ids an export's files name (each None when the tokenizer has none)."""

    bos: int | None
    eos: int | None
    pad: int | None


# --- config.json, both ways ------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, ids: SpecialIds, dtype: str) -> dict[str, Any]:
    """`config.json` for `transformers.LlamaForCausalLM`, or `Qwen2ForCausalLM` with q/k/v biases."""
    values = dataclasses.asdict(cfg) | {"n_kv_heads": cfg.kv_heads, "hidden_dim": cfg.ffn_hidden_dim}
    shape = {key: values[field] for field, key in HF_CONFIG.items()}
    if cfg.qkv_bias:  # Qwen2: biases on q, k and v only; no sliding window
        head = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **shape}
        attention = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    else:
        head = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **shape,
            "head_dim": cfg.head_dim,
        }
        attention = {"attention_bias": False, "mlp_bias": False}
    return {
        **head,
        "hidden_act": "silu",
        "rope_scaling": None,
        **attention,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(data: dict[str, Any], source: str, context: int | None = None) -> ModelConfig:
    """Our model config from a Llama-family `config.json` (`source` names it in messages); what the
    model cannot compute is refused naming the key. `context`: the tokens the model will see at
    once (the recipe's model.max_seq_len), which a sliding window must not cut; None: the source's
    own max_position_embeddings."""
    family = FAMILIES[architecture(data, source, tuple(FAMILIES))]
    absent = [HF_CONFIG[f] for f in REQUIRED if data.get(HF_CONFIG[f]) is None]
    if absent:
        raise ConfigError(f"{source} lacks {', '.join(absent)}: is it a model's config.json?")
    values = family.defaults | {f: data[k] for f, k in HF_CONFIG.items() if data.get(k) is not None}
    values.setdefault("n_kv_heads", values["n_heads"])
    values["norm_eps"], values["rope_theta"] = float(values["norm_eps"]), float(values["rope_theta"])
    cfg = ModelConfig(**values, qkv_bias=family.qkv_bias)
    try:
        cfg.validate()
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    refuse_inexpressible(data, cfg, source, context or cfg.max_seq_len)
    return cfg


def architecture(data: dict[str, Any], source: str, known: tuple[str, ...] = IMPORTED) -> str:
    """The one architecture `data` names (`architectures`, else `model_type`), if it is `known`."""
    names = data.get("architectures") or []
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        by_type = {FAMILIES[n].model_type: n for n in known}
        if data.get("model_type") in by_type:
            return by_type[data["model_type"]]
        names = [f"model_type={data.get('model_type')!r}"]
    if len(names) != 1 or names[0] not in known:
        raise ConfigError(
            f"{source} has architectures={names}: the model computes {', '.join(known)} only (dense "
            f"decoder-only, SwiGLU, RMSNorm, rotary embeddings); mixture-of-experts and other "
            f"architectures are not supported"
        )
    return names[0]


def refuse_inexpressible(data: dict[str, Any], cfg: ModelConfig, source: str, context: int) -> None:
    """ConfigError naming the first key of `data` that asks for what our model does not compute."""
    scaling = data.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "?"
    window = sliding_window(data)
    problems = [
        ("quantization_config", "quantization_config" in data, "the weights are quantized; import the "
         "unquantized checkpoint"),
        ("hidden_act", data.get("hidden_act", "silu") not in ("silu", "swish"), "the feed-forward is SwiGLU "
         "(silu)"),
        ("rope_scaling", rope_type != "default", "the model has plain rotary embeddings (model.rope_theta), "
         "no rope scaling"),
        ("attention_bias", bool(data.get("attention_bias")), "biases on q, k, v and o; the model has q/k/v "
         "biases only (model.qkv_bias, Qwen2's)"),
        ("mlp_bias", bool(data.get("mlp_bias")), "the feed-forward has no biases"),
        ("head_dim", data.get("head_dim") not in (None, cfg.head_dim), f"the model's head size is "
         f"hidden_size / num_attention_heads = {cfg.head_dim}"),
        ("attention_dropout", bool(data.get("attention_dropout")), "the model has no dropout"),
        ("num_local_experts", bool(data.get("num_local_experts")), "mixture-of-experts"),
        ("num_experts", bool(data.get("num_experts")), "mixture-of-experts"),
        ("sliding_window", window is not None and window < context, f"attention reaches back {window} tokens "
         f"only, the model's the whole context of {context} (model.max_seq_len): train at "
         f"model.max_seq_len <= {window}, or import a checkpoint without a sliding window"),
    ]  # fmt: skip
    for key, refused, why in problems:
        if refused:
            raise ConfigError(
                f"{source} has {key}={json.dumps(data.get(key))}, which the model cannot compute: {why}"
            )


def sliding_window(data: dict[str, Any]) -> int | None:
    """The window of a config's sliding-window layers, None when no layer has one: Mistral's
    `sliding_window`; Qwen2's only with `use_sliding_window`, from layer `max_window_layers` on (or
    where its `layer_types` say so)."""
    window = data.get("sliding_window")
    if window is None or "use_sliding_window" not in data:
        return window  # Llama (no key), Mistral
    layer_types = data.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    layers = data.get(HF_CONFIG["n_layers"], 0)
    return window if data["use_sliding_window"] and data.get("max_window_layers", 0) < layers else None


# --- reading a folder ----------------------------------------------------------------------------


def read_hf_tensors(src: Path, trust: bool = False) -> dict[str, Tensor]:
    """All tensors of a HF checkpoint: one file, or a folder (single file or shards + index json)."""
    if src.is_file():
        return read_tensor_file(src, trust)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = src / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in read_tensor_file(src / shard, trust).items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return read_tensor_file(src / single, trust)
    raise FileNotFoundError(
        f"{src} holds no model.safetensors, pytorch_model.bin or their sharded index json"
    )


def read_config_json(src: Path) -> tuple[dict[str, Any], Path]:
    """The `config.json` of a folder (or of the folder holding a weights file), and its path."""
    path = (src if src.is_dir() else src.parent) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a Hugging Face model folder holds its config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8")), path
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not JSON ({err})") from None


def read_hf_folder(folder: Path, trust: bool = False) -> LoadedWeights:
    """Our tensors, config and chat template (if any) from a Llama-family folder (`llm export`'s too)."""
    data, path = read_config_json(folder)
    cfg = config_from_hf(data, str(path))
    template_file = folder / TEMPLATE_FILE
    template = json.loads(template_file.read_text(encoding="utf-8")) if template_file.is_file() else None
    return LoadedWeights(from_hf(read_hf_tensors(folder, trust), str(folder)), cfg, template)


# --- `llm import --from hf` ----------------------------------------------------------------------


def import_hf(src: str | Path, cfg: ModelConfig, *, trust: bool = False) -> dict[str, Tensor]:
    """Our tensors from a Llama / Mistral / Qwen2 folder in transformers' layout, checked against `cfg`
    (the recipe's model section); the vocabulary padded up to the recipe's."""
    src = existing(src)
    data, path = read_config_json(src)
    architecture(data, str(path))
    theirs = config_from_hf(data, str(path), context=cfg.max_seq_len)
    refuse_contradictions(_stated(data, theirs, str(path)), cfg)
    if cfg.vocab_size < theirs.vocab_size:
        raise ConfigError(
            f"{path} has vocab_size={theirs.vocab_size} but the recipe has model.vocab_size={cfg.vocab_size}: "
            f"set model.vocab_size: {theirs.vocab_size} in the recipe (or more: the rows are padded)"
        )
    tensors = from_hf(read_hf_tensors(src, trust), str(src))
    tensors = drop_tied_output(tensors, cfg, str(src), output_name="lm_head.weight")
    tensors = pad_vocab(tensors, cfg.vocab_size)
    check_fits(tensors, cfg, src)
    return tensors


def _stated(data: dict[str, Any], theirs: ModelConfig, origin: str) -> list[SourceValue]:
    """What config.json says of the shape, in our fields (absent keys: the architecture's default).
    Not max_position_embeddings: RoPE has no learned positions, the context is the recipe's choice;
    not vocab_size: a recipe may pad it (`import_hf`)."""
    values = []
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "norm_eps", "rope_theta"):
        key = HF_CONFIG[field]
        evidence = "" if key in data else " (by default)"
        values.append(SourceValue(field, key, getattr(theirs, field), origin, evidence))
    tied = bool(theirs.tie_embeddings)
    values.append(SourceValue("tie_embeddings", "tie_word_embeddings", tied, origin))
    values.append(
        SourceValue("qkv_bias", "q/k/v biases", theirs.qkv_bias, origin, f" ({architecture(data, origin)})")
    )
    return values


def pad_vocab(tensors: dict[str, Tensor], vocab_size: int) -> dict[str, Tensor]:
    """The embedding (and an untied output matrix) grown to `vocab_size` rows, each new row the mean
    of the existing ones: an id the tokenizer never produces then scores about the average logit
    (where a zero row scores 0, above most tokens' logits), and a token added later starts from the
    average embedding (Hewitt, "Initializing new word embeddings for pretrained language models")."""
    out = dict(tensors)
    for name in ("tok_embeddings.weight", "output.weight"):
        weight = out.get(name)
        if weight is None or weight.shape[0] >= vocab_size:
            continue
        mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
        out[name] = torch.cat([weight, mean.expand(vocab_size - weight.shape[0], -1)])
    return out


def model_section(src: str | Path) -> str:
    """The recipe's `model:` section (YAML) for a Llama / Mistral / Qwen2 folder, from its config.json."""
    data, path = read_config_json(existing(src))
    arch = architecture(data, str(path))
    cfg = config_from_hf(data, str(path))
    lines = [f"# {arch} from {path} (llm import --from hf {src} --model-section)", "model:"]
    notes = {
        "vocab_size": "rows of the embedding: this or more (the import pads)",
        "max_seq_len": "the checkpoint's limit: set the context to train at, the shards' --seq-len",
        "n_kv_heads": "grouped-query attention" if cfg.kv_heads < cfg.n_heads else "",
        "qkv_bias": "Qwen2's biases on q, k and v" if cfg.qkv_bias else "",
    }
    for field in (*HF_CONFIG, "qkv_bias"):
        value = getattr(cfg, field)
        text = str(value).lower() if isinstance(value, bool) else _yaml_number(value)
        note = notes.get(field, "")
        lines.append(f"  {field}: {text}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


def _yaml_number(value: int | float) -> str:
    """A number as YAML reads it back, of the same type: `1.0e-06` (YAML 1.1 reads `1e-06` as a string)."""
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
