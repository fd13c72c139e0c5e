"""A Hugging Face tokenizer built in the test session (no download): a byte-level BPE trained with
the `tokenizers` library (scenarios/byte_bpe.py) and saved as `tokenizer.json` with a
`tokenizer_config.json` naming its special tokens; and a mixed text set to encode with it.

A pytest plugin (tests/conftest.py lists it): tests name `hf_tokenizer` as an argument.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scenarios.byte_bpe import EOS, PAD, english_and_code, train_byte_level_bpe

HF_VOCAB = 3000
__all__ = ["EOS", "MIXED_TEXTS", "PAD", "WITH_SPECIAL", "copy_without_eos", "english_and_code"]
# Chinese, English, code, emoji, and the whitespace a byte-level tokenizer must give back exactly.
MIXED_TEXTS = [
    "北京市经济发展很快，人民生活水平不断提高。",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\t// a tab\n}\r\n",
    "emoji 😀🚀 and a family 👨‍👩‍👧‍👦, a flag 🇨🇳, a skin tone 👍🏽, a keycap 1️⃣",
    "混合 mixed 文本 text：“引号”《书名》——破折号……省略号",
    "  leading and trailing spaces  ",
    "\n\nblank lines\n\n\n   indented\n",
    "全角ＡＢＣ１２３ and 半角ABC123, 龘 (rare), 𠀀 (astral CJK)",
    "日本語のテキストと한국어 텍스트, Zoë's café, naïve façade",
    'SELECT * FROM users WHERE name = "王小明" AND age >= 30;  -- SQL',
    "x",
]
# A special token's text inside a document: encoded as that token, by us as by transformers.
WITH_SPECIAL = f"第一篇{EOS}第二篇"


def copy_without_eos(folder: Path, out: Path) -> Path:
    """The same tokenizer with a tokenizer_config.json that names no EOS token."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory, chinese_documents) -> Path:
    """A folder holding a byte-level BPE's tokenizer.json and tokenizer_config.json, trained once
    per session on People's Daily and Python's own English and code."""
    texts = chinese_documents[:600] + english_and_code()
    return train_byte_level_bpe(tmp_path_factory.mktemp("hf-tokenizer"), texts, HF_VOCAB)
