"""What a training process does to reach its first step sooner (docs/resume.md, "Restart cost").

A restart is mostly the new process's own start: the interpreter and the imports of torch,
Composer and streaming, then Composer's Trainer. Two costs there are not the work itself:

- **The garbage collector during the start.** Importing torch, Composer, transformers and scipy
  (Composer's torchmetrics imports the last two) makes millions of objects, and the cyclic
  collector walks the growing heap again and again while they are made: `import llm.trainer`
  took 4.56 s with it on and 3.62 s with it off here (median of 4, 2 cores). `begin()` turns it off
  for the start of a process that is train.py's own (`owns_process`); `settled()`, at the first
  training step, turns it back on. Nothing else changes: objects are freed by their reference
  counts as before, and a collection only frees cycles later. (Freezing the start's objects there,
  `gc.freeze`, was tried: a preempted run's fast exit must then unfreeze a million objects to find
  streaming's shared memory, and in CI such exits twice printed a warning below their last line.)
- **Composer's CPU name.** The Trainer records the CPU's name (`composer.utils.collect_env
  .get_cpu_model`, for its hyperparameters and every checkpoint's metadata) through py-cpuinfo,
  which starts a second Python interpreter to ask: 1.1 s on an idle core here, 2-3 s on a loaded
  one, at every start. `quick_cpu_model()` answers from /proc/cpuinfo's "model name" (what
  py-cpuinfo reports on Linux too); where there is none, Composer's own lookup stays.

Imports are otherwise deferred where they can be: `python -X importtime -c "import llm.trainer"`
puts 7.9 of its 10.1 s in `import composer` (torchmetrics 4.1 s of it, pulling in transformers,
scipy and scikit-learn, which no metric of ours uses, but which it probes for with package
metadata, so they cannot be hidden without breaking its own imports) and 0.2 s in this project's
modules; train.py imports nothing heavy before it knows it will train.
"""

from __future__ import annotations

import gc

_held = False  # the collector was turned off by `begin`


def begin() -> None:
    """The process's start (before the heavy imports): the cyclic collector off until `settled`.
    Only for a process that is a training command's own."""
    global _held
    if not gc.isenabled():
        return
    gc.disable()
    _held = True


def settled() -> None:
    """The first training step is done: turn the collector back on."""
    global _held
    if not _held:
        return
    _held = False
    gc.enable()


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's name as Linux gives it (the first "model name"), or None."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


def quick_cpu_model() -> None:
    """Composer's CPU-name lookup answered from /proc/cpuinfo (module docstring); kept where it has none."""
    from composer.utils import collect_env

    if getattr(collect_env.get_cpu_model, "quick", False):
        return
    name = cpu_model_name()
    if name is None:
        return

    def get_cpu_model() -> str:
        return name

    get_cpu_model.quick = True  # type: ignore[attr-defined]
    collect_env.get_cpu_model = get_cpu_model
