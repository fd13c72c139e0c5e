"""Reading: the input files of a conversion and the documents in them.

sources.py    files, folders, globs and s3:// prefixes expanded to files; opened (local or S3)
readers.py    documents out of txt, txt-blank, JSON and JSON-lines files (gzip too), bad
              records counted with file and line; a line file's byte ranges, each read alone
presets.py    known corpus layouts (`--preset`): where a record keeps its text
bin_files.py  baby-llama2-chinese's .bin token files split back into documents
options.py    `ReadOptions`: format, text field, preset, strictness, normalisation, dedup
"""

from convert.reading.bin_files import bin_documents
from convert.reading.options import ReadOptions
from convert.reading.presets import Preset, get_preset
from convert.reading.readers import Document, ReadStats, read_documents, read_json_records
from convert.reading.sources import expand_inputs, open_binary

__all__ = [
    "Document",
    "Preset",
    "ReadOptions",
    "ReadStats",
    "bin_documents",
    "expand_inputs",
    "get_preset",
    "open_binary",
    "read_documents",
    "read_json_records",
]
