"""Input locations: folders and globs expand deterministically; S3 reads like local disk."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from convert.errors import ConvertError
from convert.reading.readers import ReadStats, read_documents
from convert.reading.sources import expand_inputs, open_binary, refuse_output_among_inputs
from storage import StorageError, open_store
from tests.support.conversion import run_convert
from tests.support.corpus import write_json_list, write_jsonl, write_txt
from tests.support.s3server import free_port


@pytest.fixture
def tree(tmp_path, chinese_documents) -> Path:
    """corpus/{b.jsonl, a.jsonl, sub/c.jsonl, sub/deeper/d.txt, .hidden.jsonl}, shuffled creation."""
    root = tmp_path / "corpus"
    docs = chinese_documents
    write_jsonl(root / "sub" / "c.jsonl", docs[4:6])
    write_jsonl(root / "b.jsonl", docs[2:4])
    write_txt(root / "sub" / "deeper" / "d.txt", docs[6:8])
    write_jsonl(root / "a.jsonl", docs[0:2])
    write_jsonl(root / ".hidden.jsonl", docs[8:9])
    return root


def rel(paths: list[str], root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p in paths]


def test_folder_expands_recursively_sorted_without_hidden_files(tree):
    assert rel(expand_inputs([str(tree)]), tree) == ["a.jsonl", "b.jsonl", "sub/c.jsonl", "sub/deeper/d.txt"]


def test_globs_expand_sorted_and_double_star_crosses_folders(tree):
    assert rel(expand_inputs([str(tree / "*.jsonl")]), tree) == ["a.jsonl", "b.jsonl"]
    assert rel(expand_inputs([str(tree / "**" / "*.jsonl")]), tree) == ["a.jsonl", "b.jsonl", "sub/c.jsonl"]


def test_arguments_keep_their_order_and_duplicates_are_dropped(tree):
    got = expand_inputs([str(tree / "sub"), str(tree / "b.jsonl"), str(tree / "*.jsonl")])
    assert rel(got, tree) == ["sub/c.jsonl", "sub/deeper/d.txt", "b.jsonl", "a.jsonl"]


def test_nothing_matched_is_an_error_naming_the_pattern(tmp_path):
    with pytest.raises(ConvertError, match=r"'.*\*\.jsonl' matched no files"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(ConvertError, match=r"missing\.jsonl does not exist"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="contains no files"):
        expand_inputs([str(tmp_path / "empty")])
    with pytest.raises(ConvertError, match="no input given"):
        expand_inputs([])


def file_size(url: str) -> int | None:
    folder, _, name = url.rpartition("/")
    return open_store(folder).size(name)


def test_local_open_and_size(tree):
    path = str(tree / "a.jsonl")
    with open_binary(path) as f:
        assert f.read() == Path(path).read_bytes()
    assert file_size(path) == Path(path).stat().st_size


# --- S3 ----------------------------------------------------------------------------------------


def upload_tree(s3_server, bucket: str, root: Path, prefix: str) -> None:
    client = s3_server.client()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())


def read_all(paths: list[str], fmt: str = "auto") -> list[str]:
    return [d.text for d in read_documents(paths, fmt, stats=ReadStats())]


@pytest.mark.s3
def test_s3_prefix_glob_and_object_read_the_same_documents_as_local(s3_server, s3_bucket, tree):
    upload_tree(s3_server, s3_bucket, tree, "data/corpus")
    url = f"s3://{s3_bucket}/data/corpus"
    local = expand_inputs([str(tree)])

    by_prefix = expand_inputs([url])
    # The hidden file is uploaded but object stores have no hidden files: it is listed.
    assert [u.removeprefix(url + "/") for u in by_prefix] == [".hidden.jsonl"] + rel(local, tree)
    assert read_all(by_prefix[1:]) == read_all(local)
    assert expand_inputs([url + "/"]) == by_prefix

    by_glob = expand_inputs([url + "/*.jsonl"])
    assert [u.removeprefix(url + "/") for u in by_glob] == [
        ".hidden.jsonl",
        "a.jsonl",
        "b.jsonl",
        "sub/c.jsonl",
    ]
    assert expand_inputs([url + "/sub/**/*.txt"]) == [url + "/sub/deeper/d.txt"]

    single = expand_inputs([url + "/b.jsonl"])
    assert single == [url + "/b.jsonl"]
    assert read_all(single) == read_all([str(tree / "b.jsonl")])


@pytest.mark.s3
def test_s3_prefix_without_slash_does_not_match_sibling_folders(s3_server, s3_bucket, tree):
    upload_tree(s3_server, s3_bucket, tree, "corpus")
    upload_tree(s3_server, s3_bucket, tree / "sub", "corpus2")
    got = expand_inputs([f"s3://{s3_bucket}/corpus"])
    assert all(u.startswith(f"s3://{s3_bucket}/corpus/") for u in got) and len(got) == 5
    # With no folder of that name, the argument is a plain key prefix.
    assert len(expand_inputs([f"s3://{s3_bucket}/corpus2/c"])) == 1


@pytest.mark.s3
def test_s3_json_list_streams_with_the_right_size(s3_server, s3_bucket, tmp_path, chinese_documents):
    expected = write_json_list(tmp_path / "big.json", chinese_documents[:800])
    body = (tmp_path / "big.json").read_bytes()
    s3_server.client().put_object(Bucket=s3_bucket, Key="big.json", Body=body)
    url = f"s3://{s3_bucket}/big.json"
    assert file_size(url) == len(body) > 1 << 20  # more than one 1 MiB read buffer
    assert read_all([url]) == expected
    with open_binary(url) as f:
        assert f.readline() == b"[\n"


@pytest.mark.s3
def test_s3_no_match_names_the_pattern_and_bucket(s3_server, s3_bucket):
    with pytest.raises(
        ConvertError, match=rf"'s3://{s3_bucket}/nothing/\*\.jsonl' matched no objects in bucket"
    ):
        expand_inputs([f"s3://{s3_bucket}/nothing/*.jsonl"])
    with pytest.raises(ConvertError, match="matched no objects"):
        expand_inputs([f"s3://{s3_bucket}/nothing"])


@pytest.mark.s3
def test_missing_bucket_names_the_endpoint_and_bucket(s3_server):
    with pytest.raises(ConvertError) as err:
        expand_inputs(["s3://no-such-bucket-here/corpus/"])
    assert "'no-such-bucket-here' does not exist" in str(err.value)
    assert s3_server.endpoint in str(err.value)
    with pytest.raises(StorageError, match="no-such-bucket-here"):
        open_store("s3://no-such-bucket-here").read_bytes("a.jsonl")


@pytest.mark.s3
def test_missing_object_is_a_clear_error(s3_server, s3_bucket):
    with pytest.raises(ConvertError, match=rf"s3://{s3_bucket}/gone.jsonl.*no such object"):
        open_binary(f"s3://{s3_bucket}/gone.jsonl")


@pytest.mark.s3
def test_unreachable_endpoint_names_the_endpoint(s3_server, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", dead)
    monkeypatch.setenv("LLM_S3_OUTAGE_S", "1")  # a dead endpoint is retried this long (default 300 s)
    with pytest.raises(ConvertError, match=rf"cannot reach endpoint {dead}.*'bkt'.*S3_ENDPOINT_URL"):
        expand_inputs(["s3://bkt/corpus/"])


@pytest.mark.parametrize(
    ("inputs", "out", "refused"),
    [
        (["corpus"], "corpus/shards", True),
        (["corpus/"], "corpus", True),
        (["corpus/*"], "corpus/shards", True),  # the glob matches the shards' folder: read whole
        (["corpus/**/*.json"], "corpus/shards", True),
        (["corpus/*.jsonl"], "corpus/shards", False),
        (["corpus/a.jsonl"], "corpus/shards", False),
        (["corpus"], "shards", False),
        (["s3://b/corpus"], "s3://b/corpus/shards", True),
        (["s3://b/c/*.json"], "s3://b/c/out", True),  # in S3 globs `*` crosses `/`
        (["s3://b/corpus"], "s3://b/corpus2", False),
        (["s3://b/corpus"], "s3://other/corpus/shards", False),
        (["s3://b/corpus"], "corpus/shards", False),
    ],
)
def test_an_output_inside_an_input_is_refused_from_the_names_alone(
    tmp_path, monkeypatch, inputs, out, refused
):
    (tmp_path / "corpus").mkdir()
    monkeypatch.chdir(tmp_path)
    if refused:
        with pytest.raises(ConvertError, match=re.escape(f"--out {out} lies inside the input {inputs[0]}:")):
            refuse_output_among_inputs(inputs, out)
    else:
        refuse_output_among_inputs(inputs, out)


def test_convert_refuses_an_out_inside_its_input_folder(tmp_path, small_corpus_docs, small_tokenizer):
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", small_corpus_docs[:20])
    out = corpus / "shards"
    result = run_convert(
        "shards",
        str(corpus),
        "--tokenizer",
        small_tokenizer,
        "--out",
        str(out),
        "--seq-len",
        "64",
        "--no-progress",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"error: --out {out} lies inside the input {corpus}: a conversion of that input would read the "
        "shards' own index.json and meta.json as text; choose an --out outside the inputs"
    )
    assert not out.exists()
