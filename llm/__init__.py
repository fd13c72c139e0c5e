"""Train and use LLaMA/Baichuan-style language models: model, config, data, Composer trainer.

Submodules are imported on demand: `import llm` must stay cheap (no Composer/streaming import).
"""

__version__ = "0.1.0"
