"""The shard format: the one contract between `convert` (which writes shards) and `llm` (which
trains on them), as code both import. It imports only `storage`.

  shards/meta.py           the format's name and version, `meta.json` as one typed schema
  shards/index.py          a split's `index.json`: written last, checked before training
  shards/output.py         an output folder: opened, refused when complete, made resumable
  shards/writer.py         the MDS shard bytes (the same as streaming's `MDSWriter`)
  shards/tokenizer.py      the one tokenizer: a SentencePiece `.model` or a Hugging Face `tokenizer.json`
  shards/chat_template.py  the one chat template (SFT samples, chat prompts)

The format itself is described in shards/FORMAT.md. Problems a user can fix raise `ShardsError`
(shards/errors.py); both command layers print it as one line and exit 2.
"""
