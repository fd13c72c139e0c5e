"""Prompt/answer pairs -> SFT shards with a loss mask: `python -m convert sft`.

    read records (JSON list, JSON lines or CSV; local or s3://; convert/sft/pairs.py) -> clean
    both texts (the shards' cleaner: controls, Unicode form, whitespace) -> length rules in
    characters -> exact duplicates -> tokenize -> fit the sequence (truncate, or drop with
    --drop-truncated) -> render with the chat template (shards/chat_template.py) -> train/val by
    the pair's digest -> pack whole examples into samples -> MDS shards, meta.json, summary.json,
    index.json last.

Each sample holds `seq_len` values in three columns (shards/FORMAT.md): `tokens`; `loss_mask`,
1 on every token the model must learn to write (the template's answer parts: the answer and its
closing EOS), 0 on the prompt parts and on padding; `segments`, the example each token belongs
to (1, 2, ... within the sample; 0 = padding). The trainer predicts `tokens[1:]` and counts the
loss only where `loss_mask[1:]` is 1, so nothing trains `EOS -> padding`, and the mask, not a
token id, says what is padding (baby-llama2-chinese's `ignore_index=0` also ignored every real
id 0).

Packing (the default; `--no-pack` puts one example per sample, as baby-llama2-chinese does):
examples are placed whole, in input order, into the current sample while they fit, and the rest
of a sample is padding. The trainer lets each token attend only to earlier tokens of its own
segment and restarts the rotary positions at each segment, so a packed example is computed, and
scored, exactly as it would be alone. The summary and meta.json report the padding share.

Fitting: a sample has `seq_len` tokens, of which the template's fixed parts take F; the prompt
and the answer share the rest, R = seq_len - F. A pair longer than that keeps the start of
each: the prompt keeps at most `--max-prompt-tokens` (default: whatever leaves the answer room,
but never less than R // 2) and the answer the rest. So the sample never outgrows `seq_len`
(baby-llama2-chinese's pad length went negative with both at their maximum) and the answer
always ends with its EOS.

Records without the prompt or the answer field are malformed (convert/sft/pairs.py: counted,
with file:line, or refused with --strict); empty texts and length-rule misses are dropped, each
counted by reason.
A run where no record has the fields, a CSV whose header lacks them, or a template that does not
fit `seq_len` is refused in one line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from convert.errors import ConvertError
from convert.filters.cleaning import Cleaner, DropCounts, text_digest
from convert.reading.readers import ReadStats
from convert.reading.sources import expand_inputs, refuse_output_among_inputs
from convert.records import in_val
from convert.run.report import progress_bar
from convert.sft.pairs import Pair, SftLayout, read_pairs
from shards.chat_template import DEFAULT_TEMPLATE, ChatTemplate, TemplateRenderer, read_template
from shards.meta import SFT, SFT_COLUMNS, SPLITS, SplitMeta, now, write_meta
from shards.output import open_output, prepare_output
from shards.tokenizer import Tokenizer, TokenizerInfo
from shards.writer import ShardWriter, index_json
from storage import Store

MAX_SEGMENTS = (1 << 16) - 1
PAD_ID = 0  # any id: padding is never attended to by real tokens nor scored (the mask says so)
_BATCH = 2048  # pairs tokenized together (SentencePiece encodes a list in one call)
_ROWS_PER_WRITE = 1024


# --- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SftOptions:
    seq_len: int = 512
    template: str = DEFAULT_TEMPLATE  # a built-in template's name or a JSON file
    pack: bool = True
    val_fraction: float = 0.01
    # baby-llama2-chinese's data rules, in characters; None: no limit
    min_prompt_chars: int = 10
    min_answer_chars: int = 5
    max_prompt_chars: int | None = 256
    max_answer_chars: int | None = 256
    max_prompt_tokens: int | None = None  # None: see the module docstring ("Fitting")
    drop_truncated: bool = False
    normalization: str = "NFKC"
    dedup: bool = True
    strict: bool = False
    dtype: str = "auto"
    shard_size_mb: float = 64.0
    overwrite: bool = False
    progress: bool = True

    @property
    def size_limit(self) -> int:
        return int(self.shard_size_mb * (1 << 20))

    def check(self) -> None:
        if self.seq_len < 3:
            raise ConvertError(f"--seq-len {self.seq_len} must be at least 3")
        if not 0 <= self.val_fraction < 1:
            raise ConvertError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        for name in ("min_prompt_chars", "min_answer_chars", "max_prompt_chars", "max_answer_chars"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConvertError(f"--{name.replace('_', '-')} {value} must be 0 or more")
        if self.shard_size_mb <= 0:
            raise ConvertError(f"--shard-size-mb {self.shard_size_mb} must be positive")


# --- examples ---------------------------------------------------------------------------------


class Fitter:
    """Cuts a tokenized pair to the room the template leaves in a sample (module docstring)."""

    def __init__(self, room: int, max_prompt_tokens: int | None) -> None:
        self.room, self.max_prompt = room, max_prompt_tokens

    def fit(self, prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
        if self.max_prompt is not None:
            prompt = prompt[: self.max_prompt]
        if len(prompt) + len(answer) <= self.room:
            return prompt, answer
        keep_prompt = min(len(prompt), max(self.room // 2, self.room - len(answer)))
        return prompt[:keep_prompt], answer[: self.room - keep_prompt]


@dataclass
class SplitTotals:
    """What one split received: its shard entries, examples, samples, answer and padding tokens."""

    shards: list[dict] = field(default_factory=list)
    examples: int = 0
    samples: int = 0
    target_tokens: int = 0
    padding_tokens: int = 0

    def summary(self, seq_len: int) -> SftSplitSummary:
        tokens = self.samples * seq_len
        return SftSplitSummary(
            examples=self.examples, samples=self.samples, tokens=tokens, target_tokens=self.target_tokens,
            padding_tokens=self.padding_tokens,
            padding_share=round(self.padding_tokens / tokens, 4) if tokens else 0.0, shards=len(self.shards),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SftSplitSummary:
    """One split in an SFT conversion's summary.json."""

    examples: int
    samples: int
    tokens: int
    target_tokens: int  # tokens the loss counts (the answers and their EOS)
    padding_tokens: int
    padding_share: float
    shards: int


@dataclass(frozen=True, kw_only=True)
class SftSummary:
    """What an SFT conversion read, dropped, cut and wrote: summary.json, printed at the end, and
    what `convert_sft` returns."""

    out: str
    read: dict  # `ReadStats.as_dict`
    dropped: dict[str, int]  # pairs by reason
    truncated: dict[str, int]  # prompts and answers cut to fit
    splits: dict[str, SftSplitSummary]
    seq_len: int
    packed: bool
    chat_template: str  # its name
    options: SftOptions
    elapsed_s: float

    def to_json(self) -> dict:
        return {
            "out": self.out,
            "kind": SFT,
            "read": self.read,
            "dropped": self.dropped,
            "truncated": self.truncated,
            "splits": {name: asdict(split) for name, split in self.splits.items()},
            "seq_len": self.seq_len,
            "packed": self.packed,
            "chat_template": self.chat_template,
            "options": asdict(self.options),
            "elapsed_s": self.elapsed_s,
        }


class SamplePacker:
    """Whole examples into samples of `seq_len` (several per sample when packing), written as rows
    of the three columns."""

    def __init__(self, writer: ShardWriter, seq_len: int, pack: bool, totals: SplitTotals) -> None:
        self.writer, self.seq_len, self.pack, self.totals = writer, seq_len, pack, totals
        self._tokens: list[int] = []
        self._mask: list[int] = []
        self._segments: list[int] = []
        self._rows: list[tuple[list[int], list[int], list[int]]] = []

    def add(self, prompt: list[int], answer: list[int]) -> None:
        """One rendered example: its prompt part ids and answer part ids (together <= seq_len)."""
        length = len(prompt) + len(answer)
        segment = (self._segments[-1] if self._segments else 0) + 1
        room = self.seq_len - len(self._tokens)
        if self._tokens and (not self.pack or length > room or segment > MAX_SEGMENTS):
            self._close_sample()
            segment = 1
        self._tokens += prompt + answer
        self._mask += [0] * len(prompt) + [1] * len(answer)
        self._segments += [segment] * length
        self.totals.examples += 1
        self.totals.target_tokens += len(answer)

    def finish(self) -> list[dict]:
        if self._tokens:
            self._close_sample()
        self._write_rows()
        return self.writer.finish()

    def _close_sample(self) -> None:
        pad = self.seq_len - len(self._tokens)
        self._rows.append((self._tokens + [PAD_ID] * pad, self._mask + [0] * pad, self._segments + [0] * pad))
        self.totals.samples += 1
        self.totals.padding_tokens += pad
        self._tokens, self._mask, self._segments = [], [], []
        if len(self._rows) >= _ROWS_PER_WRITE:
            self._write_rows()

    def _write_rows(self) -> None:
        if not self._rows:
            return
        tokens, mask, segments = (
            np.array(column, dtype=np.uint32) for column in zip(*self._rows, strict=True)
        )
        self.writer.write({"tokens": tokens, "loss_mask": mask, "segments": segments})
        self._rows = []


# --- the conversion ---------------------------------------------------------------------------


@dataclass
class Counts:
    """What was read, dropped and cut, over all splits."""

    read: ReadStats = field(default_factory=ReadStats)
    dropped: DropCounts = field(default_factory=DropCounts)
    truncated_prompts: int = 0
    truncated_answers: int = 0

    def dropped_dict(self) -> dict[str, int]:
        malformed = {"malformed": self.read.malformed} if self.read.malformed else {}
        return {**self.dropped.as_dict(), **malformed}

    def truncated(self) -> dict[str, int]:
        return {"prompts": self.truncated_prompts, "answers": self.truncated_answers}


def convert_sft(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    layout: SftLayout = SftLayout(),
    options: SftOptions = SftOptions(),
    command: str = "",
) -> SftSummary:
    """Convert prompt/answer records into `out`/train and `out`/val; returns the summary."""
    start = time.monotonic()
    options.check()
    job = Job.prepare(tokenizer, options)
    paths = expand_inputs(inputs)
    refuse_output_among_inputs(inputs, out)
    store = open_output(out)
    # Not resumable: a rerun clears both splits (index.json first, so an interrupted run is never
    # taken for complete).
    prepare_output(store, overwrite=options.overwrite, resume=False, files=("summary.json",))
    counts = Counts()
    totals = {split: SplitTotals() for split in SPLITS}
    packers = {split: job.packer(store, split, totals[split]) for split in SPLITS}
    pairs = read_pairs(paths, layout, strict=options.strict, stats=counts.read)
    with progress_bar(None, "pair", "sft", enabled=options.progress) as bar:
        for batch in _batches(_selected(pairs, options, counts.dropped), _BATCH):
            job.add(batch, packers, counts)
            bar.update(len(batch))
    if totals["train"].examples == 0:
        raise _nothing_kept(paths, counts)
    for split in SPLITS:
        totals[split].shards = packers[split].finish()
    for split in SPLITS:
        write_meta(store, job.meta(split, totals[split], counts, command))
    summary = SftSummary(
        out=store.url(),
        read=counts.read.as_dict(),
        dropped=counts.dropped_dict(),
        truncated=counts.truncated(),
        splits={split: totals[split].summary(options.seq_len) for split in SPLITS},
        seq_len=options.seq_len,
        packed=options.pack,
        chat_template=job.template.name,
        options=options,
        elapsed_s=round(time.monotonic() - start, 3),
    )
    store.write_json("summary.json", summary.to_json())
    for split in ("val", "train"):  # last: an index.json marks its split complete
        store.write_json(f"{split}/index.json", index_json(totals[split].shards))
    print_summary(summary, sys.stdout)
    return summary


@dataclass
class Job:
    """What one conversion tokenizes and writes with: the template, the tokenizer, the room."""

    options: SftOptions
    template: ChatTemplate
    info: TokenizerInfo
    tokenizer: Tokenizer
    renderer: TemplateRenderer
    fitter: Fitter
    dtype: str

    @classmethod
    def prepare(cls, tokenizer: str, options: SftOptions) -> Job:
        """Load the template and the tokenizer; ConvertError if the template leaves no room."""
        template = read_template(options.template).normalized(options.normalization)
        loaded = Tokenizer(tokenizer)
        info = loaded.info()
        renderer = TemplateRenderer(template, loaded)
        room = options.seq_len - renderer.fixed_tokens
        if room < 2:
            raise ConvertError(
                f"the chat template {template.name!r} takes {renderer.fixed_tokens} tokens of every sample, "
                f"so --seq-len {options.seq_len} leaves {room} for the prompt and the answer; raise --seq-len"
            )
        if options.max_prompt_tokens is not None and not 1 <= options.max_prompt_tokens < room:
            raise ConvertError(
                f"--max-prompt-tokens {options.max_prompt_tokens} must be between 1 and {room - 1} (the "
                f"room --seq-len {options.seq_len} leaves besides the template and one answer token)"
            )
        fitter = Fitter(room, options.max_prompt_tokens)
        return cls(options, template, info, loaded, renderer, fitter, info.token_dtype(options.dtype))

    def packer(self, store: Store, split: str, totals: SplitTotals) -> SamplePacker:
        o = self.options
        writer = ShardWriter(store, split, seq_len=o.seq_len, dtype=self.dtype, size_limit=o.size_limit,
                             extra_columns=SFT_COLUMNS)  # fmt: skip
        return SamplePacker(writer, o.seq_len, o.pack, totals)

    def add(
        self, batch: list[tuple[str, str, bytes]], packers: dict[str, SamplePacker], counts: Counts
    ) -> None:
        """Tokenize a batch of selected pairs, fit, render and pack each into its split."""
        prompts = self.tokenizer.encode_batch([p for p, _, _ in batch])
        answers = self.tokenizer.encode_batch([a for _, a, _ in batch])
        for (_, _, digest), prompt, answer in zip(batch, prompts, answers, strict=True):
            kept_prompt, kept_answer = self.fitter.fit(prompt, answer)
            cut_prompt, cut_answer = len(kept_prompt) < len(prompt), len(kept_answer) < len(answer)
            if (cut_prompt or cut_answer) and self.options.drop_truncated:
                counts.dropped.add("too_long_tokens")
                continue
            counts.truncated_prompts += cut_prompt
            counts.truncated_answers += cut_answer
            split = "val" if in_val(digest, self.options.val_fraction)[0] else "train"
            packers[split].add(self.renderer.prompt_ids(kept_prompt), self.renderer.answer_ids(kept_answer))

    def meta(self, split: str, totals: SplitTotals, counts: Counts, command: str) -> SplitMeta:
        """The split's meta.json (shards/FORMAT.md, "SFT shards")."""
        info, s = self.info, totals.summary(self.options.seq_len)
        return SplitMeta(
            kind=SFT, split=split, seq_len=self.options.seq_len, dtype=self.dtype,
            columns={"tokens": self.dtype, **SFT_COLUMNS}, **info.meta_fields(), add_bos=False,
            chat_template=self.template.to_dict(), packed=self.options.pack, num_samples=s.samples,
            num_tokens=s.tokens, num_documents=s.examples, num_examples=s.examples,
            target_tokens=s.target_tokens, padding_tokens=s.padding_tokens,
            padding_share=s.padding_share, truncated=counts.truncated(), dropped=counts.dropped_dict(),
            created_at=now(), command=command,
        )  # fmt: skip


def _selected(
    pairs: Iterable[Pair], options: SftOptions, dropped: DropCounts
) -> Iterator[tuple[str, str, bytes]]:
    """Cleaned (prompt, answer, digest) of the pairs the character rules and de-duplication keep."""
    cleaner = Cleaner(normalization=options.normalization, min_chars=0, dedup=options.dedup)
    limits = (
        ("prompt", options.min_prompt_chars, options.max_prompt_chars),
        ("answer", options.min_answer_chars, options.max_answer_chars),
    )
    for pair in pairs:
        texts = (cleaner.normalize(pair.prompt), cleaner.normalize(pair.answer))
        reason = None
        for text, (role, least, most) in zip(texts, limits, strict=True):
            if not text:
                reason = f"empty_{role}"
            elif len(text) < least:
                reason = f"{role}_too_short"
            elif most is not None and len(text) > most:
                reason = f"{role}_too_long"
            if reason:
                break
        if reason:
            dropped.add(reason)
            continue
        digest = text_digest(f"{texts[0]}\x00{texts[1]}")
        if not cleaner.first_seen(digest):
            dropped.add("duplicate")
            continue
        yield texts[0], texts[1], digest


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _nothing_kept(paths: list[str], counts: Counts) -> ConvertError:
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    read = counts.read
    message = f"no prompt/answer pair to write from {shown}: {read.documents} read"
    if read.malformed_examples:
        source, line, reason = read.malformed_examples[0]
        message += f", {read.malformed} malformed (first at {source}:{line}: {reason})"
    if counts.dropped.total:
        message += f", dropped {counts.dropped.as_dict()}"
    return ConvertError(message + "; check the files, --preset or the field options, and the length rules")


def print_summary(summary: SftSummary, stream) -> None:
    read = summary.read
    lines = [f"converted SFT pairs into {summary.out} in {summary.elapsed_s:.1f} s"]
    lines.append(f"  records read: {read['documents']} from {read['files']} file(s)")
    if read["malformed"]:
        lines.append(f"  malformed records skipped: {read['malformed']}")
        for example in read["malformed_examples"][:5]:
            lines.append(f"    {example['source']}:{example['line']}: {example['reason']}")
    dropped = summary.dropped
    lines.append("  dropped: " + (", ".join(f"{k} {v}" for k, v in dropped.items()) if dropped else "none"))
    cut = summary.truncated
    lines.append(
        f"  truncated to fit {summary.seq_len} tokens: {cut['prompts']} prompts, {cut['answers']} answers"
    )
    how = "packed" if summary.packed else "one example per sample"
    for name, s in summary.splits.items():
        lines.append(
            f"  {name}: {s.examples} examples in {s.samples} samples x {summary.seq_len} ({how}), "
            f"{s.target_tokens} answer tokens, padding {s.padding_tokens} tokens "
            f"({100 * s.padding_share:.1f}%), {s.shards} shards"
        )
    lines.append(f"  chat template: {summary.chat_template}")
    stream.write("\n".join(lines) + "\n")
