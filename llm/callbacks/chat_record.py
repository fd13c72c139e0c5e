"""Records an SFT run's chat template in every checkpoint, so `llm chat` finds it with the weights."""

from __future__ import annotations

from composer.core import Callback

from llm.chat_template import CHAT_TEMPLATE_KEY, ChatTemplate
from llm.data import chat_template_of


class ChatTemplateRecord(Callback):
    """Its state (saved in each checkpoint) is the template; `llm.weights` reads it back."""

    def __init__(self, template: ChatTemplate):
        self.template = template

    def state_dict(self) -> dict:
        return {CHAT_TEMPLATE_KEY: self.template.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        pass  # the run's shards say which template applies


def chat_record_callbacks(ctx) -> list[Callback]:
    """For `llm.trainer.CALLBACK_BUILDERS`: the record, when the recipe fine-tunes (data.kind=sft)."""
    template = chat_template_of(ctx.cfg)
    return [ChatTemplateRecord(template)] if template is not None else []
