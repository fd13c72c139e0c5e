"""Records what `llm chat` needs beside the weights in every checkpoint of an SFT run: the chat
template and the model's shape (the generation callback records the shape too, when it is on)."""

from __future__ import annotations

import dataclasses

from composer.core import Callback

from llm.data import chat_template_of
from llm.model import ModelConfig
from llm.weights.keys import MODEL_CONFIG_KEY
from shards.chat_template import CHAT_TEMPLATE_KEY, ChatTemplate


class ChatRecord(Callback):
    """Its state, saved in each checkpoint, is the template and the model config; `llm.weights.composer_layout`
    reads them back."""

    def __init__(self, template: ChatTemplate, model: ModelConfig):
        self.template, self.model = template, model

    def state_dict(self) -> dict:
        return {CHAT_TEMPLATE_KEY: self.template.to_dict(), MODEL_CONFIG_KEY: dataclasses.asdict(self.model)}

    def load_state_dict(self, state: dict) -> None:
        pass  # the run's shards and recipe say what applies


def chat_record_callbacks(ctx) -> list[Callback]:
    """For `llm.trainer.CALLBACK_BUILDERS`: the record, when the recipe fine-tunes (data.kind=sft)."""
    template = chat_template_of(ctx.cfg)
    return [ChatRecord(template, ctx.cfg.model)] if template is not None else []
