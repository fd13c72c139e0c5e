"""A LLaMA / Baichuan-style decoder-only transformer in plain PyTorch.

Read top to bottom: config, the pieces (RMSNorm, rotary embeddings, attention, SwiGLU), the block,
the model, then the KV cache and the deterministic initialisation. No training concerns live here:
parallelism (FSDP, activation checkpointing), losses and optimisers are applied from outside.

Parameter names follow llama2.c (``tok_embeddings``, ``layers.{i}.attention.wq`` ...), so
baby-llama2-chinese checkpoints load by name. Rotary embeddings use the Hugging Face Llama
"rotate_half" convention (dimension ``j`` pairs with ``j + head_dim/2``), so exporting to
``LlamaForCausalLM`` and importing Baichuan weights need no permutation of ``wq``/``wk``.

What ``forward`` supports:
- ``forward(tokens)``: causal language modelling over the whole sequence (training path; no
  data-dependent Python control flow, so ``torch.compile`` traces it once).
- ``forward(tokens, cache=cache)``: incremental decoding. Any number of tokens per call (a prompt
  prefill, single-token decode steps, or multi-token chunks after a prefill); each call appends its
  keys/values at ``cache.pos`` and attends causally over everything cached so far.
- ``forward(tokens, documents=[B, T])``: packed documents that do not see each other. ``documents``
  numbers the document of every token (never decreasing along a row: 0, 0, 0, 1, 1, 2, ...); a token
  attends only to earlier tokens of its own document. The mask is built once per call and shared
  by every layer: a FlexAttention block mask on GPUs (the kernel skips the 128 x 128 tiles no query
  of which sees a key of), a boolean ``[B, 1, T, T]`` mask for SDPA elsewhere (on the CPU it is
  faster than FlexAttention, which runs there only as an eager reference). Add
  ``positions=document_positions(documents)`` for rotary positions that restart at each document.
- ``forward(tokens, positions=..., attention_mask=[B, T, T])``: packed sequences, e.g. one prompt
  followed by several continuations that each see the prompt but not each other (evaluation
  scores all options of a question in one pass). ``positions`` (``[T]`` or ``[B, T]``) gives each
  token's rotary position; a ``[B, T, T]`` mask says which key each query may see (each query must
  see at least itself).
- ``attention_mask`` (bool/0-1, ``[B, T]`` for the tokens of this call, False = padding): keys at
  padded slots are never attended to. With a cache the mask is remembered, so pass it once with the
  left-padded prompt and omit it for the decode steps. Positions are not shifted per row: rotary
  attention depends only on the *distance* between query and key, so a left-padded row attends
  exactly as the unpadded prompt would (up to float rounding).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


class ModelConfigError(ValueError):
    """A model configuration that cannot build a model; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """The model's shape. Each field's comment is its line in docs/config.md (`llm config`)."""

    vocab_size: int = 64793  # embedding rows: at least the tokenizer's vocabulary (padding allowed)
    dim: int = 512  # the width of the residual stream (hidden size)
    n_layers: int = 8  # decoder blocks
    n_heads: int = 8  # query heads; the head size is dim / n_heads (even, for rotary embeddings)
    n_kv_heads: int | None = None  # None = n_heads; fewer = grouped-query attention
    hidden_dim: int | None = None  # SwiGLU hidden size; None = the multiple_of rule below
    multiple_of: int = 32  # hidden = multiple_of * ceil(int(2 * 4 * dim / 3) / multiple_of)
    max_seq_len: int = 512  # the context: tokens per sample (must equal the shards' seq_len)
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    rope_theta: float = 10000.0  # the rotary embeddings' base
    tie_embeddings: bool = False  # the output projection is the token embedding matrix
    init_std: float = 0.02  # std of the initial weights (residual outputs: / sqrt(2 * n_layers))
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2's attention)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        # baby-llama2-chinese / llama2.c: 2/3 of 4*dim (keeps SwiGLU's 3 matrices at ~8*dim^2),
        # rounded up to a multiple of `multiple_of` for efficient matmul shapes.
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        positive = ["vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ["n_kv_heads", "hidden_dim"]:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ModelConfigError(
                    f"model.{name} must be a positive integer or null (derived), got {value!r}"
                )
        if self.dim % self.n_heads:
            raise ModelConfigError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}); "
                f"choose n_heads among the divisors of dim"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"head size dim/n_heads = {self.head_dim} must be even for rotary embeddings; "
                f"change model.dim or model.n_heads"
            )
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.kv_heads}) for grouped-query attention"
            )
        for name in ["norm_eps", "rope_theta", "init_std"]:
            if not getattr(self, name) > 0:
                raise ModelConfigError(f"model.{name} must be > 0, got {getattr(self, name)!r}")


class Linear(nn.Linear):
    """A linear layer (bias-free unless asked) whose initialisation is left to ``Transformer.init_weights``.

    Skipping torch's default init saves a wasted pass over the weights, and on the meta device it
    avoids torch's slow first-use path for random fills (seconds per process).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised by ``Transformer.init_weights`` (see ``Linear``)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: in bf16 the mean of squares loses too many digits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[T, head_dim]`` for the given absolute positions (HF Llama layout).

    Computed per call rather than stored as a buffer: it costs T * head_dim/2 multiplies, and a
    model built on the meta device then materialised (FSDP) has no buffer to re-initialise.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [T, hd/2], or [B, T, hd/2] for per-row positions
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, T, hd]``: pairs (j, j + hd/2) form the 2-D planes ("rotate_half")."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None, cache: KVCache | None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if mask is None:  # causal over the whole sequence: SDPA's flash kernels
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, Tensor):  # a boolean mask: who sees whom, given in full
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a FlexAttention block mask (documents on a GPU): see `document_mask`
            out = flex_attention(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """Grouped-query attention: query head h reads kv head h // n_rep (the HF convention)."""
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return x
        b, kv, s, hd = x.shape
        return x[:, :, None].expand(b, kv, n_rep, s, hd).reshape(b, kv * n_rep, s, hd)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down one."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)
        self.w2 = Linear(hidden_dim, dim)
        self.w3 = Linear(dim, hidden_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block; the unit FSDP wraps and activation checkpointing recomputes."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        """Build the model; on a real device it is initialised with ``init_weights(seed)``.

        Under ``with torch.device("meta"):`` nothing is allocated or initialised: call
        ``to_empty(device=...)`` and ``init_weights(seed)`` later (or let FSDP call
        ``param_init_fn``) to get exactly the weights an ordinary build with that seed has.
        """
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.init_seed = seed
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = Linear(cfg.dim, cfg.vocab_size)
        self.tie_weights()
        # How `documents` are masked: "auto" (FlexAttention on CUDA, SDPA elsewhere), "flex" or "sdpa".
        self.document_kernel = "auto"
        # Counted now, before FSDP flattens or shards the parameters, for flops_per_token.
        self._non_embedding_params = self.num_params(exclude_embeddings=True)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """Make ``output.weight`` the very Parameter ``tok_embeddings.weight`` when tied.

        Moving a model off the meta device (``to_empty``) creates new Parameters and breaks the tie;
        ``init_weights`` calls this again.
        """
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: Tensor,
        *,
        cache: KVCache | None = None,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        documents: Tensor | None = None,
        head: Callable[[Tensor, Tensor], Any] | None = None,
    ) -> Any:
        """Logits ``[B, T, vocab]`` in fp32 for ``tokens [B, T]`` (see the module docstring).

        ``head``: instead of the output projection, return ``head(hidden, output_weight)`` for the
        final hidden states ``[B, T, dim]`` (after the norm): a loss that projects them itself, e.g.
        chunk by chunk (``llm.loss``). It runs inside this forward, where FSDP2 has the output
        weight gathered."""
        bsz, seqlen = tokens.shape
        start = 0 if cache is None else cache.pos
        h = self.tok_embeddings(tokens)
        if positions is None:
            positions = torch.arange(start, start + seqlen, device=tokens.device)
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        if cos.dim() == 3:  # per-row positions: broadcast over the heads of [B, H, T, hd]
            cos, sin = cos[:, None], sin[:, None]
        if torch.is_autocast_enabled(tokens.device.type):
            cos = cos.to(torch.get_autocast_dtype(tokens.device.type))
            sin = sin.to(cos.dtype)
        mask = None
        if cache is not None:
            mask = cache.attention_mask(seqlen, attention_mask)
        elif attention_mask is not None and attention_mask.dim() == 3:
            mask = attention_mask.bool()[:, None]  # [B, 1, T, T]: who sees whom, given in full
        elif attention_mask is not None:
            mask = causal_padding_mask(attention_mask.bool(), start=0)
        elif documents is not None:  # built once, shared by every layer
            mask = document_mask(documents, self.document_kernel)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, cache)
        if cache is not None:
            cache.pos += seqlen
        if head is not None:
            return head(self.norm(h), self.output.weight)
        return self.output(self.norm(h)).float()

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty KV cache for up to ``max_len`` (default ``max_seq_len``) positions."""
        weight = self.tok_embeddings.weight
        return KVCache(
            n_layers=self.cfg.n_layers,
            batch_size=batch_size,
            n_kv_heads=self.cfg.kv_heads,
            max_len=max_len or self.cfg.max_seq_len,
            head_dim=self.cfg.head_dim,
            device=device if device is not None else weight.device,
            dtype=dtype if dtype is not None else weight.dtype,
        )

    # --- sizes and FLOPs ---------------------------------------------------------------------
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, tied weights once. ``exclude_embeddings`` drops both vocabulary
        matrices (input embedding and output projection): Kaplan et al.'s non-embedding count."""
        total = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates ties
        if exclude_embeddings:
            vocab_matrices = {id(self.tok_embeddings.weight), id(self.output.weight)}
            total -= sum(p.numel() for p in self.parameters() if id(p) in vocab_matrices)
        return total

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 * N + 12 * n_layers * dim * seq_len.

        N counts the parameters that take part in a matmul: all non-embedding parameters plus the
        output projection (vocab * dim), whether tied or not; the input embedding is a lookup, not a
        matmul, so it is left out. The attention term (QK^T and AV, forward + backward) is not
        halved for causality, the PaLM / llm-foundry convention, so MFU figures compare with theirs.
        """
        seq_len = seq_len or self.cfg.max_seq_len
        matmul_params = self._non_embedding_params + self.cfg.vocab_size * self.cfg.dim
        return 6.0 * matmul_params + 12.0 * self.cfg.n_layers * self.cfg.dim * seq_len

    def flops_per_batch(self, batch_size: int, seq_len: int) -> float:
        return self.flops_per_token(seq_len) * batch_size * seq_len

    # --- deterministic initialisation --------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from (seed, its name) alone: see ``init_parameter_``."""
        self.tie_weights()
        self.init_seed = seed
        for name, param in self.named_parameters():
            init_parameter_(name, param, seed, self.cfg)

    def reset_parameters(self) -> None:
        """Re-run ``init_weights`` with the seed of the last init (the constructor's by default).

        Only the whole model resets this way: the ``reset_parameters`` of child ``nn.Linear`` /
        ``nn.Embedding`` modules are torch's defaults, so per-module FSDP materialisation must use
        ``param_init_fn`` instead.
        """
        self.init_weights(self.init_seed)

    @torch.no_grad()
    def param_init_fn(self, module: nn.Module) -> None:
        """Initialise the parameters ``module`` holds directly (not its children), by full name.

        The hook Composer's FSDP calls on each submodule after ``to_empty(recurse=False)``; the result
        equals ``init_weights(self.init_seed)`` on an ordinary model.
        """
        prefix = _module_name(self, module)
        for local_name, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local_name}" if prefix else local_name
            init_parameter_(name, param, self.init_seed, self.cfg)


def _module_name(root: nn.Module, module: nn.Module) -> str:
    """``module``'s dotted name in ``root``, ignoring FSDP / checkpoint / compile wrapper levels."""
    wrappers = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
    for name, candidate in root.named_modules():
        if candidate is module:
            return ".".join(part for part in name.split(".") if part not in wrappers)
    raise ValueError(f"module {type(module).__name__} is not part of this Transformer")


def _param_seed(seed: int, name: str) -> int:
    # A stable hash (Python's hash() is salted per process) so every rank and run agrees.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std_for(name: str, cfg: ModelConfig) -> float | None:
    """The normal std for parameter ``name``; None for norm weights and biases (ones, zeros)."""
    if name.endswith(("norm.weight", ".bias")):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        # Residual-branch outputs: each of the 2 * n_layers branches adds variance to the stream.
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


@torch.no_grad()
def init_parameter_(name: str, tensor: Tensor, seed: int, cfg: ModelConfig) -> None:
    """Fill ``tensor`` in place with the initial value of parameter ``name`` for ``seed``.

    The value depends only on (seed, name, shape, cfg): it is drawn on the CPU from a generator
    seeded by a hash of seed and name, then copied to the tensor's device and dtype. So a model
    initialised on the meta device later, on another device, or in another order gets the same
    weights. A DTensor (FSDP2 shard) receives its own slice of the same full tensor.
    ``output.weight`` of a tied model is drawn as ``tok_embeddings.weight``.
    """
    if cfg.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"
    std = init_std_for(name, cfg)
    if std is None:
        full = torch.zeros(tensor.shape) if name.endswith(".bias") else torch.ones(tensor.shape)
    else:
        generator = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
        full = torch.empty(tensor.shape).normal_(0.0, std, generator=generator)
    _copy_full_into(tensor, full)


def _copy_full_into(tensor: Tensor, full: Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        # Every rank computed the same full tensor, so each can cut its shard without communication.
        full = distribute_tensor(
            full.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None
        )
    tensor.copy_(full)


# --- attention masks and the KV cache ----------------------------------------------------------
def causal_padding_mask(key_valid: Tensor, start: int) -> Tensor:
    """Boolean mask ``[B, 1, T, S]``: query ``i`` (at position ``start + i``) may see key ``j`` iff
    ``j <= start + i`` and key ``j`` is not padding. Each query always sees itself, so a padding
    query has one finite score instead of a row of -inf (which would make SDPA return NaN)."""
    bsz, total = key_valid.shape
    seqlen = total - start
    key_pos = torch.arange(total, device=key_valid.device)[None, :]
    query_pos = torch.arange(start, total, device=key_valid.device)[:, None]
    allowed = (key_pos <= query_pos)[None] & key_valid[:, None, :]
    allowed |= (key_pos == query_pos)[None]
    return allowed.view(bsz, 1, seqlen, total)


# --- documents in a packed sequence ------------------------------------------------------------

FLEX_TILE = 128  # FlexAttention's default block size: its block mask says which 128 x 128 tiles to visit


def document_mask(documents: Tensor, kernel: str = "auto") -> Tensor | BlockMask:
    """The mask that lets a token see only earlier tokens of its own document, for ``documents
    [B, T]`` (ids that never decrease along a row). ``kernel``: "flex", a FlexAttention
    ``BlockMask``; "sdpa", a boolean ``[B, 1, T, T]`` for ``scaled_dot_product_attention``; "auto",
    flex on CUDA and sdpa elsewhere."""
    if kernel == "auto":
        kernel = "flex" if documents.is_cuda else "sdpa"
    if kernel == "flex":
        return document_block_mask(documents)
    if kernel != "sdpa":
        raise ValueError(f"document kernel {kernel!r} is not one of auto, flex, sdpa")
    index = torch.arange(documents.shape[1], device=documents.device)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & (index[None, :] <= index[:, None])[None])[:, None]


def document_positions(documents: Tensor) -> Tensor:
    """Rotary positions ``[B, T]`` counted from the first token of each token's document."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index[None], torch.zeros_like(index)[None]).cummax(dim=1).values
    return index[None] - first


def _padded_documents(documents: Tensor, length: int) -> Tensor:
    """``documents`` padded to ``length`` with one more document: the padding sees only itself."""
    pad = length - documents.shape[1]
    return torch.cat([documents, (documents[:, -1:] + 1).expand(-1, pad)], dim=1)


def document_tiles(documents: Tensor, tile: int = FLEX_TILE) -> tuple[Tensor, Tensor]:
    """Which ``tile x tile`` tiles of the attention matrix the document mask touches, as
    ``(partial, full)``, each ``[B, n, n]`` bool (query tile, key tile; n = ceil(T / tile)): a full
    tile is all visible (no mask applied), a partial one is visited with the mask, the rest skipped.

    Computed from each tile's first and last document alone (ids never decrease), in O(B n^2),
    instead of evaluating the mask over all T x T pairs as ``create_block_mask`` does; the tests
    check that both agree."""
    bsz, length = documents.shape
    n = -(-length // tile)
    ends = _padded_documents(documents, n * tile).view(bsz, n, tile)
    first, last = ends[..., 0], ends[..., -1]  # [B, n]
    index = torch.arange(n, device=documents.device)
    before = (index[None, :] < index[:, None])[None]  # key tile j before query tile i
    # A key tile before the query tile shares a document with it iff its last document is the
    # query tile's first; it is all visible iff both tiles lie inside one document.
    touches = before & (last[:, None, :] == first[:, :, None])
    full = before & (first[:, None, :] == last[:, :, None])
    diagonal = torch.eye(n, dtype=torch.bool, device=documents.device)[None]
    return (touches & ~full) | diagonal, full


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, n, n]`` tiles as FlexAttention stores them: per query tile the number of key tiles
    and their indices first (one head dimension of size 1: every head shares the mask)."""
    tiles = tiles[:, None].to(torch.int8)
    count = tiles.sum(dim=-1, dtype=torch.int32)
    columns = torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), columns.contiguous()


def _same_document(padded: Tensor):
    """FlexAttention's mask_mod for the tiles that need one: the same document, not in the future."""

    def same_document(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (padded[batch, q] == padded[batch, kv]) & (kv <= q)

    return same_document


def document_block_mask(documents: Tensor, tile: int = FLEX_TILE) -> BlockMask:
    """The FlexAttention ``BlockMask`` of ``documents [B, T]`` (see ``document_tiles``)."""
    from torch.nn.attention.flex_attention import BlockMask  # imports torch._dynamo: ~3 s

    length = documents.shape[1]
    partial, full = document_tiles(documents, tile)
    padded = _padded_documents(documents, partial.shape[-1] * tile)
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=tile, mask_mod=_same_document(padded),
        seq_lengths=(length, length),
    )  # fmt: skip


_COMPILED_FLEX: list = []  # torch.compile(flex_attention), made on first use on a GPU


def flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """FlexAttention over a block mask: compiled on CUDA (its Triton kernel; eager it computes every
    score), eager elsewhere (the reference the tests compare with).

    Called outside any torch dispatch mode: the selective checkpointing policy runs its block
    under one, where torch 2.7 has no rule for FlexAttention's operator ("no rule registered for
    HOP flex_attention") and torch.compile does not compile. Hidden from the policy, the attention
    is recomputed in backward like the rest of the block instead of kept."""
    from torch.nn.attention import flex_attention as flex
    from torch.utils._python_dispatch import _disable_current_modes

    if torch.compiler.is_compiling():  # inside a compiled block: traced with it
        return flex.flex_attention(q, k, v, block_mask=block_mask)
    if q.is_cuda and not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex.flex_attention, dynamic=False))
    kernel = _COMPILED_FLEX[0] if q.is_cuda else flex.flex_attention
    with _disable_current_modes():
        return kernel(q, k, v, block_mask=block_mask)


class KVCache:
    """Keys and values of past positions, preallocated per layer as ``[B, n_kv_heads, max_len, hd]``.

    ``pos`` is the number of positions filled; ``Transformer.forward`` writes each layer's new
    keys/values at ``pos`` and advances it after the last layer. ``valid [B, max_len]`` records
    which positions were padding (from ``attention_mask``). Keys are stored after rotation.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0
        self.valid.fill_(True)

    def attention_mask(self, seqlen: int, attention_mask: Tensor | None) -> Tensor:
        """Record this call's padding and return the mask over all cached keys so far."""
        end = self.pos + seqlen
        if end > self.max_len:
            raise ValueError(
                f"KV cache is full: {self.pos} cached + {seqlen} new positions > max_len "
                f"{self.max_len}; create the cache with a larger max_len"
            )
        if attention_mask is not None:
            self.valid[:, self.pos : end] = attention_mask.to(self.valid.device).bool()
        else:
            self.valid[:, self.pos : end] = True
        return causal_padding_mask(self.valid[:, :end], start=self.pos)

    def update(self, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v [B, KV, T, hd]`` at ``pos``; return the keys/values of all positions so far."""
        end = self.pos + k.shape[2]
        self.k[layer_id][:, :, self.pos : end] = k
        self.v[layer_id][:, :, self.pos : end] = v
        return self.k[layer_id][:, :, :end], self.v[layer_id][:, :, :end]


@dataclass(frozen=True)
class ParamCounts:
    total: int
    block: int
    root: int
    largest: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Parameter counts of `cfg`'s model from a meta-device build (nothing allocated): the whole, one
    block, the rest (embeddings, final norm, output), the largest single tensor."""
    with torch.device("meta"):
        model = Transformer(cfg)
    total = model.num_params()
    block = sum(p.numel() for p in model.layers[0].parameters())
    largest = max(p.numel() for p in model.parameters())
    return ParamCounts(total=total, block=block, root=total - cfg.n_layers * block, largest=largest)


# Our parameter names start with one of these. A checkpoint's keys may carry wrapper levels
# (torch.compile, DDP, FSDP, activation checkpointing) and the ComposerModel's `model.` before them.
ROOT_NAMES = ("tok_embeddings.", "layers.", "norm.", "output.")
WRAPPER_LEVELS = {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def parameter_name(key: str) -> str | None:
    """Our name for a state-dict key such as `model._orig_mod.layers.0.attention.wq.weight`, or
    None when it names none of ours: wrapper levels are removed wherever they sit, then leading
    attribute names (the ComposerModel's `model.`) up to one of ours."""
    name = ".".join(p for p in key.split(".") if p not in WRAPPER_LEVELS)
    while name and not name.startswith(ROOT_NAMES) and "." in name:
        name = name.split(".", 1)[1]
    return name if name.startswith(ROOT_NAMES) else None
