"""Running a conversion: texts -> workers -> selection -> chunks -> parts -> meta, summary, index.

jobs.py        whole conversions as functions: `convert_corpus` (text), `import_bin` (.bin files)
conversion.py  the main process's loop: batches to the workers, the selection, train/val split,
               chunks, parts reused after a kill, tails, meta.json, summary.json, index.json
ranges.py      the path where workers read byte ranges of local line files themselves
worker.py      what a worker process does: clean, filter, sign, tokenize; pack and write a part
tasks.py       a conversion split over machines: one task, the files it stores for the merge
merge.py       the merge of the tasks: de-duplication stages by partition, the ordered pass
report.py      progress bars or lines, the summary printed and saved
options.py     `ShardOptions`: what a conversion is asked to do, checked once
"""

from convert.run.jobs import convert_corpus, import_bin
from convert.run.merge import merge_tasks
from convert.run.options import ShardOptions, available_cpus
from convert.run.report import Summary
from convert.run.tasks import TaskMarker, TaskSpec

__all__ = [
    "ShardOptions",
    "Summary",
    "TaskMarker",
    "TaskSpec",
    "available_cpus",
    "convert_corpus",
    "import_bin",
    "merge_tasks",
]
