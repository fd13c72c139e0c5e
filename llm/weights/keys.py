"""The keys under which a checkpoint records what loading it needs besides the tensors.

Written by the callbacks that add them to every checkpoint (`llm/callbacks/generation.py`,
`llm/callbacks/chat_record.py`) and by `llm import`; read by `llm.weights.composer_layout`.
Nothing heavy is imported here: a callback that needs a key name does not pull in the readers.
"""

from __future__ import annotations

from shards.chat_template import CHAT_TEMPLATE_KEY

MODEL_CONFIG_KEY = "llm_model_config"  # the model's shape (a ModelConfig as a dict)

__all__ = ["CHAT_TEMPLATE_KEY", "MODEL_CONFIG_KEY"]
