"""Weights & Biases: Composer's `WandBLogger`, continuing one W&B run across resumes.

The run id is made at the first start and kept in `trackers.json` (llm/loggers/tracker_ids.py): a
resumed run continues the same W&B run (`resume="allow"`). `mode: offline` writes the run under
`<dir>/wandb/` for a later `wandb sync`; W&B's own service buffers and retries when its server is
away. At the end the run's record files are saved with the W&B run.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from composer.loggers import WandBLogger

from llm.config import WandBConfig
from llm.loggers.tracker_ids import TrackerIds
from llm.run_dir import RECORD_FILES


class WandBTracker(WandBLogger):
    """Composer's WandBLogger, plus the run's record files saved with the W&B run at the end."""

    def __init__(self, run_dir: Path, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = run_dir

    def post_close(self) -> None:
        if self._enabled:
            import wandb

            if wandb.run is not None and not self._is_in_atexit:
                for name in RECORD_FILES:
                    if (self.record_dir / name).is_file():
                        wandb.save(str(self.record_dir / name), base_path=str(self.record_dir), policy="now")
        super().post_close()


def wandb_tracker(
    settings: WandBConfig, run_name: str, run_dir: Path, ids: TrackerIds, config: dict
) -> WandBTracker:
    run_id = ids.get("wandb_run_id") or uuid.uuid4().hex[:12]
    ids.set("wandb_run_id", run_id)
    init_kwargs: dict[str, Any] = {"id": run_id, "resume": "allow", "config": config}
    # Offline, W&B 0.18 asks the server's version before logging a table (the samples) unless
    # this is off: with no server it retries for minutes. Online runs never read the setting.
    init_kwargs["settings"] = {"allow_offline_artifacts": False}
    init_kwargs["dir"] = str(Path(settings.dir or run_dir))
    Path(init_kwargs["dir"]).mkdir(parents=True, exist_ok=True)
    if settings.mode:
        init_kwargs["mode"] = settings.mode
    return WandBTracker(
        run_dir,
        project=settings.project,
        entity=settings.entity,
        name=settings.name or run_name,
        tags=list(settings.tags) or None,
        init_kwargs=init_kwargs,
    )
