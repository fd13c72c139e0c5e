"""The one exception type of the shard contract."""


class ShardsError(ValueError):
    """A shard folder, tokenizer or chat template that cannot be used as given.

    The message names the thing that is wrong and how to fix it; `python -m convert` and `llm`
    (and `train.py`) print it as one line and exit 2, as they do their own ConvertError/ConfigError.
    """
