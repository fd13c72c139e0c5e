"""Turn raw text corpora into tokenized MDS shards: `python -m convert --help`.

Kept import-light on purpose: `import convert` must not pull in torch or streaming, so the
CLI's `--help` and input validation answer in well under a second.
"""

from convert.errors import ConvertError

__all__ = ["ConvertError"]
