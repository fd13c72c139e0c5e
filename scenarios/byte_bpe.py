"""A Hugging Face tokenizer made on the spot (no download): a byte-level BPE, as Llama 3, Qwen 2 and
GPT-2 ship theirs, trained with the `tokenizers` library and saved as `tokenizer.json` beside a
`tokenizer_config.json` that names its special tokens. The tests build theirs with it
(tests/support/hf_tokenizer.py), `make bench-tokenizer` the one it times against SentencePiece.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS, PAD = "<|endoftext|>", "<|pad|>"


def train_byte_level_bpe(folder: Path, texts: list[str], vocab_size: int) -> Path:
    """`folder` with tokenizer.json (byte-level BPE; EOS and pad added after the vocabulary, so
    their ids are not SentencePiece's 0/1/2) and tokenizer_config.json (EOS and pad, no BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([EOS, PAD])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": {"content": EOS, "special": True, "__type": "AddedToken"},
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def english_and_code(modules: int = 2) -> list[str]:
    """Real English prose and code shipped with Python: the source of its json and argparse modules,
    then (for more) its standard library's other modules in name order."""
    import argparse
    import json as json_module

    first = [Path(m.__file__) for m in (json_module, argparse)]
    rest = sorted(p for p in Path(argparse.__file__).parent.glob("*.py") if p not in first)
    return [p.read_text(encoding="utf-8") for p in (first + rest)[:modules]]
