"""`llm export`'s files: a model written as a Hugging Face Llama folder (all the writing is here).

The folder loads with `transformers.LlamaForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)`:
    config.json              LlamaForCausalLM config (shape, rope_theta, rms_norm_eps, tying, GQA);
                             Qwen2ForCausalLM for a model with q/k/v biases (`llm.weights.hf`)
    model.safetensors        weights under Llama names (no lm_head when tied: HF re-ties it)
    tokenizer.model          the SentencePiece model, copied (LlamaTokenizer);
    or tokenizer.json        a Hugging Face tokenizer's, copied byte for byte (LlamaTokenizerFast,
                             which adds the BOS below as LlamaTokenizer does; the file is not changed)
    tokenizer_config.json    the tokenizer class and settings, the special tokens (the start token as BOS)
    special_tokens_map.json  the same special tokens
    generation_config.json   the same start, stop and pad ids, greedy, at most the model's context
    chat_template.json       an SFT model's chat template (`shards.chat_template`), for `llm chat`
Names and config keys come from `llm.weights.hf`, which also reads such a folder back. Our rotary
embeddings already use HF's rotate_half layout, so q/k rows are copied as they are.

Reproducing our commands with no edit: `llm generate` and `llm eval` start every context with the
tokenizer's start token (EOS: every document of our shards begins after one; `Tokenizer.start_id`).
The exported tokenizer therefore names that token as its BOS and adds it (`add_bos_token: true`), so
`AutoTokenizer(...)(text)`, transformers' `generate` and `lm_eval --model hf` see the same ids as our
commands, and config.json, generation_config.json and the tokenizer files name the same BOS, EOS
and pad ids (`special_ids`). The SentencePiece model's own BOS piece, `<s>`, is no document start
for our models (an SFT template may use it as a separator). The pad id is the tokenizer's own pad,
else its unknown piece (`<unk>`, which a byte-fallback tokenizer never produces): a pad distinct
from EOS lets transformers' `generate` run on bare input ids without asking for an attention mask.
generation_config.json is greedy (`llm generate --temperature 0`, token for token) and stops at the
model's context, as our commands do; sampling like `llm generate` is
`generate(..., do_sample=True, temperature=0.8, top_k=50)` (`llm.generate.Sampling`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llm.model import Transformer
from llm.weights.hf import SpecialIds, hf_config, to_hf
from shards.chat_template import TEMPLATE_FILE
from shards.tokenizer import SENTENCEPIECE, Tokenizer
from storage import atomic_path


def export_hf(
    model: Transformer,
    out: str | Path,
    tokenizer_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    chat_template: dict | None = None,
) -> Path:
    """Write `model` (and the tokenizer and chat template, if given) into the folder `out`; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tok is not None:
        tok.check_fits(model.cfg.vocab_size)
    tensors = {n: p.to(dtype) for n, p in model.state_dict().items()}
    with atomic_path(out / "model.safetensors") as tmp:  # mode 0644 (umask 022), as the other files
        save_file(to_hf(tensors, model.cfg.tie_embeddings), str(tmp), metadata={"format": "pt"})
    ids = special_ids(tok) if tok else SpecialIds(None, None, None)
    write_json(out / "config.json", hf_config(model.cfg, ids, str(dtype).removeprefix("torch.")))
    if tok is not None:
        write_tokenizer_files(tok, ids, out, model.cfg.max_seq_len)
    if chat_template is not None:
        write_json(out / TEMPLATE_FILE, chat_template)
    return out


def special_ids(tok: Tokenizer) -> SpecialIds:
    """The export's BOS (our start token), EOS and pad (the tokenizer's pad, else `<unk>`, when it
    is neither): module docstring."""
    pad = next((i for i in (tok.pad_id, tok.unk_id) if i not in (None, tok.start_id, tok.eos_id)), None)
    return SpecialIds(bos=tok.start_id, eos=tok.eos_id, pad=pad)


def write_tokenizer_files(tok: Tokenizer, ids: SpecialIds, out: Path, max_len: int) -> None:
    """tokenizer.model or tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json: what makes transformers and lm-eval tokenize and generate as our
    commands do (module docstring)."""
    (out / tok.file_name).write_bytes(tok.files[tok.file_name])
    special = {"bos_token": ids.bos, "eos_token": ids.eos, "unk_token": tok.unk_id, "pad_token": ids.pad}
    special = {k: tok.piece(i) for k, i in special.items() if i is not None}
    sentencepiece = tok.kind == SENTENCEPIECE
    settings = {
        "tokenizer_class": "LlamaTokenizer" if sentencepiece else "LlamaTokenizerFast",
        # Our prompts start a document after the start token (EOS; Tokenizer.encode_prompt):
        # it is this tokenizer's BOS, added to every encoding as our commands add it.
        "add_bos_token": ids.bos is not None,
        "add_eos_token": False,
        "legacy": False,
    }
    if sentencepiece:  # HF must add the "▁" word prefix exactly when SentencePiece itself does
        settings["add_prefix_space"] = tok.adds_dummy_prefix
    # (not for a tokenizer.json: its pre-tokenizer says it, and the key would make transformers
    # rebuild the tokenizer from a SentencePiece model)
    settings |= {"model_max_length": max_len, "clean_up_tokenization_spaces": False, **special}
    write_json(out / "tokenizer_config.json", settings)
    write_json(out / "special_tokens_map.json", special)
    generation = {"bos_token_id": ids.bos, "eos_token_id": ids.eos, "pad_token_id": ids.pad}
    write_json(out / "generation_config.json", {**generation, "do_sample": False, "max_length": max_len})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
