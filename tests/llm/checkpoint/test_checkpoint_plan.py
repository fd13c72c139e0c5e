"""The checkpointing entry point: callbacks come in the one order that works, or the build fails;
the save and staging folders are checked before training; the background uploader on its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver, LRMonitor
from torch.utils.data import DataLoader

from llm.checkpoint.lock import LOCK_FILE
from llm.checkpoint.plan import RestartTimings, RunLockCallback, check_save_folder, plan_checkpointing
from llm.checkpoint.preemption import PreemptionCallback
from llm.checkpoint.publisher import CheckpointPublisher
from llm.checkpoint.resume import RunAlreadyComplete
from llm.checkpoint.saver import Saver
from llm.checkpoint.uploader import Deadline, Uploader, run_bounded
from llm.composer_model import LanguageModel
from llm.config import load_config
from llm.errors import ConfigError
from llm.model import ModelConfig, count_params
from storage import open_store

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)


def build(callbacks) -> Trainer:
    model = LanguageModel.from_config(CFG, seed=1)
    data = DataLoader([{"input_ids": torch.randint(0, 64, (9,))} for _ in range(4)], batch_size=2)
    return Trainer(
        model=model,
        train_dataloader=data,
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        callbacks=callbacks,
        progress_bar=False,
    )


def recipe(tmp_path, **overrides):
    path = tmp_path / "r.yaml"
    path.write_text(
        "run_name: plan\nmodel: {vocab_size: 64, dim: 32, n_layers: 1, n_heads: 2, max_seq_len: 16}\n"
        "tokenizer: {path: t.model}\ndata: {train: [{remote: x}]}\n"
    )
    return load_config(str(path), [f"{k}={v}" for k, v in overrides.items()])


def test_the_plan_puts_saver_publisher_lock_and_preemption_last_in_that_order(tmp_path):
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck")})
    plan = plan_checkpointing(cfg, rank=0, world_size=1)
    others = [LRMonitor()]
    callbacks = plan.callbacks_after(others)
    assert [type(c) for c in callbacks] == [
        LRMonitor,
        Saver,
        CheckpointPublisher,
        RunLockCallback,
        RestartTimings,
        PreemptionCallback,
    ]
    assert plan.trainer_kwargs["save_folder"] is None and plan.trainer_kwargs["autoresume"] is False
    assert (tmp_path / "ck" / LOCK_FILE).is_file()  # rank 0 holds the folder's run lock
    build(callbacks).close()  # the right order builds; closing the Trainer releases the lock
    assert not (tmp_path / "ck" / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="PreemptionCallback must come from plan_checkpointing"):
        plan.callbacks_after([PreemptionCallback()])


def test_a_wrong_order_fails_when_the_trainer_is_built(tmp_path):
    with pytest.raises(RuntimeError, match="PreemptionCallback must be the last callback"):
        build([PreemptionCallback(), LRMonitor()])
    saver = CheckpointSaver(folder=str(tmp_path / "ck"))
    publisher = CheckpointPublisher(open_store(tmp_path / "ck"), str(tmp_path / "ck"), num_to_keep=1)
    with pytest.raises(RuntimeError, match="right after Composer's CheckpointSaver"):
        build([publisher, saver, PreemptionCallback()])
    with pytest.raises(RuntimeError, match="right after Composer's CheckpointSaver"):
        build([saver, LRMonitor(), publisher, PreemptionCallback()])


def test_run_already_complete_is_a_plain_exception_that_prints_nothing(capsys):
    err = RunAlreadyComplete("run 'x' already finished")
    assert not isinstance(err, SystemExit) and str(err) == "run 'x' already finished"
    assert capsys.readouterr() == ("", "")


@pytest.fixture
def read_only(tmp_path):
    """A folder nobody may write into, root included (`chattr +i` as root, else mode 0555)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
            pytest.skip("running as root without chattr +i: no way to make a folder read-only")
        yield folder
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def test_a_read_only_save_folder_is_refused_before_training(tmp_path, read_only):
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(read_only / "ckpt")})
    with pytest.raises(ConfigError, match=r"checkpoint\.save_folder=.*/ro/ckpt cannot be written \(.*ro"):
        plan_checkpointing(cfg, rank=0, world_size=1)
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(read_only)})  # the folder itself
    with pytest.raises(ConfigError, match="cannot be written"):
        plan_checkpointing(cfg, rank=0, world_size=1)


def _model_taking(checkpoint_bytes: float) -> str:
    """A recipe's `model` whose checkpoint (12 bytes a parameter) takes about `checkpoint_bytes`:
    blocks of dim 1024 (151 MB of checkpoint each) keep it within 1% at any size over 15 GB.
    Blocks of dim 4096 (2.4 GB each) once overshot by a block, and a test of "three fit" failed."""
    one = count_params(ModelConfig(vocab_size=64, dim=1024, n_layers=1, n_heads=16, max_seq_len=16))
    layers = max(1, round((checkpoint_bytes / 12 - one.root) / one.block))
    return f"{{vocab_size: 64, dim: 1024, n_layers: {layers}, n_heads: 16, max_seq_len: 16}}"


def test_a_save_folder_without_room_for_one_checkpoint_is_refused_before_training(tmp_path):
    model = _model_taking(2 * shutil.disk_usage(tmp_path).free)  # twice the disk's free space
    # No snapshot: a model this large would be refused first for the host memory its snapshot takes.
    cfg = recipe(
        tmp_path,
        **{"checkpoint.save_folder": str(tmp_path / "ck"), "model": model, "checkpoint.snapshot": "false"},
    )
    with pytest.raises(ConfigError, match=r"iB free, but this rank's checkpoints need at least"):
        plan_checkpointing(cfg, rank=0, world_size=1)
    assert not (tmp_path / "ck" / LOCK_FILE).exists()  # refused before the lock was taken


def _big_model(tmp_path) -> str:
    """A model whose checkpoint takes about 3/4 of the free space on tmp_path's disk."""
    return _model_taking(0.75 * shutil.disk_usage(tmp_path).free)


def test_staging_without_room_for_two_checkpoints_is_refused_with_background_uploads(tmp_path):
    staging = tmp_path / "staging"
    over = {"checkpoint.staging_folder": str(staging), "model": _big_model(tmp_path)}
    store = open_store("s3://bucket/run")  # nothing is asked of the bucket before the staging check
    cfg = recipe(tmp_path, **over)
    with pytest.raises(
        ConfigError, match=r"checkpoint\.staging_folder=.*staging has .*iB free.*x 2: one uploading"
    ):
        check_save_folder(cfg, store)
    # One copy (synchronous uploads) fits: the same disk is enough without the second.
    check_save_folder(recipe(tmp_path, **over, **{"checkpoint.background_upload": "false"}), store)


def test_a_local_save_folder_needs_room_for_the_checkpoints_kept_and_the_one_being_written(tmp_path):
    """num_to_keep=2 keeps two checkpoints and writes a third before the oldest goes (issue 36)."""
    # A checkpoint of about 0.27 of the free space: three take 0.81 of it, four 1.08.
    model = _model_taking(0.27 * shutil.disk_usage(tmp_path).free)
    folder = tmp_path / "ck"
    store = open_store(folder)

    def settings(keep: int):
        return recipe(
            tmp_path, **{"checkpoint.save_folder": folder, "model": model, "checkpoint.num_to_keep": keep}
        )

    check_save_folder(settings(2), store)  # three fit
    with pytest.raises(
        ConfigError, match=r"x 4: checkpoint\.num_to_keep=3 kept and the next one being written"
    ):
        check_save_folder(settings(3), store)
    # A resume: what the folder's files take now is freed by the rotation, so it counts as room.
    folder.mkdir()
    with open(folder / "ep0-ba2-rank0.pt", "wb") as earlier:
        earlier.truncate(2 * 12 * count_params(settings(3).model).total)  # two checkpoints' bytes, sparse
    check_save_folder(settings(3), store)


def test_sizes_are_printed_in_a_unit_that_shows_them():
    """The staging check once said "has 0.0 GiB free, but one checkpoint ... needs 0.0 GiB"."""
    from llm.checkpoint.sizes import format_bytes

    assert format_bytes(0) == "0 B" and format_bytes(1000) == "1000 B"
    assert format_bytes(3 * 2**20 + 2**19) == "3.5 MiB" and format_bytes(45 * 2**20) == "45 MiB"
    assert format_bytes(10.5 * 2**30) == "10.5 GiB" and format_bytes(3 * 2**40) == "3 TiB"


def test_a_staging_folder_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    cfg = recipe(tmp_path, **{"checkpoint.staging_folder": str(tmp_path / "file" / "staging")})
    with pytest.raises(ConfigError, match=r"checkpoint\.staging_folder=.*file/staging cannot be written"):
        check_save_folder(cfg, open_store("s3://bucket/run"))


def test_a_wait_bound_that_is_not_positive_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.upload_wait_s=0.0 must be at least 1 second"):
        recipe(tmp_path, **{"checkpoint.upload_wait_s": "0"})


# --- the uploader alone (in-process) -------------------------------------------------------------


def test_one_upload_in_flight_at_a_time_and_a_failure_is_kept_for_the_training_thread():
    uploader, gate = Uploader(), threading.Event()
    first = uploader.start(4, gate.wait)
    with pytest.raises(RuntimeError, match="batch 4 is still pending"):
        uploader.start(8, lambda: None)
    assert not first.stored.is_set()
    gate.set()
    assert first.finished.wait(30) and first.error is None
    uploader.pending = None  # settled (the publisher's part)

    def broken():
        raise OSError("disk gone")

    failed = uploader.start(8, broken)
    assert failed.stored.wait(30) and isinstance(failed.error, OSError)


def test_every_upload_runs_in_its_own_thread_so_that_every_wait_for_it_is_bounded():
    uploader, threads, followed = Uploader(), [], []
    upload = uploader.start(4, lambda: threads.append(threading.current_thread()), followed.append)
    assert upload.finished.wait(30)
    assert threads and threads[0] is not threading.main_thread() and followed == [upload]


def test_the_end_has_one_deadline_and_a_bounded_wait_says_when_it_ran_out():
    gate, deadline = threading.Event(), Deadline()
    assert deadline.left() is None  # not started: no bound
    deadline.start(60)
    deadline.start(0)  # started once: the first save of the end sets it
    assert 50 < deadline.left() <= 60
    assert not run_bounded(gate.wait, 0.05)  # still running: the caller stops waiting
    gate.set()
    with pytest.raises(OSError, match="disk gone"):  # an error in time is the caller's
        run_bounded(lambda: (_ for _ in ()).throw(OSError("disk gone")), 30)


# --- the snapshot (llm/checkpoint/saver.py) ------------------------------------------------------


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change_and_its_buffers_are_reused():
    from llm.checkpoint.saver import HostStager

    trainer = build([])
    stager = HostStager()
    trainer.fit(duration="1ba")
    live = trainer.state.state_dict()
    staged = stager.stage({"state": live})
    taken = {k: v.clone() for k, v in staged["state"]["model"].items()}
    moments = staged["state"]["optimizers"]["AdamW"]["state"]
    first = next(iter(moments.values()))["exp_avg"].clone()
    buffers = {k: v.data_ptr() for k, v in staged["state"]["model"].items()}
    trainer.fit(duration="1ba")  # another step: the live weights and moments move on
    after = trainer.state.state_dict()
    assert all(torch.equal(staged["state"]["model"][k], taken[k]) for k in taken)  # the snapshot did not
    assert torch.equal(next(iter(moments.values()))["exp_avg"], first)
    assert any(not torch.equal(after["model"][k], taken[k]) for k in taken)
    again = stager.stage({"state": after})  # the next save: the same host buffers, the new state
    assert {k: v.data_ptr() for k, v in again["state"]["model"].items()} == buffers
    assert all(torch.equal(again["state"]["model"][k], after["model"][k]) for k in taken)
    assert stager.nbytes >= sum(v.numel() * 4 for v in taken.values())
    trainer.close()


def test_host_memory_a_snapshot_cannot_fit_is_refused_in_one_line(tmp_path):
    from llm.checkpoint.plan import check_host_memory, rank_checkpoint_bytes

    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck")})
    need = rank_checkpoint_bytes(cfg, 1)
    check_host_memory(cfg, 1, available=need)  # fits exactly
    with pytest.raises(ConfigError) as err:
        check_host_memory(cfg, 1, available=need - 1)
    message = str(err.value)
    assert "\n" not in message and "checkpoint.snapshot: the snapshots of a checkpoint take" in message
    assert "checkpoint.snapshot=false" in message
    check_host_memory(recipe(tmp_path, **{"checkpoint.snapshot": "false"}), 1, available=0)  # no snapshot


def test_host_memory_is_checked_against_the_nodes_memory_the_recipe_gives(tmp_path):
    from llm.checkpoint.plan import check_host_memory, rank_checkpoint_bytes

    need = rank_checkpoint_bytes(recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck")}), 1)
    plenty = 10 * need

    def node(gb: float):
        return recipe(
            tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck"), "checkpoint.node_memory_gb": gb}
        )

    check_host_memory(node(need / 1e9), 1, available=plenty)  # fits exactly
    with pytest.raises(ConfigError) as err:
        check_host_memory(node(need / 2e9), 1, available=plenty)
    message = str(err.value)
    assert (
        "\n" not in message and "more than the node's" in message and "checkpoint.node_memory_gb" in message
    )
    with pytest.raises(ConfigError, match=r"checkpoint.node_memory_gb=-1.0 must be positive"):
        node(-1)


def test_a_model_whose_snapshot_exceeds_this_machines_free_memory_is_refused_at_start(tmp_path):
    from llm.checkpoint.plan import memory_available

    available = memory_available()
    if available is None:
        pytest.skip("this platform does not say how much memory is free")
    # 1.5 x the free memory: host memory is checked before the disk, so any disk will do.
    model = _model_taking(1.5 * available)
    cfg = recipe(tmp_path, **{"checkpoint.save_folder": str(tmp_path / "ck"), "model": model})
    with pytest.raises(ConfigError, match=r"of host memory on this node .* available; free memory"):
        plan_checkpointing(cfg, rank=0, world_size=1)
    assert not (tmp_path / "ck" / LOCK_FILE).exists()  # refused before the lock was taken


def test_when_busy_skip_skips_a_save_while_the_previous_one_is_written_and_says_so(
    tmp_path, monkeypatch, capsys
):
    from composer.core import Callback

    import llm.checkpoint.saver as saver_module

    gate, real_write = threading.Event(), saver_module.write_file

    def held_write(state_dict, path):  # the write of batch 1 waits until batch 4 ends
        if "-ba1-" in str(path):
            assert gate.wait(60)
        real_write(state_dict, path)

    class ReleaseAt4(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 4:
                gate.set()

    monkeypatch.setattr(saver_module, "write_file", held_write)
    cfg = recipe(
        tmp_path,
        **{"checkpoint.save_folder": str(tmp_path / "ck"), "checkpoint.save_interval": "1ba"},
        **{"checkpoint.when_busy": "skip"},
    )
    plan = plan_checkpointing(cfg, rank=0, world_size=1)
    model = LanguageModel.from_config(CFG, seed=1)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(
            [{"input_ids": torch.randint(0, 64, (9,))} for _ in range(4)], batch_size=1
        ),
        max_duration="4ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        callbacks=plan.callbacks_after([ReleaseAt4()]),
        progress_bar=False,
    )
    trainer.fit()
    trainer.close()
    err = capsys.readouterr().err
    for batch in (2, 3):
        assert (
            f"[checkpoint] skipping the save at batch {batch}: the checkpoint at batch 1 is still being "
            "written or stored (checkpoint.when_busy=skip)"
        ) in err
    manifests = sorted(p.name for p in (tmp_path / "ck" / "manifests").iterdir())
    assert manifests == ["ba0000000001-rank00000.json", "ba0000000004-rank00000.json"]  # the last: waited for
