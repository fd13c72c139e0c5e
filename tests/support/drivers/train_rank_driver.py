"""`composer -n 2 tests/support/drivers/train_rank_driver.py RECIPE [key=value ...]`: train.py's main, plus a log of
the samples each rank trained on (one SHA-1 per sample in `$SAMPLE_LOG_DIR/rank<r>.txt`)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from composer.core import Callback  # noqa: E402
from composer.utils import dist  # noqa: E402

import train  # noqa: E402


class SampleLog(Callback):
    def __init__(self, folder: Path):
        self.folder = folder

    def after_dataloader(self, state, logger):
        rows = state.batch["input_ids"].cpu().numpy()
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"rank{dist.get_global_rank()}.txt").open("a") as f:
            f.writelines(hashlib.sha1(row.tobytes()).hexdigest() + "\n" for row in rows)


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:], extra_callbacks=[SampleLog(Path(os.environ["SAMPLE_LOG_DIR"]))]))
