"""The one entry point of checkpointing: `plan_checkpointing(cfg, ...)`, called before the Trainer.

It decides where training starts (`llm.checkpoint.resume`) and builds the callbacks that save,
publish and handle preemption, in the only order that works:

  CheckpointSaver (Composer) -> CheckpointPublisher -> PreemptionCallback (last of all)

The publisher stores what the saver just wrote, at the same event, so it must follow it; the
preemption callback exits the process at `fit_end`, so every other callback must have run
before it. `CheckpointPlan.callbacks_after(others)` is the only way the trainer adds them, and
both callbacks check their place again when the Trainer is built (Composer's Event.INIT), so a
wrong order fails at once instead of at the first save or the first SIGTERM.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm.checkpoint.resume import (
    ResumePoint,
    announce,
    check_load_path_allowed,
    choose_resume_point,
    remove_stale_composer_copy,
    stop_if_complete,
    warn_recipe_changes,
)
from llm.config import TrainConfig
from llm.errors import ConfigError
from storage import open_store

CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"


@dataclass(frozen=True)
class CheckpointPlan:
    """Where to start, the Trainer arguments that say so, and the checkpointing callbacks in order."""

    resume: ResumePoint
    trainer_kwargs: dict[str, Any]
    callbacks: tuple  # (CheckpointSaver, CheckpointPublisher)? + (PreemptionCallback,)

    def callbacks_after(self, others: Sequence) -> list:
        """`others` followed by this plan's callbacks; refuses checkpointing callbacks in `others`."""
        from composer.callbacks import CheckpointSaver

        from llm.checkpoint.preemption import PreemptionCallback
        from llm.checkpoint.publisher import CheckpointPublisher

        ours = (CheckpointSaver, CheckpointPublisher, PreemptionCallback)
        stray = [type(cb).__name__ for cb in others if isinstance(cb, ours)]
        if stray:
            raise ValueError(f"{', '.join(stray)} must come from plan_checkpointing, not the callback list")
        return [*others, *self.callbacks]


def plan_checkpointing(cfg: TrainConfig, *, rank: int, world_size: int) -> CheckpointPlan:
    """Check the checkpoint settings, choose the resume point and build the callbacks (every rank).

    - `checkpoint.num_to_keep` and the load-path safety rule (ConfigError: a `load_path` outside
      `save_folder` needs `checkpoint.allow_untrusted_load_path: true`, because Composer 0.32.1
      unpickles checkpoints);
    - deletes the stale `./s3:/<bucket>/...` copy Composer's autoresume leaves in the working
      directory, so it can never shadow a newer remote checkpoint;
    - with autoresume (on when `run_name` and `save_folder` are set) takes the newest complete
      checkpoint that verifies (`newest_usable_checkpoint`), else `checkpoint.load_path`, and says
      which; raises RunAlreadyComplete when that checkpoint already reached max_duration;
    - warns about every recipe value that differs from the checkpoint's recipe (docs/resume.md).
    """
    from llm.checkpoint.preemption import PreemptionCallback

    ck = cfg.checkpoint
    if ck.num_to_keep == 0 or ck.num_to_keep < -1:
        raise ConfigError(
            f"checkpoint.num_to_keep={ck.num_to_keep}: keep at least 1 checkpoint, or -1 for all"
        )
    check_load_path_allowed(cfg)
    if ck.save_folder:
        remove_stale_composer_copy(ck.save_folder)
    point = choose_resume_point(cfg, rank=rank)
    if rank == 0:
        announce(cfg, point, world_size)
    stop_if_complete(cfg, point)
    if point.checkpoint is not None and point.checkpoint.recipe and rank == 0:
        warn_recipe_changes(point.checkpoint.recipe, cfg.to_dict(redact=True))

    kwargs: dict[str, Any] = {
        "save_folder": None,  # saving is done by the saver below, not by Composer's own
        "autoresume": False,  # the resume point above replaces Composer's autoresume
        "save_overwrite": True,
        "load_path": point.load_path,
        "load_weights_only": point.weights_only,
    }
    callbacks = (
        (*_saving_callbacks(cfg, rank), PreemptionCallback()) if ck.save_folder else (PreemptionCallback(),)
    )
    return CheckpointPlan(resume=point, trainer_kwargs=kwargs, callbacks=callbacks)


def _saving_callbacks(cfg: TrainConfig, rank: int) -> tuple:
    from composer.callbacks import CheckpointSaver

    from llm.checkpoint.publisher import CheckpointPublisher

    ck = cfg.checkpoint
    store = open_store(ck.save_folder)
    # Remote: Composer writes into a private staging folder that the publisher uploads and empties.
    staging = tempfile.mkdtemp(prefix=f"llm-ckpt-rank{rank}-") if store.is_remote else ck.save_folder
    saver = CheckpointSaver(
        folder=staging,
        filename=CHECKPOINT_FILENAME,
        remote_file_name=None,
        latest_filename=None,
        latest_remote_file_name=None,
        save_interval=ck.save_interval,
        overwrite=True,
        num_checkpoints_to_keep=-1,  # the publisher keeps num_to_keep across runs, not per process
    )
    publisher = CheckpointPublisher(store, staging, ck.num_to_keep, recipe=cfg.to_dict(redact=True))
    return saver, publisher
