"""`train.py` plus the gpu-check's probe: `python bench/gpu_check_driver.py RECIPE [key=value ...]`.

One training process of `make gpu-check` (bench/gpu_check.py starts it). Rank 0's probe writes
a JSON object to $LLM_GPU_CHECK_PROBE when the last batch ends: the seconds and tokens of the
batches after the first $LLM_GPU_CHECK_WARMUP (compilation, autotuning and the allocator's
warm-up excluded), the time the trainer waited for its data loader in them, the peak GPU memory,
the model's FLOPs per batch, the first and last loss. The clock is read after a device
synchronisation, at the end of the warm-up and at the end of the last batch only.

With $LLM_TEST_RECORD set it is the resume tests' driver instead (scenarios/resume_driver.py:
per-batch records and final weights). $LLM_GPU_CHECK_DETERMINISTIC=1 first asks torch for
deterministic kernels (warnings only where it has none), so a resumed run can be compared bit
for bit with an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from composer.core import Callback, State  # noqa: E402
from composer.loggers import Logger  # noqa: E402
from composer.utils import dist  # noqa: E402


class Probe(Callback):
    """Throughput, data-loader wait and peak memory of the timed batches (rank 0 writes)."""

    def __init__(self, out: str, warmup: int):
        self.out = out
        self.warmup = warmup
        self.started: float | None = None
        self.wait_started = 0.0
        self.data_wait = 0.0
        self.tokens = 0
        self.flops_per_batch = 0.0
        self.losses: list[float] = []

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self.wait_started = time.perf_counter()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self.started is not None:
            self.data_wait += time.perf_counter() - self.wait_started

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        loss = state.total_loss_dict.get("loss/train/total")
        if loss is not None:
            self.losses.append(float(loss))
        if batch == self.warmup:
            _sync(state)
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        self.tokens += state.batch["input_ids"].numel() * dist.get_world_size()
        model = getattr(state.model, "module", state.model)  # DDP wraps it; FSDP2 does not
        self.flops_per_batch = float(model.flops_per_batch(state.batch)) * dist.get_world_size()
        if batch == int(state.max_duration.value):
            _sync(state)
            self._write(state, batch, time.perf_counter() - self.started)

    def _write(self, state: State, batch: int, seconds: float) -> None:
        if dist.get_global_rank() != 0:
            return
        on_gpu = torch.cuda.is_available() and state.device.name == "gpu"
        result = {
            "timed_batches": batch - self.warmup,
            "seconds": seconds,
            "tokens": self.tokens,
            "data_wait_seconds": self.data_wait,
            "flops_per_batch": self.flops_per_batch,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
            "device_name": torch.cuda.get_device_name() if on_gpu else "cpu",
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
        }
        Path(self.out).write_text(json.dumps(result))


def _sync(state: State) -> None:
    if state.device.name == "gpu":
        torch.cuda.synchronize()


def main() -> int:
    if os.environ.get("LLM_GPU_CHECK_DETERMINISTIC") == "1":
        torch.use_deterministic_algorithms(True, warn_only=True)
    if os.environ.get("LLM_TEST_RECORD"):
        from scenarios import resume_driver

        return resume_driver.main()
    import train

    probe = Probe(os.environ["LLM_GPU_CHECK_PROBE"], int(os.environ.get("LLM_GPU_CHECK_WARMUP", "1")))
    return train.main(sys.argv[1:], extra_callbacks=[probe])


if __name__ == "__main__":
    sys.exit(main())
