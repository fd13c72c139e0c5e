"""A small model with perturbed norms, exported to the HF layout: what the lm-eval comparisons score."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch


def perturbed_export(folder: Path, tokenizer: str, *, max_seq_len: int, seed: int) -> Path:
    """Export a 2-layer model whose norm weights are not all 1 (so a wrong norm shows in the scores)."""
    from llm.model import ModelConfig, Transformer
    from llm.weights.hf_export import export_hf

    cfg = ModelConfig(
        vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=max_seq_len, tie_embeddings=True
    )
    model = Transformer(cfg, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return export_hf(model, folder, tokenizer)


@contextlib.contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """Collects every warning said inside the block: Python's and those transformers logs (its
    loggers do not propagate to the root logger, so pytest would not show them)."""
    import transformers

    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Collect(logging.WARNING)
    transformers.logging.get_logger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as python_warnings:
            warnings.simplefilter("always")
            yield said
    finally:
        transformers.logging.get_logger().removeHandler(handler)
        said.extend(str(w.message) for w in python_warnings)
