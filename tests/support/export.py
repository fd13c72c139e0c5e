"""A small model with perturbed norms, exported to the HF layout: what the lm-eval comparisons score."""

from __future__ import annotations

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
