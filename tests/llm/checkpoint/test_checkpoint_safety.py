"""Reading checkpoints never runs code from them unless the user says --trust.

A crafted pickle whose unpickling creates a marker folder stands for any payload. A real Composer
0.32.1 checkpoint (a tiny Trainer's, with its RNG states) must still load as weights only.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from composer import Trainer
from torch.utils.data import DataLoader

from llm.checkpoint.plan import plan_checkpointing
from llm.commands import main as llm_main
from llm.composer_model import LanguageModel
from llm.config import load_config
from llm.errors import ConfigError
from llm.model import ModelConfig, Transformer
from llm.weights.composer_layout import save_composer_weights, strip_wrappers
from llm.weights.read import read_weights
from storage import open_store

VOCAB = 2000  # the session tokenizer's size, so `llm generate` can run on these checkpoints
CFG = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
MODEL_YAML = f"{{vocab_size: {VOCAB}, dim: 32, n_layers: 1, n_heads: 2, max_seq_len: 16}}"


class Payload:
    """Unpickling this creates the folder `marker`: the proof that a file's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def write_recipe(folder: Path, save_folder: Path | None = None) -> Path:
    path = folder / "recipe.yaml"
    save = f"checkpoint: {{save_folder: {save_folder}, save_interval: 1ba}}\n" if save_folder else ""
    path.write_text(
        f"run_name: safety\nmodel: {MODEL_YAML}\ntokenizer: {{path: t.model}}\ndata: {{train: [{{remote: x}}]}}\n"
        + save
    )
    return path


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A real run's checkpoint folder: a tiny Composer Trainer saving at batches 1 and 2."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = load_config(str(write_recipe(tmp, tmp / "ckpt")))
    plan = plan_checkpointing(cfg, rank=0, world_size=1)
    model = LanguageModel.from_config(CFG, seed=1)
    data = DataLoader([{"input_ids": torch.randint(0, VOCAB, (9,))} for _ in range(4)], batch_size=2)
    trainer = Trainer(
        model=model,
        train_dataloader=data,
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        callbacks=plan.callbacks_after([]),
        progress_bar=False,
        **plan.trainer_kwargs,
    )
    trainer.fit()
    final = {k: v.detach().clone() for k, v in strip_wrappers(trainer.state.model.state_dict()).items()}
    trainer.close()
    torch.save(final, tmp / "final.pt")
    return tmp / "ckpt"


def final_weights(run_folder: Path) -> dict:
    return torch.load(run_folder.parent / "final.pt", weights_only=True)


def crafted(path: Path, marker: Path) -> Path:
    """A checkpoint with real weights and, beside them, a payload."""
    state = {f"model.{k}": v for k, v in Transformer(CFG, seed=3).state_dict().items()}
    torch.save({"state": {"model": state}, "extra": Payload(marker)}, path)
    return path


def test_a_composer_checkpoint_loads_as_weights_only(run_folder):
    assert torch.serialization.get_unsafe_globals_in_checkpoint(run_folder / "ep0-ba2-rank0.pt")  # numpy, ...
    loaded = read_weights(str(run_folder)).tensors  # no trust: the allowlist is enough
    final = final_weights(run_folder)
    assert loaded.keys() == final.keys() and all(torch.equal(loaded[k], final[k]) for k in final)
    single = read_weights(str(run_folder / "ep0-ba2-rank0.pt")).tensors  # a file of the folder
    assert all(torch.equal(single[k], final[k]) for k in final)


@pytest.mark.parametrize("command", ["generate", "export", "import"])
def test_a_crafted_pickle_is_refused_by_every_command_and_its_code_never_runs(
    tmp_path, command, small_tokenizer, capsys
):
    marker = tmp_path / "payload-ran"
    evil = crafted(tmp_path / "evil.pt", marker)
    argv = {
        "generate": ["generate", str(evil), "--tokenizer", small_tokenizer, "--prompt", "中国"],
        "export": ["export", str(evil), "--out", str(tmp_path / "hf")],
        "import": ["import", "--from", "baby-llama2", str(evil), "--recipe", str(write_recipe(tmp_path))]
        + ["--out", str(tmp_path / "w.pt")],
    }[command]
    assert llm_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"{evil} holds pickled objects other than weights" in err and "mkdir" in err and "--trust" in err
    assert not marker.exists()


def test_trust_unpickles_in_full(tmp_path):
    marker = tmp_path / "payload-ran"
    evil = crafted(tmp_path / "evil.pt", marker)
    assert (
        llm_main(
            ["export", str(evil), "--out", str(tmp_path / "hf"), "--recipe", str(write_recipe(tmp_path))]
        )
        == 2
    )
    assert not marker.exists()
    assert (
        llm_main(
            [
                "export",
                str(evil),
                "--out",
                str(tmp_path / "hf"),
                "--recipe",
                str(write_recipe(tmp_path)),
                "--trust",
            ]
        )
        == 0
    )
    assert marker.is_dir()  # what --trust means: the file's code ran


def test_a_file_torch_cannot_read_is_one_line_too(tmp_path, run_folder):
    truncated = tmp_path / "ep0-ba2-rank0.pt"  # outside its run folder, so only torch can tell
    truncated.write_bytes((run_folder / "ep0-ba2-rank0.pt").read_bytes()[:5000])
    with pytest.raises(ConfigError, match=f"{truncated} is not a readable torch checkpoint"):
        read_weights(str(truncated))


def test_an_llm_import_output_and_a_baby_llama2_state_dict_need_no_trust(tmp_path):
    tensors = dict(Transformer(CFG, seed=4).state_dict())
    out = save_composer_weights(tensors, CFG, tmp_path / "imported.pt")
    loaded = read_weights(str(out))
    assert loaded.model_config == CFG and all(torch.equal(loaded.tensors[k], tensors[k]) for k in tensors)


def test_a_file_in_a_run_folder_must_match_its_manifest(tmp_path, run_folder, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(run_folder, folder)
    newest = folder / "ep0-ba2-rank0.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the recorded SHA-256 tells
    newest.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="does not match its recorded SHA-256"):
        read_weights(str(newest))

    stray = folder / "ep0-ba7-rank0.pt"  # e.g. what an interrupted save left: no manifest claims it
    shutil.copy(folder / "ep0-ba1-rank0.pt", stray)
    assert (
        llm_main(
            ["export", str(stray), "--out", str(tmp_path / "hf"), "--recipe", str(write_recipe(tmp_path))]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "is not a checkpoint that the manifests of its run folder record" in err and "--trust" in err
    assert read_weights(str(stray), trust=True).tensors  # the user's call


@pytest.mark.s3
def test_a_file_in_an_s3_run_folder_is_checked_against_its_manifest_too(run_folder, s3_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run")
    for path in sorted(run_folder.rglob("*")):
        if path.is_file():
            store.upload(path, path.relative_to(run_folder).as_posix())
    final = final_weights(run_folder)
    loaded = read_weights(store.url("ep0-ba2-rank0.pt")).tensors
    assert all(torch.equal(loaded[k], final[k]) for k in final)
    data = bytearray((run_folder / "ep0-ba2-rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.write_bytes("ep0-ba2-rank0.pt", bytes(data))
    with pytest.raises(ConfigError, match="does not match its recorded SHA-256"):
        read_weights(store.url("ep0-ba2-rank0.pt"))


def test_latest_json_pointing_outside_its_folder_is_never_followed(tmp_path, run_folder):
    marker = tmp_path / "payload-ran"
    evil = crafted(tmp_path / "evil.pt", marker)
    folder = tmp_path / "ckpt"
    shutil.copytree(run_folder, folder)
    (folder / "latest.json").write_text(
        json.dumps({"batch": 99, "load_path": "../evil.pt", "uri": str(evil)})
    )
    loaded = read_weights(str(folder)).tensors  # the folder's newest verified checkpoint instead
    final = final_weights(run_folder)
    assert all(torch.equal(loaded[k], final[k]) for k in final) and not marker.exists()

    only_pointer = tmp_path / "pointer-only"
    only_pointer.mkdir()
    (only_pointer / "latest.json").write_text(json.dumps({"batch": 99, "load_path": str(evil)}))
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        read_weights(str(only_pointer))
    assert not marker.exists()


def _sharded(folder: Path, state: dict) -> Path:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    _save_state_dict(state, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    return folder


def test_a_sharded_checkpoint_is_read_without_running_its_pickles(tmp_path, run_folder):
    full = torch.load(run_folder / "ep0-ba2-rank0.pt", weights_only=False)  # our own file: trusted
    good = _sharded(tmp_path / "good", {"state": full["state"], "rng": full["rng"]})
    loaded = read_weights(str(good)).tensors
    final = final_weights(run_folder)
    assert all(torch.equal(loaded[k], final[k]) for k in final)

    marker = tmp_path / "payload-ran"
    in_item = _sharded(tmp_path / "item", {"state": full["state"], "extra": Payload(marker)})
    with pytest.raises(ConfigError, match="mkdir.*--trust"):
        read_weights(str(in_item))
    assert not marker.exists()

    in_metadata = _sharded(tmp_path / "meta", {"state": {"model": full["state"]["model"]}})
    with open(in_metadata / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(ConfigError, match=r"\.metadata asks for .*mkdir.*--trust"):
        read_weights(str(in_metadata))
    assert not marker.exists()


def test_a_trusted_sharded_checkpoint_is_gathered_by_torch_in_full(tmp_path, run_folder):
    full = torch.load(run_folder / "ep0-ba2-rank0.pt", weights_only=False)  # our own file: trusted
    good = _sharded(tmp_path / "good", {"state": full["state"], "rng": full["rng"]})
    loaded = read_weights(str(good), trust=True).tensors  # torch's dcp_to_torch_save path
    final = final_weights(run_folder)
    assert loaded.keys() == final.keys() and all(torch.equal(loaded[k], final[k]) for k in final)

    marker = tmp_path / "payload-ran"
    in_item = _sharded(tmp_path / "item", {"state": full["state"], "extra": Payload(marker)})
    read_weights(str(in_item), trust=True)
    assert marker.is_dir()  # what --trust means: the file's code ran


@pytest.mark.parametrize("command", ["generate", "export", "import"])
def test_help_says_what_trust_means(command, capsys):
    with pytest.raises(SystemExit):
        llm_main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trust" in out and "can run code" in out
