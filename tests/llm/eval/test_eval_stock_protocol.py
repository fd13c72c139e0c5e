"""`llm eval`'s default C-Eval / CMMLU protocol is lm-eval 0.4.13's stock one: same scores per option.

lm-eval runs its OWN task definitions (`ceval-valid_accountant`, `cmmlu_agronomy`, read from the
installed lm_eval/tasks folder: doc_to_text, description, target delimiter, choices, first-n
few-shot), re-pointed only at local CSV copies in each benchmark's published layout; the cells carry
leading and trailing spaces, which the stock prompts keep. `llm eval` reads the same folders with no
protocol named. The earlier "compact" protocol is measured against the same stock run, to show the
gap a user would otherwise see. Offline: the model, tokenizer and CSVs are local.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import yaml

from llm.eval.prompts import PROTOCOLS
from llm.eval.subjects import CEVAL_SUBJECTS, CMMLU_SUBJECTS
from tests.support.export import perturbed_export

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (pip install -e '.[dev]' installs it)",
)


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def spaced(row: list[str]) -> list[str]:
    """Cells as a published CSV may hold them: an option with a trailing and one with a leading space."""
    question, a, b, c, d, answer = row
    return [f" {question} ", a + " ", " " + b, c, d, answer]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, small_tokenizer):
    from convert.demo.tasks import write_demo_tasks

    root = tmp_path_factory.mktemp("stock")
    hf = perturbed_export(root / "hf", small_tokenizer, max_seq_len=512, seed=11)
    write_demo_tasks(str(root / "demo"), style="letter", questions=6)
    rows = {}
    for split in ("dev", "val"):
        with open(root / "demo" / split / "news_next_sentence.csv", encoding="utf-8") as f:
            rows[split] = [spaced(r[1:]) for r in list(csv.reader(f))[1:]]
    ceval, cmmlu = root / "ceval", root / "cmmlu"
    header = ["id", "question", "A", "B", "C", "D", "answer"]
    for split in ("dev", "val"):
        numbered = [[str(i), *r] for i, r in enumerate(rows[split])]
        write_csv(ceval / split / f"accountant_{split}.csv", header, numbered)
    for split, folder in (("dev", "dev"), ("val", "test")):
        numbered = [[str(i), *r] for i, r in enumerate(rows[split])]
        write_csv(cmmlu / folder / "agronomy.csv", ["", "Question", "A", "B", "C", "D", "Answer"], numbered)
    return str(hf), [str(ceval), str(cmmlu)]


@pytest.mark.parametrize("shots", [0, 2])
def test_default_protocol_equals_lm_evals_stock_ceval_and_cmmlu_tasks(setup, shots, capsys):
    from scenarios.lm_eval_compare import compare

    hf, tasks = setup
    found = compare(hf, tasks, shots=shots, limit=6, batch_size=4, stock=True)
    before = compare(
        hf, tasks, shots=shots, limit=6, batch_size=4, stock=True, protocol="compact", lm_eval_side=found
    )
    with capsys.disabled():
        print(
            f"\nstock lm-eval vs llm eval, {shots}-shot, {found.questions} questions: default protocol "
            f"max |ll diff| {found.max_abs_diff:.2e}, same answer {found.same_choices}; compact "
            f"protocol {before.max_abs_diff:.2f}, same answer {before.same_choices}"
        )
    assert found.questions == 12
    assert found.max_abs_diff < 5e-5
    assert found.same_choices == found.questions
    for key in found.ours:
        assert found.ours[key] == pytest.approx(found.theirs[key], abs=1e-9), key
    assert before.max_abs_diff > 0.1  # the earlier format is not what published figures use


def test_every_stock_subjects_description_is_ours():
    """Our descriptions and Chinese subject names, against each stock task yaml of lm-eval."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks"
    for family, names, pattern in (
        ("lm-eval-ceval", CEVAL_SUBJECTS, "ceval/ceval-valid_*.yaml"),
        ("lm-eval-cmmlu", CMMLU_SUBJECTS, "cmmlu/cmmlu_*.yaml"),
    ):
        files = sorted(stock.glob(pattern))
        assert len(files) == len(names)
        for path in files:
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
            expected = PROTOCOLS[family].description.replace("{subject}", names[config["dataset_name"]])
            assert config["description"] == expected, path.name
