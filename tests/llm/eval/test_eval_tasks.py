"""Multiple-choice tasks: C-Eval and CMMLU layouts, local and S3, prompts, few-shot, bad input."""

from __future__ import annotations

import json

import pytest

from llm.errors import ConfigError
from llm.eval.harness import load_tasks
from llm.eval.prompts import build_prompts
from llm.eval.tasks import load_task

CEVAL_HEADER = "id,question,A,B,C,D,answer,explanation\n"


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def ceval_folder(root):
    """C-Eval's published layout: <split>/<subject>_<split>.csv, a test split without answers."""
    write(
        root / "dev" / "computer_network_dev.csv",
        CEVAL_HEADER + '0,"1+1=?",1,2,3,4,B,"因为"\n1,二加二,3,4,5,6,B,\n',
    )
    write(
        root / "val" / "computer_network_val.csv",
        CEVAL_HEADER + '0,"三,加三",5,6,7,8,B,\n1,一加零,1,2,3,4,A,\n',
    )
    write(root / "test" / "computer_network_test.csv", CEVAL_HEADER + "0,四加四,7,8,9,10,,\n")
    write(
        root / "subject_mapping.json",
        json.dumps({"computer_network": ["Computer Network", "计算机网络", "STEM"]}),
    )
    return root


def test_ceval_layout_val_split_with_chinese_subject_name_and_few_shot(tmp_path):
    task = load_task(str(ceval_folder(tmp_path / "ceval")))
    assert (task.name, task.split, task.style) == ("ceval", "val", "letter")
    [subject] = task.subjects
    assert subject.name == "computer_network" and subject.shown == "计算机网络"
    assert [q.text for q in subject.questions] == ["三,加三", "一加零"]
    assert subject.questions[0].options == ("5", "6", "7", "8") and subject.questions[0].answer == 1
    assert len(subject.examples) == 2

    # lm-eval's stock ceval-valid protocol: its description, the letter after a space.
    assert task.protocol == "lm-eval-ceval"
    assert [q.id for q in subject.questions] == ["0", "1"]  # C-Eval's id column
    prompts = build_prompts(task, subject, shots=1)
    assert prompts[0].context == (
        "以下是中国关于计算机网络的单项选择题，请选出其中的正确答案。\n\n"
        "1+1=?\nA. 1\nB. 2\nC. 3\nD. 4\n答案： B\n\n"
        "三,加三\nA. 5\nB. 6\nC. 7\nD. 8\n答案："
    )
    assert prompts[0].continuations == (" A", " B", " C", " D") and prompts[0].answer == 1
    assert prompts[0].lengths == [1, 1, 1, 1] and prompts[0].id == "0"
    # Few-shot examples are the first of the dev split: the same for every question and run.
    assert build_prompts(task, subject, shots=2)[1].context.count("答案： B\n\n") == 2

    # The earlier format stays as the named alternative "compact".
    compact = load_task(str(tmp_path / "ceval"), protocol="compact")
    prompts = build_prompts(compact, compact.subjects[0], shots=1)
    assert prompts[0].context == (
        "以下是中国关于计算机网络考试的单项选择题，请选出其中的正确答案。\n\n"
        "1+1=?\nA. 1\nB. 2\nC. 3\nD. 4\n答案：B\n\n"
        "三,加三\nA. 5\nB. 6\nC. 7\nD. 8\n答案："
    )
    assert prompts[0].continuations == ("A", "B", "C", "D")


def test_cmmlu_layout_capitalised_columns_and_unnamed_index(tmp_path):
    root = tmp_path / "cmmlu"
    write(root / "dev" / "agronomy.csv", ",Question,A,B,C,D,Answer\n0,甲,a,b,c,d,C\n")
    write(root / "test" / "agronomy.csv", ",Question,A,B,C,D,Answer\n0,乙,a,b,c,d,d\n1,丙,a,b,c,d,A\n")
    task = load_task(str(root))
    assert task.split == "test" and task.subjects[0].name == "agronomy"
    # CMMLU's header spelling picks lm-eval's stock cmmlu prompt, with the benchmark's Chinese name.
    assert task.protocol == "lm-eval-cmmlu" and task.subjects[0].shown == "农学"
    assert build_prompts(task, task.subjects[0], shots=0)[0].context.startswith(
        "以下是关于农学的单项选择题，请直接给出正确答案的选项。\n\n乙\nA. a"
    )
    assert [q.id for q in task.subjects[0].questions] == ["agronomy.csv:2", "agronomy.csv:3"]
    assert [q.answer for q in task.subjects[0].questions] == [3, 0]  # the letter's case does not matter
    assert load_task(str(root), max_questions=1).subjects[0].questions[0].text == "乙"


def test_a_task_on_s3_reads_like_a_local_one(s3_bucket, tmp_path):
    from convert.demo.tasks import write_demo_tasks

    write_demo_tasks(f"s3://{s3_bucket}/tasks/zh-demo", questions=6)
    write_demo_tasks(str(tmp_path / "zh-demo"), questions=6)
    remote, local = load_task(f"s3://{s3_bucket}/tasks/zh-demo"), load_task(str(tmp_path / "zh-demo"))
    assert remote.name == local.name == "zh-demo" and remote.style == "cloze"
    assert [s.questions for s in remote.subjects] == [s.questions for s in local.subjects]
    assert [len(s.examples) for s in remote.subjects] == [5, 5]


def test_the_demo_task_is_real_text_and_the_same_every_time(tmp_path):
    from convert.demo.corpus import peoples_daily_documents
    from convert.demo.tasks import write_demo_tasks

    counts = write_demo_tasks(str(tmp_path / "a"), questions=20)
    write_demo_tasks(str(tmp_path / "b"), questions=20)
    assert counts == {"news_next_sentence": 20, "review_sentiment": 20}
    for name in ("val/news_next_sentence.csv", "val/review_sentiment.csv", "dev/news_next_sentence.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    task = load_task(str(tmp_path / "a"))
    news = next(s for s in task.subjects if s.name == "news_next_sentence")
    corpus = "\n".join(peoples_daily_documents())
    for q in news.questions:  # the right option really follows the question in an article
        assert q.text + q.options[q.answer] in corpus
    assert len({q.answer for q in news.questions}) == 4  # the right answer is not always in one place
    letter = write_demo_tasks(str(tmp_path / "letter"), style="letter", questions=3)
    assert load_task(str(tmp_path / "letter")).style == "letter" and letter["review_sentiment"] == 3


@pytest.mark.parametrize(
    "files, message",
    [
        (
            {"val/x.csv": "id,question,A,B,C,D\n0,q,a,b,c,d\n"},
            "val/x.csv: no 'answer' column (found: id, question, A, B",
        ),
        ({"val/x.csv": "question,B,C,answer\nq,b,c,B\n"}, "no 'A' column"),
        (
            {"val/x.csv": "question,A,B,C,D,answer\nq,a,b,c,d,E\n"},
            "line 2: answer 'E' is not one of the options A, B, C, D",
        ),
        ({"val/x.csv": "question,A,B,answer\nq,a,b,C\n"}, "answer 'C' is not one of the options A, B"),
        ({"val/x.csv": ""}, "val/x.csv is empty (an empty subject)"),
        ({"val/x.csv": "question,A,B,C,D,answer\n\n"}, "has a header but no questions (an empty subject)"),
        (
            {"test/x.csv": "question,A,B,C,D,answer\nq,a,b,c,d,\n"},
            "no answer (C-Eval's test split publishes none)",
        ),
        ({"val/x.csv": "question,A,B,C,D,answer\nq,a,b\n"}, "line 2: 3 cells but the header has 6"),
        ({"notes.txt": "hello"}, "holds no CSV files; expected C-Eval/CMMLU's layout"),
        (
            {"val/x.csv": "question,A,B,answer\nq,a,b,A\n", "task.json": '{"style": "essay"}'},
            "style 'essay' is not one",
        ),
    ],
)
def test_bad_task_files_are_one_clear_line(tmp_path, files, message):
    for name, text in files.items():
        write(tmp_path / "t" / name, text)
    with pytest.raises(ConfigError) as err:
        load_tasks([str(tmp_path / "t")])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_asking_more_shots_than_dev_examples_names_the_limit(tmp_path):
    task = load_task(str(ceval_folder(tmp_path / "ceval")))
    with pytest.raises(
        ConfigError, match="3 shots asked but it has 2 dev examples .* use --shots 2 or fewer"
    ):
        build_prompts(task, task.subjects[0], shots=3)


def test_a_missing_split_or_folder_is_named(tmp_path):
    ceval_folder(tmp_path / "ceval")
    with pytest.raises(ConfigError, match=r"has no split 'validation' \(found: dev, test, val\)"):
        load_task(str(tmp_path / "ceval"), split="validation")
    with pytest.raises(ConfigError, match="task folder .*nowhere does not exist"):
        load_task(str(tmp_path / "nowhere"))
