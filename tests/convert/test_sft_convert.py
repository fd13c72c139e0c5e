"""`python -m convert sft`: prompt/answer records -> SFT shards (tokens, loss mask, segments)."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
import sentencepiece as spm

from shards.chat_template import TEMPLATES, TemplateRenderer, read_template
from shards.tokenizer import Tokenizer
from shards.writer import HASHES, ShardWriter
from storage import open_store
from tests.support.sft import convert, convert_sft, examples_of, read_split, write_csv, write_jsonl

PAIRS = [
    {"prompt": "感冒的症状有哪些？请简要说明。", "answer": "发热、咳嗽、流鼻涕，多休息多喝水。"},
    {"prompt": "北京是哪个国家的首都？", "answer": "北京是中国的首都。"},
    {"prompt": "请把这句话翻译成英文：你好世界", "answer": "Hello, world."},
    {"prompt": "一年有几个季节，分别是什么？", "answer": "四个：春、夏、秋、冬。"},
]


@pytest.fixture(scope="module")
def sp(small_tokenizer):
    return spm.SentencePieceProcessor(model_file=small_tokenizer)


def expected_example(sp, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """baby-llama2-chinese's layout by hand, on the NFKC-normalised texts (the converter's default):
    prompt_ids + [bos] | answer_ids + [eos]."""
    prompt, answer = (unicodedata.normalize("NFKC", t).strip() for t in (prompt, answer))
    return sp.encode(prompt) + [sp.bos_id()], sp.encode(answer) + [sp.eos_id()]


def one_line_error(done) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    err = done.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_pairs_are_packed_whole_with_the_mask_on_the_answer_and_its_eos(tmp_path, small_tokenizer, sp):
    records = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    done = convert_sft([records], small_tokenizer, tmp_path / "out", "--seq-len", "64", "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    samples = read_split(tmp_path / "out" / "train")
    found = [example for sample in samples for example in examples_of(sample)]
    assert found == [expected_example(sp, p["prompt"], p["answer"]) for p in PAIRS]
    lengths = [len(a) + len(b) for a, b in found]
    assert len(samples) < len(PAIRS) and all(len(s["tokens"]) == 64 for s in samples)  # packed
    for sample in samples:
        pad = sample["segments"] == 0
        assert not sample["loss_mask"][pad].any() and (sample["tokens"][pad] == 0).all()
        assert np.all(np.diff(sample["segments"][~pad]) >= 0)  # examples whole and in order
    meta = json.loads((tmp_path / "out" / "train" / "meta.json").read_text())
    assert meta["kind"] == "sft" and meta["seq_len"] == 64 and meta["packed"] is True
    assert meta["columns"] == {"tokens": "uint16", "loss_mask": "uint8", "segments": "uint16"}
    assert meta["chat_template"] == {
        **TEMPLATES["baby-llama2"],
        "name": "baby-llama2",
        "normalization": "NFKC",
    }
    assert meta["num_examples"] == 4 and meta["target_tokens"] == sum(len(a) for _, a in found)
    assert meta["padding_tokens"] == 64 * len(samples) - sum(lengths)
    assert meta["padding_share"] == round(meta["padding_tokens"] / (64 * len(samples)), 4)
    assert "padding" in done.stdout and "4 examples" in done.stdout


def test_no_pack_puts_one_example_per_sample(tmp_path, small_tokenizer, sp):
    records = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    done = convert_sft(
        [records], small_tokenizer, tmp_path / "out", "--seq-len", "64", "--val-fraction", "0", "--no-pack"
    )
    assert done.returncode == 0, done.stderr
    samples = read_split(tmp_path / "out" / "train")
    assert [examples_of(s) for s in samples] == [
        [expected_example(sp, p["prompt"], p["answer"])] for p in PAIRS
    ]


def test_alpaca_json_list_and_baby_llama2_csv_presets(tmp_path, small_tokenizer, sp):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([
        {"instruction": "把下面的词语排序：", "input": "春 冬 夏", "output": "春、夏、冬"},
        {"instruction": "请用一句话介绍一下长城。", "input": "", "output": "长城是中国古代的军事防御工程。"},
    ], ensure_ascii=False), encoding="utf-8")  # fmt: skip
    done = convert_sft([alpaca], small_tokenizer, tmp_path / "a", "--preset", "alpaca", "--val-fraction", "0",
                       "--min-answer-chars", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = [e for s in read_split(tmp_path / "a" / "train") for e in examples_of(s)]
    assert got == [
        expected_example(sp, "把下面的词语排序：\n春 冬 夏", "春、夏、冬"),
        expected_example(sp, "请用一句话介绍一下长城。", "长城是中国古代的军事防御工程。"),
    ]
    table = write_csv(
        tmp_path / "sft_data.csv", ["prompt", "answer"], [[p["prompt"], p["answer"]] for p in PAIRS]
    )
    done = convert_sft(
        [table], small_tokenizer, tmp_path / "c", "--preset", "baby-llama2", "--val-fraction", "0"
    )
    assert done.returncode == 0, done.stderr
    got = [e for s in read_split(tmp_path / "c" / "train") for e in examples_of(s)]
    assert got == [expected_example(sp, p["prompt"], p["answer"]) for p in PAIRS]


def test_pairs_at_their_maximum_never_outgrow_the_sample_and_keep_their_eos(tmp_path, small_tokenizer, sp):
    """baby-llama2-chinese: with prompt and answer both at their maximum the sample outgrew max_length
    (negative padding), and a full-length sample trained an `eos -> pad` target."""
    long_text = "中国人民的伟大胜利，" * 40
    records = write_jsonl(tmp_path / "long.jsonl", [
        {"prompt": long_text, "answer": long_text},  # both far too long
        {"prompt": "这个短问题是什么意思呢？", "answer": long_text},  # the answer takes the room left
        {"prompt": long_text, "answer": "好的，明白了。"},  # the prompt takes the room left
    ])  # fmt: skip
    seq = 48
    done = convert_sft([records], small_tokenizer, tmp_path / "out", "--seq-len", str(seq), "--no-pack",
                       "--val-fraction", "0", "--max-prompt-chars", "0", "--max-answer-chars", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    samples = read_split(tmp_path / "out" / "train")
    bos, eos = sp.bos_id(), sp.eos_id()
    for sample in samples:
        ((prompt, answer),) = examples_of(sample)
        assert len(prompt) + len(answer) == seq  # exactly full: no padding, never more
        assert prompt[-1] == bos and answer[-1] == eos and sample["loss_mask"][-1] == 1
        assert (sample["segments"] == 1).all()  # no padding token, so no `eos -> pad` target exists
    (p0, a0), (p1, a1), (p2, a2) = (examples_of(s)[0] for s in samples)
    room = seq - 2
    assert (len(p0) - 1, len(a0) - 1) == (room // 2, room - room // 2)  # both cut: the prompt keeps half
    assert [p1, a2] == [expected_example(sp, "这个短问题是什么意思呢？", "")[0],  # a short prompt is kept whole
                        expected_example(sp, "", "好的，明白了。")[1]]  # so is a short answer  # fmt: skip
    meta = json.loads((tmp_path / "out" / "train" / "meta.json").read_text())
    assert meta["truncated"] == {"prompts": 2, "answers": 2} and meta["padding_tokens"] == 0
    assert "truncated to fit 48 tokens: 2 prompts, 2 answers" in done.stdout
    dropped = convert_sft([records], small_tokenizer, tmp_path / "d", "--seq-len", str(seq), "--val-fraction", "0",
                          "--max-prompt-chars", "0", "--max-answer-chars", "0", "--drop-truncated")  # fmt: skip
    assert dropped.returncode == 2 and "too_long_tokens" in dropped.stderr  # every pair was too long


def test_length_rules_empty_answers_duplicates_and_missing_fields_are_counted(tmp_path, small_tokenizer):
    records = write_jsonl(tmp_path / "mixed.jsonl", [
        *PAIRS,
        PAIRS[0],  # duplicate
        {"prompt": "太短", "answer": "这一个问题太短了。"},  # prompt under 10 characters
        {"prompt": "这个回答是空的，怎么办呢？", "answer": "   "},  # empty answer
        {"prompt": "这个回答太短了，对不对呢？", "answer": "对"},  # answer under 5 characters
        {"question": "没有prompt字段的记录是什么？", "answer": "坏记录"},  # no prompt field
        {"prompt": "没有answer字段的记录是什么？"},  # no answer field
    ])  # fmt: skip
    done = convert_sft([records], small_tokenizer, tmp_path / "out", "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "out" / "train" / "meta.json").read_text())
    assert meta["num_examples"] == 4
    assert meta["dropped"] == {"duplicate": 1, "prompt_too_short": 1, "empty_answer": 1, "answer_too_short": 1,
                               "malformed": 2}  # fmt: skip
    assert "mixed.jsonl:9: no prompt field 'prompt'" in done.stdout
    assert "mixed.jsonl:10: no answer field 'answer'" in done.stdout


@pytest.mark.parametrize(
    "case, message",
    [
        ("no-field", "no prompt/answer pair to write"),
        ("csv-header", "the CSV header is 'question,reply'"),
        ("template", "leaves 1 for the prompt and the answer; raise --seq-len"),
        ("exists", "already holds a complete conversion"),
        ("template-file", "'prompt' must hold '{prompt}' exactly once"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, small_tokenizer, case, message):
    records = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    args: list = [[records], small_tokenizer, tmp_path / "out"]
    extra: list[str] = []
    if case == "no-field":
        args[0] = [
            write_jsonl(
                tmp_path / "q.jsonl", [{"question": p["prompt"], "reply": p["answer"]} for p in PAIRS]
            )
        ]
    elif case == "csv-header":
        args[0] = [write_csv(tmp_path / "t.csv", ["question", "reply"], [["a", "b"]])]
    elif case == "template":
        extra = ["--seq-len", "3"]  # the default template's <bos> and <eos> take 2 of 3
    elif case == "exists":
        assert convert_sft(*args).returncode == 0
    elif case == "template-file":
        (tmp_path / "t.json").write_text(json.dumps({"prompt": ["<bos>"], "answer": ["{answer}"]}))
        extra = ["--template", str(tmp_path / "t.json")]
    err = one_line_error(convert_sft(*args, *extra))
    assert message in err, err
    if case == "no-field":
        assert "no prompt field 'prompt' (its fields: question, reply)" in err


def test_an_interrupted_output_is_never_complete(tmp_path, small_tokenizer):
    """index.json is written last; a rerun clears a partial output before writing anything."""
    records = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "shard.00007.mds.zstd").write_bytes(b"left by a killed run")
    done = convert_sft([records], small_tokenizer, out, "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    assert not (out / "train" / "shard.00007.mds.zstd").exists()
    assert json.loads((out / "train" / "index.json").read_text())["shards"]


def test_a_chat_prompt_is_rendered_as_the_converter_renders_a_sample_prompt(small_tokenizer, sp):
    """Chat (`prompt_ids` on the user's text) and conversion (`TemplateRenderer` on token ids) give
    the ids baby-llama2-chinese / Alpaca lay out by hand, for the template as meta.json carries it."""
    tokenizer = Tokenizer(small_tokenizer)
    headers = [sp.encode("### Instruction:\n"), sp.encode("\n\n### Response:\n")]
    by_hand = {
        "baby-llama2": lambda ids: ids + [sp.bos_id()],
        "alpaca": lambda ids: [sp.bos_id(), *headers[0], *ids, *headers[1]],
    }
    for name in TEMPLATES:
        template = read_template(name).normalized("NFKC")
        renderer = TemplateRenderer(template, tokenizer)
        recorded = type(template).from_dict(template.to_dict(), "meta.json")
        for text in ("北京是哪个国家的首都？", "介绍一下 Python。"):
            expected = by_hand[name](sp.encode(unicodedata.normalize("NFKC", text)))
            assert renderer.prompt_ids(sp.encode(unicodedata.normalize("NFKC", text))) == expected, name
            assert recorded.prompt_ids(tokenizer, f"  {text} ") == expected, name


def test_extra_columns_are_byte_identical_to_streaming(tmp_path):
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    columns = {
        "tokens": rng.integers(0, 4096, size=(13, 40)).astype(np.uint16),
        "loss_mask": rng.integers(0, 2, size=(13, 40)).astype(np.uint8),
        "segments": rng.integers(0, 300, size=(13, 40)).astype(np.uint16),
    }
    size_limit = 1200
    ours = ShardWriter(open_store(tmp_path / "ours"), "s", seq_len=40, dtype="uint16", size_limit=size_limit,
                       extra_columns={"loss_mask": "uint8", "segments": "uint16"})  # fmt: skip
    ours.write({k: v[:5] for k, v in columns.items()})
    ours.write({k: v[5:] for k, v in columns.items()})
    entries = ours.finish()
    encodings = {"tokens": "ndarray:uint16", "loss_mask": "ndarray:uint8", "segments": "ndarray:uint16"}
    with MDSWriter(out=str(tmp_path / "theirs"), columns=encodings, compression="zstd", hashes=HASHES,
                   size_limit=size_limit) as writer:  # fmt: skip
        for i in range(13):
            writer.write({k: v[i] for k, v in columns.items()})
    theirs = json.loads((tmp_path / "theirs" / "index.json").read_text())["shards"]
    assert len(entries) > 1 and entries == theirs


def test_demo_sft_keeps_heldout_reviews_out_of_training(tmp_path):
    done = convert("demo-sft", "--out", str(tmp_path / "d"), "--train", "500", "--heldout", "50")
    assert done.returncode == 0, done.stderr
    read = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "d" / "heldout.jsonl").read_text().splitlines()]
    assert (len(read), len(held)) == (500, 50)
    assert {r["answer"] for r in read + held} == {"正面", "负面"}
    assert not {r["prompt"] for r in read} & {r["prompt"] for r in held}
    assert all(
        "\n" not in r["prompt"] and r["prompt"].endswith("这条评论是正面还是负面？") for r in read + held
    )
    again = convert("demo-sft", "--out", str(tmp_path / "e"), "--train", "500", "--heldout", "50")
    assert again.returncode == 0
    assert (tmp_path / "e" / "train.jsonl").read_bytes() == (tmp_path / "d" / "train.jsonl").read_bytes()


def test_records_and_shards_on_s3(s3_bucket, tmp_path, small_tokenizer):
    store = open_store(f"s3://{s3_bucket}")
    table = write_csv(
        tmp_path / "sft_data.csv", ["prompt", "answer"], [[p["prompt"], p["answer"]] for p in PAIRS]
    )
    store.upload(table, "raw/sft_data.csv")
    done = convert("sft", f"s3://{s3_bucket}/raw/", "--preset", "baby-llama2", "--tokenizer", small_tokenizer,
                   "--out", f"s3://{s3_bucket}/sft", "--val-fraction", "0", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    meta = store.read_json("sft/train/meta.json")
    assert meta["kind"] == "sft" and meta["num_examples"] == len(PAIRS)
    assert store.exists("sft/train/index.json") and store.exists("sft/val/index.json")
