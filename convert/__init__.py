"""Turn raw text corpora into tokenized MDS shards: `python -m convert --help`.

The pipeline's stages are sub-packages, each with its settings beside it (docs/architecture.md
draws the floors they import along):

  reading/   input files (folders, globs, s3://), records (txt, JSON, JSON lines, presets),
             byte ranges of line files, .bin token files; `ReadOptions`
  filters/   cleaning (Unicode form, controls, empty texts, exact duplicates) and the quality
             filters; `QualityFilters`
  dedup/     MinHash signatures, near-duplicate decisions, index processes, and the selection of
             what a conversion keeps, in input order; `NearDedupOptions`
  tokens/    SentencePiece training, packing token streams into samples
  run/       one conversion: workers, the main loop, byte-range reading, multi-machine tasks and
             their merge, progress and summary; `ShardOptions`, `convert_corpus`
  sft/       prompt/answer pairs -> SFT shards with a loss mask
  demo/      the quickstart's corpus, its SFT task and its multiple-choice tasks
  cli.py     the `python -m convert` sub-commands

Under them: `records` (what the stages hand each other), `errors`, `executor` (the worker pool)
and `scratch` (temporary folders of a run).

Kept import-light on purpose: `import convert` must not pull in torch or streaming, so the
CLI's `--help` and input validation answer in well under a second.
"""

from convert.errors import ConvertError

__all__ = ["ConvertError"]
