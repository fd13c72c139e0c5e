"""`composer -n 2 tests/support/drivers/callbacks_rank_driver.py OUT TOKENIZER TASK`: the task-eval and the generation
callbacks together on an FSDP2-sharded model, 4 steps, both called every 2.

Reads OUT/samples.pt; writes what each callback returned on this rank (OUT/rank<r>.json), the
callbacks' files under OUT/run, a sharded checkpoint at batch 4 (OUT/ckpt) and, from rank 0, the
gathered final weights (OUT/final_weights.pt).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from composer import Trainer  # noqa: E402
from composer.utils import FSDP2Config, dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from llm.callbacks.generation import GenerationCallback  # noqa: E402
from llm.callbacks.task_eval import TaskEvalCallback  # noqa: E402
from llm.composer_model import LanguageModel  # noqa: E402
from llm.config import EvalTasksCallbackConfig, GenerateCallbackConfig  # noqa: E402
from llm.model import ModelConfig  # noqa: E402

CFG = ModelConfig(vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=96, tie_embeddings=True)
PROMPTS = ["中国", "北京市经济"]


class RecordingEval(TaskEvalCallback):
    """Keeps every question's log-likelihoods of each call on this rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history: list[list[list[float]]] = []

    def run(self, state, logger):
        report = super().run(state, logger)
        self.history.append([q.loglikelihoods for t in report.tasks for q in t.questions])
        return report


class RecordingGeneration(GenerationCallback):
    """Keeps what each call generated on this rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history: list[list[str]] = []

    def run(self, state, logger):
        texts = super().run(state, logger)
        self.history.append(texts)
        return texts


def main(out_dir: str, tokenizer_path: str, task: str) -> None:
    out = Path(out_dir)
    data = [{"input_ids": s} for s in torch.load(out / "samples.pt")]
    model = LanguageModel.from_config(CFG, seed=5)
    tasks = EvalTasksCallbackConfig(tasks=[task], interval="2ba", shots=1, batch_size=2)
    scores = RecordingEval(tasks, tokenizer_path, out / "run")
    sampling = GenerateCallbackConfig(
        prompts=PROMPTS, interval="2ba", max_new_tokens=8, temperature=1.0, top_k=0, seed=3
    )
    texts = RecordingGeneration(sampling, tokenizer_path, out / "run")
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=2, sampler=dist.get_sampler(data, shuffle=False)),
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_duration="4ba",
        device="cpu",
        precision="fp32",
        parallelism_config={"fsdp": FSDP2Config(activation_checkpointing=False, state_dict_type="sharded")},
        callbacks=[scores, texts],
        progress_bar=False,
        save_folder=str(out / "ckpt"),
        save_interval="4ba",
    )
    assert isinstance(model.model.tok_embeddings.weight, DTensor)  # really sharded
    trainer.fit()
    recorded = {"scores": scores.history, "texts": texts.history}
    (out / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(recorded, ensure_ascii=False))
    full = {k: v.full_tensor() for k, v in model.model.state_dict().items()}  # collective
    if dist.get_global_rank() == 0:
        torch.save(full, out / "final_weights.pt")
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
