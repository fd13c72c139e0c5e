"""Fixtures shared by the resume test modules (import them by name), over bench/resume_harness.py.

The expensive work is cached on disk under the session's base temp folder, so each module reuses
it. The harness itself (shards, recipes, training subprocesses, records) lives in
`bench.resume_harness`, which the resume benchmarks use too.
"""

from __future__ import annotations

import pytest

from bench.resume_harness import *  # noqa: F403 (the harness, re-exported for the test modules)
from bench.resume_harness import reference_run, write_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.getbasetemp() / "resume-shards")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards):
    return reference_run(tmp_path_factory.getbasetemp(), shards)
