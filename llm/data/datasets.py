"""The datasets the loaders hand out: samples as tensors, and download failures said in one line.

`TokenDataset` yields each pretraining sample as a LongTensor of token ids; `SftDataset` yields the
token ids, the loss mask (bool: the tokens to learn) and the segments (the example each token
belongs to, 0 = padding) of an SFT sample (shards/FORMAT.md). Both turn a failure of streaming's
download threads into one `StorageError` line, with the traceback in the run folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from streaming import StreamingDataset

from llm.data.shared_memory import track
from llm.data.verified_stream import CorruptShard
from storage import RetryPolicy, StorageError


class TokenDataset(StreamingDataset):
    """A StreamingDataset whose samples are LongTensors of token ids."""

    error_log: str | None = None  # where the download threads' tracebacks go (the run folder)
    _failure: BaseException | None = None  # the first error of a download thread

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        track(self)  # its shared memory released at a fast exit (llm.data.shared_memory)

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = super().__getitem__(index)
        # Decoded arrays are read-only views into the shard: copy while widening to int64.
        return torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64))

    def __iter__(self):
        # When a download thread fails, streaming sets its event and ends the epoch early, without
        # an error (the next epoch's start would raise "Background thread failed"): say so here.
        try:
            yield from super().__iter__()
        except RuntimeError as err:
            if "Background thread failed" not in str(err):
                raise
            raise self._download_failed() from None
        event = getattr(self, "_event", None)
        if event is not None and event.is_set():
            raise self._download_failed()

    # streaming 0.13 ends an epoch by waiting until its two background threads (download ahead,
    # wait for shards) have each counted their exit, but a thread that raises never counts it: when
    # both fail on a dead remote (each downloads shards), the main thread waits forever (seen in
    # CI). A failing thread counts its exit here, so the epoch ends and the error above is raised.
    # Its error is kept for that message and its traceback goes to the run folder's log, not to
    # the console (streaming's future callback would print it there, once per thread).
    def _prepare_thread(self, it) -> None:
        try:
            super()._prepare_thread(it)
        except BaseException as err:
            self._thread_failed(it, err)

    def _ready_thread(self, it) -> None:
        try:
            super()._ready_thread(it)
        except BaseException as err:
            self._thread_failed(it, err)

    def _thread_failed(self, it, err: BaseException) -> None:
        import threading
        import traceback

        if self._failure is None:
            self._failure = err
        it.on_exit()
        if self.error_log:
            try:
                Path(self.error_log).parent.mkdir(parents=True, exist_ok=True)
                with open(self.error_log, "a") as f:
                    f.write(f"--- {threading.current_thread().name}, pid {os.getpid()}\n")
                    f.write("".join(traceback.format_exception(err)))
            except OSError:
                pass
        self._event.set()  # the other thread and the main loop stop

    def _download_failed(self) -> StorageError:
        failure = self._failure
        details = f" (traceback in {self.error_log})" if self.error_log else ""
        if isinstance(failure, CorruptShard):
            return CorruptShard(f"reading the training data failed: {failure}{details}")
        if isinstance(failure, StorageError):
            cause = str(failure)
        elif failure is not None:
            cause = f"{type(failure).__name__}: {' '.join(str(failure).split())}"
        else:
            cause = f"a shard could not be fetched or did not verify ({RetryPolicy.from_env().describe()})"
        return StorageError(
            f"reading the training data failed: {cause}{details}. The last stored checkpoint is "
            "intact: fix the storage and re-run the same command to resume"
        )


class SftDataset(TokenDataset):
    """SFT samples: token ids, the loss mask and the segment of every position, as tensors."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = StreamingDataset.__getitem__(self, index)
        return {
            "input_ids": torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64)),
            "loss_mask": torch.from_numpy(np.asarray(sample["loss_mask"]).astype(np.bool_)),
            "segments": torch.from_numpy(np.asarray(sample["segments"]).astype(np.int32)),
        }
