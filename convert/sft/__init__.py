"""SFT conversion: prompt/answer pairs -> shards with a loss mask (`python -m convert sft`).

pairs.py       where a record keeps its prompt and answer (`SftLayout`, presets), pairs read out
               of JSON, JSON-lines and CSV files
conversion.py  cleaning, length rules, de-duplication, fitting, the chat template, packing and
               writing both splits; `SftOptions`
"""

from convert.sft.conversion import SftOptions, SftSummary, convert_sft
from convert.sft.pairs import SftLayout, layout_for, read_pairs

__all__ = ["SftLayout", "SftOptions", "SftSummary", "convert_sft", "layout_for", "read_pairs"]
