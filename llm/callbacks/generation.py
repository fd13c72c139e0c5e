"""Continue a few fixed prompts every N batches and at the end of training, so a run can be read.

Every rank runs the generation (under FSDP each forward pass gathers parameters from all ranks, so
all must take part in lockstep): the same prompts, the same seed, and the chosen tokens are
broadcast from rank 0 each step so no rank can stop earlier than another. Rank 0 writes the
samples to the console, to `<run_dir>/samples.jsonl` (one line per prompt: step, prompt, text),
and to the Composer loggers (a table, plus the seconds the call took).

Training is not changed: sampling draws from its own generator (the global RNG is untouched), the
model's train mode is restored, and nothing runs with gradients. Each call reuses the same seed,
so the samples of different steps differ only because the weights did. A run stopping on
SIGTERM/SIGINT skips the end-of-training samples: its checkpoint comes first.

In an SFT run (data.kind=sft) each prompt is put in the shards' chat template, as `llm chat`
puts it (`shards.chat_template`), so the samples show the model answering; otherwise a prompt starts
a document, as in the pretraining shards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist
from torch import Tensor, nn

from llm.checkpoint.preemption import stop_requested
from llm.config import GenerateCallbackConfig
from llm.data import chat_template_of
from llm.generate import generate
from llm.run_dir import RunDir
from llm.weights.keys import MODEL_CONFIG_KEY
from shards.chat_template import ChatTemplate
from shards.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class GenerationCallback(Callback):
    """Samples the recipe's `callbacks.generate` prompts (`settings`) with the run's tokenizer,
    written to `run_dir`'s samples.jsonl; `chat_template` puts each prompt in an SFT template."""

    def __init__(
        self,
        settings: GenerateCallbackConfig,
        tokenizer_path: str,
        run_dir: str | Path,
        chat_template: ChatTemplate | None = None,
    ):
        self.prompts = list(settings.prompts)
        self.chat_template = chat_template
        self.interval = settings.interval
        self.tokenizer_path = tokenizer_path
        self.samples_path = RunDir(run_dir).samples
        self.sampling = dict(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
        )
        self.seed = settings.seed
        self._should_run = create_interval_scheduler(
            settings.interval, include_end_of_training=False, checkpoint_events=False
        )
        self._tokenizer: Tokenizer | None = None
        self._prompt_ids: list[list[int]] = []
        self._model_config: dict | None = None
        self._last_step = -1
        self.last_seconds = 0.0

    # --- Composer events ----------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        model = transformer_of(state.model)
        self._tokenizer = Tokenizer(self.tokenizer_path)
        self._tokenizer.check_fits(model.cfg.vocab_size)
        template, tokenizer = self.chat_template, self._tokenizer
        self._prompt_ids = [
            template.prompt_ids(tokenizer, p) if template else tokenizer.encode_prompt(p)
            for p in self.prompts
        ]
        self._model_config = dataclasses.asdict(model.cfg)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._should_run(state, Event.BATCH_END):
            self.run(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._should_run(state, Event.EPOCH_END) and self._last_step != int(state.timestamp.batch):
            self.run(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if not self._prompt_ids or self._last_step == int(state.timestamp.batch):
            return
        if stop_requested(state):
            # Seconds of sampling would delay the preemption checkpoint (saved after fit_end
            # callbacks) inside the launcher's grace period; the resumed run samples later.
            log.info(
                "generation: skipped at batch %d, the run is stopping on a signal", int(state.timestamp.batch)
            )
            return
        self.run(state, logger)

    def state_dict(self) -> dict:
        # Recorded in every checkpoint so `llm generate`/`llm export` can rebuild the model alone.
        return {MODEL_CONFIG_KEY: self._model_config} if self._model_config else {}

    def load_state_dict(self, state: dict) -> None:
        pass  # nothing to restore: the schedule follows the training timestamp

    # --- the work --------------------------------------------------------------------------------

    def run(self, state: State, logger: Logger) -> list[str]:
        """Generate for every prompt now; returns the continuations (on every rank)."""
        from composer.core.precision import get_precision_context

        assert self._tokenizer is not None, "fit_start has not run"
        started = time.perf_counter()
        with get_precision_context(state.precision):
            outputs = generate(
                transformer_of(state.model),
                self._prompt_ids,
                eos_id=self._tokenizer.eos_id,
                seed=self.seed,
                sync_tokens=_from_rank_zero if dist.get_world_size() > 1 else None,
                **self.sampling,
            )
        texts = [self._tokenizer.decode(ids) for ids in outputs]
        self.last_seconds = time.perf_counter() - started
        self._last_step = int(state.timestamp.batch)
        if dist.get_global_rank() == 0:
            self._write(self._last_step, texts, logger)
        return texts

    def _write(self, step: int, texts: list[str], logger: Logger) -> None:
        rows = [{"step": step, "prompt": p, "text": t} for p, t in zip(self.prompts, texts, strict=True)]
        print(f"[generate] step {step} ({self.last_seconds:.1f} s)", flush=True)
        for row in rows:
            print(f"  {row['prompt']} | {row['text']}", flush=True)
        self.samples_path.parent.mkdir(parents=True, exist_ok=True)
        with self.samples_path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        table = [[step, p, t] for p, t in zip(self.prompts, texts, strict=True)]
        for destination in logger.destinations:
            _log_table(destination, table, step)
        logger.log_metrics({"generate/seconds": self.last_seconds}, step=step)


def _log_table(destination, table: list[list], step: int) -> None:
    """Send the samples table to one logger; the console already has them (printed above).

    Composer's console and several other destinations need pandas for tables, which this project
    does not install: such a destination is skipped rather than failing the training run.
    """
    from composer.loggers import ConsoleLogger

    if isinstance(destination, ConsoleLogger):
        return
    try:
        destination.log_table(["step", "prompt", "text"], table, name="samples", step=step)
    except ImportError:
        pass


def transformer_of(model: nn.Module) -> nn.Module:
    """The Transformer inside Composer's wrappers (DDP, compile), keeping an FSDP wrapper if any.

    Under FSDP the Transformer itself is the wrapped unit, so calling it gathers its shards; under
    DDP the inner module runs without the DDP hooks, which only matter for backward.
    """
    if hasattr(model, "module") and not hasattr(model, "model"):  # DistributedDataParallel
        model = model.module
    inner = model.model if hasattr(model, "model") else model
    return getattr(inner, "_orig_mod", inner)  # torch.compile: decode steps must not recompile


def _from_rank_zero(tokens: Tensor) -> Tensor:
    dist.broadcast(tokens, src=0)
    return tokens


def first_and_last_samples(path: str | Path) -> str:
    """The samples of the first and the last generation of a run, prompt by prompt, for the end
    of the run: how far the text came. "" when samples.jsonl has fewer than two generations."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and {"step", "prompt", "text"} <= row.keys():
            rows.append(row)
    steps = sorted({r["step"] for r in rows})
    if len(steps) < 2:
        return ""
    first, last = steps[0], steps[-1]
    width = len(str(last))
    out = [f"samples, first generation (step {first}) and last (step {last}):"]
    for prompt in dict.fromkeys(r["prompt"] for r in rows):
        out.append(f"  {prompt}")
        for step in (first, last):
            text = next((r["text"] for r in rows if r["step"] == step and r["prompt"] == prompt), "")
            out.append(f"    step {step:>{width}} | {' '.join(text.split())}")
    return "\n".join(out)


def generation_callbacks(ctx) -> list[Callback]:
    """For `llm.trainer.CALLBACK_BUILDERS`: the callback when the recipe enables it."""
    cfg = ctx.cfg
    if not cfg.callbacks.generate.enabled or not cfg.callbacks.generate.prompts:
        return []
    template = chat_template_of(cfg)
    return [
        GenerationCallback(cfg.callbacks.generate, cfg.tokenizer.path, cfg.run_dir, chat_template=template)
    ]
