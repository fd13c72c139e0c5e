"""Fixtures shared by the resume test modules (import them by name), over scenarios/resume.py.

The expensive work is cached on disk under the session's base temp folder, so each module reuses
it. The harness itself (shards, recipes, training subprocesses, records) lives in
`scenarios.resume`, which the resume benchmarks use too.
"""

from __future__ import annotations

import pytest

from scenarios.resume import *  # noqa: F403 (the harness, re-exported for the test modules)
from scenarios.resume import DOCUMENTS, reference_run, write_shards

SAME = ("step", "tokens", "loss", "lr")  # what an interrupted run must reproduce (tokens/s is timing)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.getbasetemp() / "resume-shards")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards):
    return reference_run(tmp_path_factory.getbasetemp(), shards)


@pytest.fixture(scope="module")
def reference_documents(tmp_path_factory, shards):
    """The reference run with `DOCUMENTS` (documents apart, positions restarting, the guard)."""
    return reference_run(
        tmp_path_factory.getbasetemp(), shards, tuple(DOCUMENTS), "resume-reference-documents"
    )


# The chunked loss head over several chunks (a micro-batch is 4 x 31 tokens), and the plain path, with
# the guard on: what it reads (loss/train/total) must not depend on the path.
CHUNKED = ["model.loss_chunk=40", "guard.enabled=true"]
PLAIN = ["model.loss_chunk=0", "guard.enabled=true"]


@pytest.fixture(scope="module")
def reference_chunked(tmp_path_factory, shards):
    return reference_run(tmp_path_factory.getbasetemp(), shards, tuple(CHUNKED), "resume-reference-chunked")


@pytest.fixture(scope="module")
def reference_plain(tmp_path_factory, shards):
    return reference_run(tmp_path_factory.getbasetemp(), shards, tuple(PLAIN), "resume-reference-plain")


def assert_same_records(got: list[dict], want: list[dict]) -> None:
    """metrics.jsonl lines (RECORDS: every 3 steps) of a resumed run equal the uninterrupted run's."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == [3, 6, 9, 12]
    for a, b in zip(got, want, strict=True):
        for key in SAME:
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a, b)
