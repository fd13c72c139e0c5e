"""Log-likelihood of each option's continuation given its prompt: batched, without a KV cache.

Tokens (the split lm-evaluation-harness makes, so both score the same ids): trailing whitespace of
the context moves to the front of each continuation; the context is encoded alone, the context plus
continuation together, and the continuation is what the second has beyond the first's length. The
context starts with the tokenizer's document-start token (EOS, after which every document of our
shards begins; see `Tokenizer.encode_prompt`).

Options that merge with the prompt's end: when an option tokenizes together with the prompt's last
token(s) (的 + 时间 -> 的时间), the context's own tokens are no prefix of context-plus-option's, and
the plain split would score nothing, or only part of the option (lm-eval 0.4.13's hf backend then
fails an assertion and stops; a 0.0 for the empty option would make it win). Here the boundary moves back to the last token the context shares with
every option's encoding, the same boundary for all options of the question: each option is scored
over the merged tokens (the prompt's tail and the option's text together), and all options keep
the same conditioning prefix. `Encoded.moved` counts the tokens moved back; `llm eval` reports how
many questions needed it, and how many of them had an option with no token of its own.

Shared-prompt scoring (the default) runs a question as ONE row: the prompt, then every option's
tokens but its last, each option at the positions it would have right after the prompt and seeing
the prompt and itself only (`Transformer.forward(positions=, attention_mask=[B, T, T])`). Every
option's first token is scored from the prompt's last position, so letter answers ("A".."D") cost
one pass over the prompt for all four. Unshared scoring runs one row per option, lm-eval's way;
both give the same log-likelihoods up to float rounding.

Too long for the model's context: a row keeps the last `max_seq_len + 1` tokens of prompt plus
continuation (the prompt is cut from the left, as lm-eval does), and the question is counted as
truncated. Its options then share a row only if they are all as long (letters): otherwise each
option gets its own row, keeping as much prompt as it can, exactly as lm-eval's rows do.

Distributed (DDP or FSDP): rank r takes every world_size-th batch; every rank runs the same number
of forward passes (a rank short of work repeats a batch and drops the result), since under FSDP each
pass gathers parameters from all ranks; one sum over ranks then gives everyone every score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from llm.errors import ConfigError
from llm.generate import PAD_ID


@dataclass(frozen=True)
class Encoded:
    """One question's token ids: the prompt, and one continuation per option."""

    context: list[int]
    continuations: list[list[int]]
    moved: int = 0  # prompt tokens scored with the options because an option merged with them
    emptied: bool = False  # some option had no token of its own after the prompt (fully merged)


def encode_question(
    tokenizer, context: str, continuations: Sequence[str], start_id: int | None, where: str = "a question"
) -> Encoded:
    """Token ids of a prompt and its continuations (see the module docstring for the split)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuations = [context[-spaces:] + c for c in continuations]
        context = context[:-spaces]
    prefix = [start_id] if start_id is not None else []
    context_ids = prefix + (tokenizer.encode(context) if context else [])
    wholes = [prefix + tokenizer.encode(context + text) for text in continuations]
    # The boundary: the context's tokens every whole encoding starts with, leaving each option >= 1 token.
    boundary = min(min(_shared(context_ids, w), len(w) - 1) for w in wholes)
    if boundary < 1:
        raise ConfigError(f"{where}: empty prompt, and the tokenizer has no EOS or BOS to start one")
    emptied = any(len(w) <= len(context_ids) for w in wholes)
    return Encoded(
        context_ids[:boundary], [w[boundary:] for w in wholes], len(context_ids) - boundary, emptied
    )


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of `a` and `b`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def is_truncated(question: Encoded, max_len: int) -> bool:
    """Whether some option needs the prompt cut to fit `max_len` input tokens."""
    return len(question.context) + max(map(len, question.continuations)) > max_len + 1


# --- rows: what one line of a batch holds ------------------------------------------------------


@dataclass
class Row:
    tokens: list[int]
    positions: list[int]
    segments: list[int]  # 0: the prompt; i + 1: option i's tokens (shared rows only)
    targets: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (slot, columns, ids)

    @property
    def packed(self) -> bool:
        return any(self.segments)


def shared_row(question: Encoded, first_slot: int) -> Row:
    """The prompt followed by every option but its last token, options blind to each other."""
    prompt = len(question.context)
    row = Row(list(question.context), list(range(prompt)), [0] * prompt)
    for i, cont in enumerate(question.continuations):
        start, body = len(row.tokens), cont[:-1]
        row.tokens += body
        row.positions += range(prompt, prompt + len(body))
        row.segments += [i + 1] * len(body)
        # The first token is predicted from the prompt's last position, the others from their own.
        row.targets.append((first_slot + i, [prompt - 1, *range(start, start + len(body))], cont))
    return row


def option_row(context: list[int], cont: list[int], slot: int, max_len: int) -> Row:
    """lm-eval's row: prompt + option, the last `max_len + 1` tokens of it, minus the last token."""
    seq = (context + cont)[-(max_len + 1) :]
    tokens = seq[:-1]
    n = len(tokens)
    return Row(tokens, list(range(n)), [0] * n, [(slot, list(range(n - len(cont), n)), cont)])


def plan_rows(questions: Sequence[Encoded], max_len: int, shared: bool) -> tuple[list[Row], int]:
    """Rows for all questions and the number of option slots (their options, in order)."""
    rows: list[Row] = []
    slot = 0
    for number, q in enumerate(questions):
        longest = max(map(len, q.continuations))
        if longest > max_len:
            raise ConfigError(
                f"question {number}: an option of {longest} tokens is longer than the model's context "
                f"of {max_len}; shorten the option"
            )
        if shared and (not is_truncated(q, max_len) or len(set(map(len, q.continuations))) == 1):
            # Options of one length (letters) keep the same prompt tail when cut: still one row.
            rows.append(shared_row(Encoded(q.context[-(max_len + 1 - longest) :], q.continuations), slot))
        else:
            rows += [option_row(q.context, c, slot + i, max_len) for i, c in enumerate(q.continuations)]
        slot += len(q.continuations)
    return rows, slot


def batches_of(rows: list[Row], batch_size: int) -> list[list[Row]]:
    """Longest rows first (less padding per batch; the slowest batch shows up first)."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].tokens), i))
    return [[rows[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]


# --- running ------------------------------------------------------------------------------------


def score(
    model: nn.Module,
    questions: Sequence[Encoded],
    *,
    max_len: int,
    batch_size: int = 8,
    shared: bool = True,
    rank: int = 0,
    world_size: int = 1,
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> list[list[float]]:
    """Per question, the log-likelihood of each option's continuation (fp32 logits, summed in fp64).

    `model` is a `Transformer` (possibly FSDP-wrapped); its train/eval mode is restored afterwards.
    With `world_size > 1`, `sum_over_ranks` must add a tensor over all ranks (an all-reduce).
    """
    if batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}")
    rows, slots = plan_rows(questions, max_len, shared)
    batches = batches_of(rows, batch_size)
    device = next(model.parameters()).device
    totals = torch.zeros(slots, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(math.ceil(len(batches) / world_size)):
                index = step * world_size + rank
                mine = index < len(batches)
                values, where = _forward(model, batches[index if mine else 0], device)
                if mine:
                    totals.index_add_(0, where, values)
    finally:
        model.train(was_training)
    if world_size > 1:
        if sum_over_ranks is None:
            raise ValueError("score() on several ranks needs sum_over_ranks")
        totals = sum_over_ranks(totals)
    flat = totals.tolist()
    out, start = [], 0
    for q in questions:
        out.append(flat[start : start + len(q.continuations)])
        start += len(q.continuations)
    return out


def _forward(model: nn.Module, rows: list[Row], device: torch.device) -> tuple[Tensor, Tensor]:
    """Log-probabilities of every target token of `rows` (fp64) and the option slot of each."""
    width = max(len(r.tokens) for r in rows)
    tokens = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: padding
    b_idx, c_idx, ids, slots = [], [], [], []
    for b, row in enumerate(rows):
        n = len(row.tokens)
        tokens[b, :n] = torch.tensor(row.tokens)
        positions[b, :n] = torch.tensor(row.positions)
        segments[b, :n] = torch.tensor(row.segments)
        for slot, columns, target in row.targets:
            b_idx += [b] * len(columns)
            c_idx += columns
            ids += target
            slots += [slot] * len(columns)
    kwargs = {}
    if any(r.packed for r in rows):
        # Right padding alone needs no mask (a causal query never sees the padding after it);
        # packed options need their positions and the options-blind-to-each-other mask.
        kwargs = {"positions": positions.to(device), "attention_mask": packed_mask(segments).to(device)}
    logits = model(tokens.to(device), **kwargs)
    picked = logits[torch.tensor(b_idx, device=device), torch.tensor(c_idx, device=device)].float()
    logprobs = torch.log_softmax(picked, dim=-1)
    values = logprobs.gather(1, torch.tensor(ids, device=device)[:, None]).squeeze(1)
    return values.double(), torch.tensor(slots, device=device)


def packed_mask(segments: Tensor) -> Tensor:
    """`[B, T, T]`: a query sees earlier keys of the prompt (segment 0) and of its own segment;
    padding (-1) is never seen; every query sees itself (no all-masked row, which gives NaN)."""
    width = segments.shape[1]
    query = torch.arange(width)[:, None]
    key = torch.arange(width)[None, :]
    seg_q, seg_k = segments[:, :, None], segments[:, None, :]
    allowed = (key <= query)[None] & (seg_k >= 0) & ((seg_k == 0) | (seg_k == seg_q))
    return allowed | torch.eye(width, dtype=torch.bool)[None]
