"""A run leaves nothing temporary behind: the S3 staging folder of its checkpoints goes at exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BUILD_SAVER = """
from pathlib import Path
from llm.config import load_config
from llm.checkpoint.plan import _saving_callbacks
cfg = load_config(Path("recipes/demo.yaml"), ["checkpoint.save_folder=s3://bucket/run"])
saver, publisher = _saving_callbacks(cfg, 0, records=None)
print(saver.folder)
"""


def test_the_staging_folder_of_a_remote_save_folder_is_removed_when_the_process_ends():
    done = subprocess.run(
        [sys.executable, "-c", BUILD_SAVER], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    staging = Path(done.stdout.strip().splitlines()[-1])
    assert staging.name.startswith("llm-ckpt-rank0-")
    assert not staging.exists(), f"{staging} was left in the temp directory"
