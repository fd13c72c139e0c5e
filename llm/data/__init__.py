"""The training data path: token shards (shards/FORMAT.md) -> StreamingDataset -> DataLoader.

One module per job, in the order the trainer needs them:

  meta_checks.py      `check_streams(cfg)`: each stream's meta.json against the recipe, before any
                      model is built; `chat_template_of(cfg)`: an SFT run's template
  cache.py            the folder each stream is read from, the remote shards' cache and its limit
  shared_memory.py    streaming's shared memory: stale registrations of our folders, the prefix race,
                      releasing it before a fast exit
  verified_stream.py  `VerifiedStream`: shard files fetched through `storage` and hash-checked
  datasets.py         `TokenDataset`, `SftDataset`: samples as tensors, download failures in one line
  skip.py             `SkipWindows` (data.skip) and `SkippingLoader`, the training loader that drops them
  loaders.py          `build_dataloader(cfg, split, batch_size)` and what the Trainer gets (`train_data_spec`)

The names below are the package's public face (the trainer, the callbacks, bench/ and tests/).
"""

from llm.data.cache import all_stream_locals, index_digest, stream_local
from llm.data.datasets import SftDataset, TokenDataset
from llm.data.loaders import build_dataloader, build_dataset, train_data_spec
from llm.data.meta_checks import chat_template_of, check_streams, document_eos
from llm.data.shared_memory import clean_stale_shared_memory, release_shared_memory
from llm.data.skip import SkippingLoader, SkipWindows
from llm.data.verified_stream import CorruptShard, VerifiedStream

__all__ = [
    "CorruptShard",
    "SftDataset",
    "SkipWindows",
    "SkippingLoader",
    "TokenDataset",
    "VerifiedStream",
    "all_stream_locals",
    "build_dataloader",
    "build_dataset",
    "chat_template_of",
    "check_streams",
    "clean_stale_shared_memory",
    "release_shared_memory",
    "document_eos",
    "index_digest",
    "stream_local",
    "train_data_spec",
]
