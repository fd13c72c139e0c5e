"""Experiment trackers: a real MLflow server on loopback, W&B offline, TensorBoard; resumes and outages."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from contextlib import contextmanager

import pytest

from llm.errors import ConfigError
from tests.support.resume import MAX_BATCHES, interrupt, run, write_recipe
from tests.support.trackers import MLflowServer, wandb_history
from tests.support.training import load, read_metrics
from tests.support.training import write_recipe as write_train_recipe


@pytest.mark.slow  # an MLflow server and W&B's service process
def test_one_run_reaches_mlflow_wandb_and_tensorboard(
    tmp_path, train_data, mlflow_server, monkeypatch, capsys
):
    from llm.trainer import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-env"))
    recipe = write_train_recipe(
        tmp_path / "r.yaml",
        train_data,
        callbacks={"generate": {"prompts": ["中国"], "interval": "12ba", "max_new_tokens": 8}},
        loggers={
            "progress_bar": False,
            "tensorboard": True,
            "mlflow": {"enabled": True, "tracking_uri": mlflow_server.uri, "experiment_name": "one-run"},
            "wandb": {"enabled": True, "mode": "offline", "dir": str(tmp_path / "wandb"), "project": "t"},
        },
    )
    result = train(load(recipe))
    out = capsys.readouterr().out
    run_dir = tmp_path / "run"

    # MLflow: one finished run named after the recipe, its config as params, every step, the files.
    (found,) = mlflow_server.runs("one-run")
    assert found.info.status == "FINISHED" and found.info.run_name == "test"
    assert found.data.params["optimizer.lr"] == "0.003" and found.data.params["model.dim"] == "64"
    assert found.data.tags["run_name"] == "test"
    run_id = found.info.run_id
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"] == run_id
    assert mlflow_server.steps(run_id, "loss/train/total") == list(range(24))
    assert mlflow_server.steps(run_id, "metrics/eval/LanguageCrossEntropy") == [12, 24]
    assert (
        "time/remaining_estimate" in found.data.metrics and "throughput/tokens_per_sec" in found.data.metrics
    )
    artifacts = {a.path for a in mlflow_server.client().list_artifacts(run_id)}
    assert {"loss.png", "samples.jsonl", "metrics.jsonl", "config.yaml"} <= artifacts, artifacts
    assert "[mlflow]" not in out  # no warning: the server was up all along

    # W&B offline: the run files hold the same steps under the id kept in trackers.json.
    wandb_id = json.loads((run_dir / "trackers.json").read_text())["wandb_run_id"]
    history = wandb_history(tmp_path / "wandb", wandb_id)
    assert sorted(r["_step"] for r in history if "loss/train/total" in r) == list(range(24))
    files = next((tmp_path / "wandb").glob(f"wandb/offline-run-*-{wandb_id}/files"))
    assert (files / "loss.png").exists() and (files / "samples.jsonl").exists()

    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    # Time to finish on the console: tokens/s and the estimated time left, every log_interval.
    progress = [line for line in out.splitlines() if line.startswith("[progress] step 20/24")]
    assert progress and "tokens/s" in progress[0] and "ETA " in progress[0], out[-3000:]
    assert all(r.get("eta_seconds", 0) >= 0 for r in read_metrics(run_dir / "metrics.jsonl"))
    assert "eta_seconds" in read_metrics(run_dir / "metrics.jsonl")[-2]
    # The first and the last samples, side by side, at the end.
    assert "samples, first generation (step 12) and last (step 24):" in out
    assert result.step == 24


def _tracked(uri: str, experiment: str, **extra) -> list[str]:
    """Overrides that send the harness's tiny run to the MLflow server at `uri`."""
    settings = {
        "loggers.metrics_file": "true",
        "loggers.mlflow.enabled": "true",
        "loggers.mlflow.tracking_uri": uri,
        "loggers.mlflow.experiment_name": experiment,
        "loggers.mlflow.flush_interval": "0.5",
        **extra,
    }
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_resumed_continues_the_same_tracker_runs(
    tmp_path, shards, mlflow_server
):
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    wandb_dir = tmp_path / "wandb"
    overrides = _tracked(
        mlflow_server.uri,
        "resumed",
        **{
            "loggers.wandb.enabled": "true",
            "loggers.wandb.mode": "offline",
            "loggers.wandb.dir": str(wandb_dir),
        },
    )
    first = interrupt(recipe, "first", cwd=tmp_path, at_batch=5, sig=signal.SIGTERM, overrides=overrides)
    assert first.returncode == 143, first.output[-4000:]
    stop = first.batches()[-1]["batch"]
    (after_first,) = mlflow_server.runs("resumed")
    assert after_first.info.status == "KILLED"  # stopped, not finished: the resumed run reopens it

    second = run(recipe, "second", cwd=tmp_path, overrides=overrides)
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming run 'rs' from the checkpoint at batch {stop}" in second.output

    (found,) = mlflow_server.runs("resumed")  # the same run, not a second one
    assert found.info.run_id == after_first.info.run_id and found.info.status == "FINISHED"
    # Composer logs the train loss before the batch counter moves (steps 0..11), the rate after it.
    assert mlflow_server.steps(found.info.run_id, "loss/train/total") == list(range(MAX_BATCHES))
    lr_key = next(k for k in found.data.metrics if k.startswith("lr-"))
    assert mlflow_server.steps(found.info.run_id, lr_key) == list(range(1, MAX_BATCHES + 1))
    for key in ("time/batch", "time/sample", "time/token", "time/batch_in_epoch", "time/token_in_epoch"):
        steps = mlflow_server.steps(found.info.run_id, key)
        assert steps == sorted(set(steps)) and stop in steps, (key, steps)  # once each, the resume step too
    # The resumed process estimated its own time to the end.
    assert "ETA " in next(
        line for line in second.output.splitlines() if line.startswith(f"[progress] step {stop + 2}/")
    )

    ids = json.loads((recipe.parent / "runs" / "rs" / "trackers.json").read_text())
    assert ids["mlflow_run_id"] == found.info.run_id
    runs = sorted(wandb_dir.glob(f"wandb/offline-run-*-{ids['wandb_run_id']}"))
    assert len(runs) == 2  # one offline folder per process, one W&B run id
    steps = [r["_step"] for r in wandb_history(wandb_dir, ids["wandb_run_id"]) if "loss/train/total" in r]
    assert sorted(steps) == list(range(MAX_BATCHES))


@pytest.mark.slow
def test_an_mlflow_server_that_goes_away_mid_run_is_caught_up(tmp_path, shards, mlflow_server):
    """The server goes away (connections refused, as from a killed server) and comes back."""
    from scenarios.proxy import Proxy
    from tests.support.resume import release, start, wait_for_batch, wait_for_line

    proxy = Proxy(mlflow_server.port)
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    # A long close_timeout: on a loaded machine the server may come back after the last step; the
    # run's end then waits for it and sends what waited. Shorter than the wait below, so a run that
    # never catches up ends by itself and its log shows why.
    overrides = [
        *_tracked(proxy.endpoint, "outage"),
        "training.max_duration=40ba",
        "loggers.mlflow.close_timeout=120",
    ]
    # The run holds at batch 3 while the server goes away, and at 12 until it has said so.
    proc, record, _ = start(recipe, "outage", cwd=tmp_path, overrides=overrides, pause_at=(3, 12))
    with _killed_if_left(proc, proxy):
        wait_for_batch(record, 3, proc)
        proxy.down()
        release(record, 3)
        wait_for_batch(record, 12, proc)
        wait_for_line(proc.tag_log, "[mlflow] WARNING cannot reach", proc)
        proxy.up()  # same port, same server and database
        release(record, 12)
        proc.wait(timeout=300)
    output = _output_of_clean_exit(proc)
    warnings = [line for line in output.splitlines() if line.startswith("[mlflow] WARNING cannot reach")]
    assert len(warnings) == 1, output[-4000:]
    assert "training goes on" in warnings[0]
    assert "caught up" in output
    (found,) = mlflow_server.runs("outage")
    assert found.info.status == "FINISHED"
    assert mlflow_server.steps(found.info.run_id, "loss/train/total") == list(range(40))


@pytest.mark.parametrize("status", [403, 503])
def test_a_server_that_answers_but_refuses_to_the_end_is_named_so(
    tmp_path, mlflow_server, monkeypatch, capsys, status
):
    """A server may come back refusing (an expired token: 401/403, a deleted run: 404, an overloaded
    server: 503): the points
    wait as in an outage, and the lines say what it answered instead of "did not answer". The
    tracker itself, in this process, against the real server behind the proxy."""
    from llm.config import MLflowConfig
    from llm.loggers import MLflowTracker, TrackerIds
    from scenarios.proxy import Proxy

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    proxy = Proxy(mlflow_server.port)
    settings = MLflowConfig(
        enabled=True,
        tracking_uri=proxy.endpoint,
        experiment_name=f"refusing-{status}",
        flush_interval=0.2,
        close_timeout=1,
    )
    tracker = MLflowTracker(
        settings, "refusing", tmp_path, TrackerIds(tmp_path / "trackers.json"), {"seed": 1}
    )
    try:
        tracker._start_mlflow_run(None)
        tracker.log_metrics({"loss/train/total": 5.0}, step=0)
        (run,) = mlflow_server.runs(f"refusing-{status}")
        deadline = time.monotonic() + 60
        while mlflow_server.steps(run.info.run_id, "loss/train/total") != [0]:
            assert time.monotonic() < deadline, "step 0 never reached the server"
            time.sleep(0.2)
        proxy.set("error", errors=10**9, status=status)
        for step in range(1, 6):
            tracker.log_metrics({"loss/train/total": 5.0 - step}, step=step)
        tracker.post_close()
    finally:
        proxy.cut()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[mlflow] WARNING")]
    assert len(lines) == 2, lines
    assert f"refuses the requests (HTTP {status}" in lines[0] and "training goes on" in lines[0], lines[0]
    assert f"refused the requests until 1 s after the end (HTTP {status}" in lines[1], lines[1]
    assert "5 metric points (steps 1-5)" in lines[1] and "did not answer" not in lines[1], lines[1]
    assert mlflow_server.steps(run.info.run_id, "loss/train/total") == [0]


@contextmanager
def _killed_if_left(proc, proxy=None):
    """The run is killed (and the proxy cut) if the block ends with it still running."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
        if proxy is not None:
            proxy.cut()


def _output_of_clean_exit(proc) -> str:
    output = proc.tag_log.read_text()
    assert proc.returncode == 0, output[-4000:]
    return output


def _wait_until(ready, proc, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_points_the_server_stored_without_answering_are_sent_again_and_the_run_catches_up(
    tmp_path, shards, mlflow_server
):
    """A server that comes back may store a request and lose its answer (the client times out): the
    outbox sends those points again and the server must take them. MLflow refused such a resend of
    over 100 points (a 400), and the run retried it until the end and never caught up."""
    from scenarios.proxy import Proxy
    from tests.support.resume import release, start, wait_for_batch, wait_for_line

    proxy = Proxy(mlflow_server.port)
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    overrides = [
        *_tracked(proxy.endpoint, "lost-answer"),
        "training.max_duration=16ba",
        "loggers.mlflow.close_timeout=30",
    ]
    short = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    proc, record, _ = start(recipe, "lost", cwd=tmp_path, overrides=overrides, pause_at=(3, 12), env=short)
    with _killed_if_left(proc, proxy):
        wait_for_batch(record, 3, proc)
        (run,) = mlflow_server.runs("lost-answer")
        proxy.set("hang")  # no answers: steps 3-12 wait in the outbox
        release(record, 3)
        wait_for_batch(record, 12, proc)
        wait_for_line(proc.tag_log, "[mlflow] WARNING cannot reach", proc)
        proxy.set("slow", delay=120)  # requests reach the server again; their answers are held
        _wait_until(
            lambda: set(range(12)) <= set(mlflow_server.steps(run.info.run_id, "loss/train/total")),
            proc,
            "the waiting points stored on the server",
        )
        proxy.set("pass")
        release(record, 12)
        proc.wait(timeout=120)
    output = _output_of_clean_exit(proc)
    caught_up = re.search(r"the (\d+) metric points that waited were sent \(caught up\)", output)
    assert caught_up and int(caught_up[1]) > 100, output[-4000:]  # one resend of over 100 points
    assert "did not answer" not in output and "refused" not in output, output[-4000:]
    (found,) = mlflow_server.runs("lost-answer")
    assert found.info.status == "FINISHED"
    assert mlflow_server.steps(run.info.run_id, "loss/train/total") == list(range(16))  # each step once


def _params_settled(server, run_id: str, quiet_s: float = 1.5) -> bool:
    """The run's params on the server, and no more arriving for `quiet_s` (3 flush intervals)."""
    before = len(server.client().get_run(run_id).data.params)
    time.sleep(quiet_s)
    return before > 0 and len(server.client().get_run(run_id).data.params) == before


@pytest.mark.slow
def test_points_a_frozen_server_may_have_are_not_counted_as_not_sent(tmp_path, shards, mlflow_server):
    """A server frozen to the end (accepts, reads, never answers) may store what it is sent: the end's
    line counts those points as sent without an answer, not as not sent."""
    from scenarios.proxy import Proxy
    from tests.support.resume import release, start, wait_for_batch

    proxy = Proxy(mlflow_server.port)
    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    overrides = [*_tracked(proxy.endpoint, "frozen"), "loggers.mlflow.close_timeout=2"]
    short = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    proc, record, _ = start(recipe, "frozen", cwd=tmp_path, overrides=overrides, pause_at=(3, 8), env=short)
    with _killed_if_left(proc, proxy):
        wait_for_batch(record, 3, proc)
        (run,) = mlflow_server.runs("frozen")
        # The recipe's params take two requests (over MLflow's 100 a request): let both be answered
        # before the freeze, or the second is rightly reported not sent.
        _wait_until(lambda: _params_settled(mlflow_server, run.info.run_id), proc, "the params stored")
        proxy.set("slow", delay=3600)  # frozen to the end: requests arrive, answers never come back
        answered = set(mlflow_server.steps(run.info.run_id, "loss/train/total"))  # stored before it
        release(record, 3)
        wait_for_batch(record, 8, proc)
        _wait_until(
            lambda: set(mlflow_server.steps(run.info.run_id, "loss/train/total")) - answered,
            proc,
            "a request after the freeze stored on the server",
        )
        release(record, 8)
        proc.wait(timeout=120)
    output = _output_of_clean_exit(proc)
    (end,) = [line for line in output.splitlines() if "did not answer within 2 s at the end" in line]
    # Every point went out in a request that got no answer: none is said to be not sent.
    assert "the record files were not sent" in end and "params were not sent" not in end, end
    no_answer = re.search(
        r"\d+ metric points \(steps (\d+)-(\d+)\) and \d+ params were sent but got no answer", end
    )
    assert no_answer, end
    on_server = set(mlflow_server.steps(run.info.run_id, "loss/train/total")) - answered
    assert on_server and int(no_answer[1]) <= min(on_server) and max(on_server) <= int(no_answer[2])
    assert int(no_answer[2]) == MAX_BATCHES  # the last step's points too (the lr is logged after the batch)
    assert "metrics.jsonl has every logged step" in end


@pytest.mark.slow
def test_an_mlflow_server_that_is_down_from_the_start_costs_no_training_and_says_what_was_lost(
    tmp_path, shards
):
    from tests.support.s3server import free_port

    recipe = write_recipe(tmp_path / "recipe.yaml", shards, str(tmp_path / "ckpt"), cache=tmp_path / "cache")
    nobody = MLflowServer(tmp_path / "none", port=free_port())  # never started
    overrides = [*_tracked(nobody.uri, "down"), "loggers.mlflow.close_timeout=1"]
    result = run(recipe, "down", cwd=tmp_path, overrides=overrides)
    assert result.returncode == 0, result.output[-4000:]
    assert len(result.batches()) == MAX_BATCHES  # training went on
    lines = [line for line in result.output.splitlines() if line.startswith("[mlflow]")]
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith(f"[mlflow] WARNING cannot reach {nobody.uri}") and "training goes on" in lines[0]
    )
    assert "did not answer within 1 s at the end" in lines[1] and "steps 0-12" in lines[1], lines[1]
    assert "metrics.jsonl has every logged step" in lines[1]
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_tracker_that_is_not_installed_is_one_line_and_exit_2_before_any_work(
    tmp_path, train_data, monkeypatch, capsys
):
    import train

    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    monkeypatch.chdir(tmp_path)
    recipe = write_train_recipe(tmp_path / "r.yaml", train_data)
    assert train.main([str(recipe), "loggers.mlflow.enabled=true"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # Installed from the checkout into .venv, not from the package registry (issue 39)
    assert len(lines) == 1 and ".venv/bin/pip install -c constraints.txt -e '.[mlflow]'" in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing was started: no run folder, no config.yaml


def test_tracker_settings_are_checked_at_load(tmp_path, train_data):
    recipe = write_train_recipe(tmp_path / "r.yaml", train_data)
    with pytest.raises(ConfigError, match="loggers.wandb.mode='sometimes' is not one of"):
        load(recipe, "loggers.wandb.mode=sometimes")
    with pytest.raises(
        ConfigError, match="unknown key 'loggers.mlflow.trackinguri': did you mean 'tracking_uri'"
    ):
        load(recipe, "loggers.mlflow.trackinguri=http://x")
