"""The task callback on an FSDP2-sharded model: both ranks score, agree, and rank 0 reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer import Trainer
from torch.utils.data import DataLoader

from llm.callbacks.task_eval import TaskEvalCallback
from llm.composer_model import LanguageModel
from llm.model import ModelConfig

CFG = ModelConfig(vocab_size=2000, dim=64, n_layers=2, n_heads=4, max_seq_len=96, tie_embeddings=True)


class Recording(TaskEvalCallback):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history: list[list[list[float]]] = []

    def run(self, state, logger):
        report = super().run(state, logger)
        self.history.append([q.loglikelihoods for t in report.tasks for q in t.questions])
        return report


def _driver(out_dir: str, tokenizer_path: str, task: str) -> None:
    """Run by `composer -n 2`: 4 FSDP2 steps, the tasks scored every 2 (batches split over ranks)."""
    from composer.utils import FSDP2Config, dist
    from torch.distributed.tensor import DTensor

    out = Path(out_dir)
    data = [{"input_ids": s} for s in torch.load(out / "samples.pt")]
    model = LanguageModel.from_config(CFG, seed=5)
    callback = Recording([task], "2ba", tokenizer_path, out / "run", shots=1, batch_size=2)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=2, sampler=dist.get_sampler(data, shuffle=False)),
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_duration="4ba",
        device="cpu",
        precision="fp32",
        parallelism_config={"fsdp": FSDP2Config(activation_checkpointing=False, state_dict_type="sharded")},
        callbacks=[callback],
        progress_bar=False,
    )
    assert isinstance(model.model.tok_embeddings.weight, DTensor)  # really sharded
    trainer.fit()
    (out / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(callback.history))
    full = {k: v.full_tensor() for k, v in model.model.state_dict().items()}  # collective
    if dist.get_global_rank() == 0:
        torch.save(full, out / "final_weights.pt")
    trainer.close()


@pytest.mark.slow
def test_under_fsdp2_both_ranks_score_the_same_and_rank_zero_writes(
    tmp_path, small_tokenizer, chinese_documents
):
    from convert.demo_tasks import write_demo_tasks
    from llm.eval.harness import load_tasks, prepare, run
    from llm.model import Transformer
    from shards.tokenizer import Tokenizer

    tok = Tokenizer(small_tokenizer)
    ids = [t for doc in chinese_documents[:20] for t in tok.encode(doc) + [tok.eos_id]]
    torch.save(torch.tensor(ids[: 8 * 33]).view(8, 33), tmp_path / "samples.pt")
    task = str(tmp_path / "zh-demo")
    write_demo_tasks(task, questions=5)
    launcher = str(Path(sys.executable).parent / "composer")
    result = subprocess.run(
        [launcher, "-n", "2", __file__, str(tmp_path), small_tokenizer, task],
        cwd=tmp_path,
        env={**os.environ, "FSDP_VERSION": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert len(rank0) == 2 and rank0 == rank1  # steps 2 and 4, every score on both ranks
    rows = [json.loads(line) for line in (tmp_path / "run" / "tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 4, 4]  # written once, by rank 0

    # The same scores as one process scoring the final (gathered) weights.
    model = Transformer(CFG)
    model.load_state_dict(torch.load(tmp_path / "final_weights.pt"))
    prepared = prepare(load_tasks([task]), tok, 1, tok.start_id)
    alone = [q.loglikelihoods for t in run(model.eval(), prepared).tasks for q in t.questions]
    assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(alone, rank0[-1], strict=True))


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2], sys.argv[3])
