"""A run leaves nothing temporary behind: the S3 staging folder of its checkpoints goes at exit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support import forkserver, paths

pytestmark = pytest.mark.s3

REPO = paths.REPO

PLAN = """
import os
import sys
from pathlib import Path
from llm.config import load_config
from llm.checkpoint.plan import plan_checkpointing
cfg = load_config(Path("recipes/demo.yaml"), [f"checkpoint.save_folder=s3://{sys.argv[1]}/run"])
plan = plan_checkpointing(cfg, rank=0, world_size=1)
saver = plan.callbacks[0]
assert type(saver).__name__ == "Saver", plan.callbacks
print(saver.folder)
"""


def test_the_staging_folder_of_a_remote_save_folder_is_removed_when_the_process_ends(tmp_path, s3_bucket):
    script = tmp_path / "plan.py"
    script.write_text(PLAN)
    done = forkserver.run(
        [sys.executable, str(script), s3_bucket],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    staging = Path(done.stdout.strip().splitlines()[-1])
    assert staging.name.startswith("llm-ckpt-rank0-")
    assert not staging.exists(), f"{staging} was left in the temp directory"
