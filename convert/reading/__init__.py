"""Reading: the input files of a conversion and the documents in them.

sources.py      files, folders, globs and s3:// prefixes expanded to files (a corpus: its markers
                and other formats skipped); opened (local or S3, streamed or ranged)
formats.py      what a file name says: format, compression, marker
compression.py  gzip, zstd, bzip2 and xz decompressed on the fly
readers.py      documents out of txt, txt-blank, JSON, JSON-lines and Parquet files, bad records
                counted with file and line; a line file's byte ranges and a Parquet file's row
                groups, each read alone
parquet.py      Parquet through pyarrow: the footer, the text column, a row group's record batches
extras.py       pyarrow (the `parquet` extra) imported, or one line naming the extra
presets.py      known corpus layouts (`--preset`): where a record keeps its text
bin_files.py    baby-llama2-chinese's .bin token files split back into documents
options.py      `ReadOptions`: format, text field, preset, strictness, normalisation, dedup
"""

from convert.reading.bin_files import bin_documents
from convert.reading.options import ReadOptions
from convert.reading.presets import Preset, get_preset
from convert.reading.readers import Document, ReadStats, check_inputs, read_documents, read_json_records
from convert.reading.sources import CorpusFiles, expand_corpus, expand_inputs, open_binary

__all__ = [
    "CorpusFiles",
    "Document",
    "Preset",
    "ReadOptions",
    "ReadStats",
    "bin_documents",
    "check_inputs",
    "expand_corpus",
    "expand_inputs",
    "get_preset",
    "open_binary",
    "read_documents",
    "read_json_records",
]
