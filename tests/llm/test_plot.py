"""Loss plots from the records (never from checkpoints) and `llm plot`, comparing two real runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from llm.callbacks.generation import first_and_last_samples
from llm.commands import main as llm_main
from llm.plots import compare_figure, label_runs, load_run, run_figure
from tests.support.training import load, read_metrics, write_recipe


def _recipe(root, name: str, lr: float, train_data, run_name: str | None = None):
    return write_recipe(
        root / name / "r.yaml",
        train_data,
        run_name=run_name or name,
        run_dir=root / name / "run",
        optimizer={"lr": lr},
        training={
            "global_batch_size": 8,
            "device_microbatch_size": 8,
            "max_duration": "8ba",
            "eval_interval": "4ba",
            "eval_subset_num_batches": 2,
            "log_interval": 2,
        },
        checkpoint={"save_folder": str(root / name / "ckpt"), "save_interval": "8ba"},
        callbacks={"generate": {"enabled": False}, "speed_window": 2},
    )


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, train_data):
    """Two real 8-step runs that differ in their learning rate, with checkpoints."""
    from llm.trainer import train

    root = tmp_path_factory.mktemp("two-runs")
    runs = []
    for name, lr in (("slow", 1e-3), ("fast", 6e-3)):
        train(load(_recipe(root, name, lr, train_data)))
        runs.append(root / name / "run")
    return runs


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, train_data):
    """The slow run stopped by SIGTERM after batch 5 (between the logged steps 4 and 6): its
    metrics.jsonl then, and after the same recipe resumed it to the end."""
    import os
    import signal

    from composer.core import Callback

    from llm.trainer import train

    class SigtermAfter5(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    root = tmp_path_factory.mktemp("stopped")
    recipe = _recipe(root, "stopped", 1e-3, train_data, run_name="slow")
    with pytest.raises(SystemExit) as exit_:
        train(load(recipe), [SigtermAfter5()])
    assert exit_.value.code == 143
    metrics = root / "stopped" / "run" / "metrics.jsonl"
    at_stop = read_metrics(metrics)
    train(load(recipe))
    return root / "stopped" / "run", at_stop, read_metrics(metrics)


def test_the_loss_plot_is_drawn_from_the_records_against_tokens_with_the_rate_below(two_runs, train_data):
    run_dir = two_runs[0]
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    curves = load_run(str(run_dir))
    fig = run_figure(curves)
    loss_ax, lr_ax = fig.axes
    tokens = [r["tokens"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert list(loss_ax.lines[0].get_xdata()) == tokens == [s * 8 * train_data.seq_len for s in (2, 4, 6, 8)]
    assert lr_ax.get_xlabel() == "tokens" and lr_ax.get_ylabel() == "learning rate" and lr_ax.lines
    assert [line.get_label() for line in loss_ax.lines] == ["train", "train (smoothed)", "eval"]
    # Nothing of the curves travels in the checkpoint: the callbacks' state holds no loss history.
    (ckpt,) = (run_dir.parent / "ckpt").glob("ep*-ba8-rank0.pt")
    callbacks = torch.load(ckpt, map_location="cpu", weights_only=False)["state"]["callbacks"]
    assert "LossPlot" in callbacks and not callbacks["LossPlot"], callbacks["LossPlot"]


def test_llm_plot_compares_two_runs_in_one_figure_and_a_table(two_runs, tmp_path, capsys):
    out = tmp_path / "compare.png"
    code = llm_main(["plot", *map(str, two_runs), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    header, slow, fast = stdout.splitlines()[:3]
    assert header.split()[:3] == ["run", "steps", "tokens"] and "tokens/s" in header
    for line, name in ((slow, "slow"), (fast, "fast")):
        metrics = read_metrics(two_runs[0 if name == "slow" else 1] / "metrics.jsonl")
        cells = line.split()
        assert cells[0] == name and cells[1] == "8" and cells[2] == f"{metrics[-1]['tokens']:,}"
        assert float(cells[3]) == pytest.approx(metrics[-1]["loss"], abs=1e-4)
        assert float(cells[4]) == pytest.approx(
            next(r for r in metrics[::-1] if "eval_loss" in r)["eval_loss"], abs=1e-4
        )
        assert float(cells[5].replace(",", "")) > 0
    assert float(fast.split()[3]) < float(slow.split()[3])  # the higher rate learned faster here
    assert f"wrote {out}" in stdout


def test_runs_whose_losses_count_different_tokens_say_what_each_counts(two_runs, tmp_path, capsys):
    """An SFT loss (answer tokens only) once shared the axis with a pretraining loss (all tokens)
    unlabelled (issue 36). The SFT run's records: the fast run's metrics, its config's data.kind sft."""
    sft = tmp_path / "fast-sft"
    sft.mkdir()
    shutil.copy(two_runs[1] / "metrics.jsonl", sft / "metrics.jsonl")
    config = yaml.safe_load((two_runs[1] / "config.yaml").read_text(encoding="utf-8"))
    config["run_name"], config["data"]["kind"] = "fast-sft", "sft"
    (sft / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    assert llm_main(["plot", str(two_runs[0]), str(sft), "--out", str(tmp_path / "compare.png")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].startswith("slow (loss over all tokens) ")
    assert rows[2].startswith("fast-sft (loss over answer tokens only) ")
    runs = [load_run(str(two_runs[0])), load_run(str(sft))]
    label_runs(runs)
    legend = [t.get_text() for t in compare_figure(runs).axes[0].get_legend().get_texts()]
    assert legend == [
        "slow (loss over all tokens) train",
        "slow (loss over all tokens) eval",
        "fast-sft (loss over answer tokens only) train",
        "fast-sft (loss over answer tokens only) eval",
    ]
    same = [load_run(str(run)) for run in two_runs]  # runs of one kind keep their plain names
    label_runs(same)
    assert [run.label for run in same] == ["slow", "fast"]


def test_runs_of_different_tokenizers_are_labelled_with_theirs_and_a_note_says_so(two_runs, tmp_path, capsys):
    """Runs trained with different tokenizers shared one loss axis without a note (issue 39). The
    second run's records: the fast run's, its config naming another tokenizer file."""
    other = tmp_path / "other-tok"
    other.mkdir()
    shutil.copy(two_runs[1] / "metrics.jsonl", other / "metrics.jsonl")
    config = yaml.safe_load((two_runs[1] / "config.yaml").read_text(encoding="utf-8"))
    own = config["tokenizer"]["path"]
    (tmp_path / "other.model").write_bytes(b"another tokenizer's bytes")
    config["tokenizer"]["path"] = str(tmp_path / "other.model")
    (other / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    assert llm_main(["plot", str(two_runs[0]), str(other), "--out", str(tmp_path / "compare.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"slow (tokenizer {own}) ") and out[2].startswith(
        f"fast (tokenizer {tmp_path}/other.model) "
    )
    assert "note: these runs use different tokenizers" in out[3] and "do not compare" in out[3]
    runs = [load_run(str(two_runs[0])), load_run(str(other))]
    label_runs(runs)
    figure = compare_figure(runs)
    assert "different tokenizers" in figure.axes[0].get_title()
    assert "each run's tokenizer" in figure.axes[0].get_ylabel()
    # A copy of the same tokenizer under another path is the same tokenizer: no note.
    shutil.copy(own, tmp_path / "copy.model")
    config["tokenizer"]["path"] = str(tmp_path / "copy.model")
    (other / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    assert llm_main(["plot", str(two_runs[0]), str(other), "--out", str(tmp_path / "compare.png")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer" not in out and out.splitlines()[1].startswith("slow ")


def test_without_out_the_figure_goes_under_runs(two_runs, tmp_path, monkeypatch, capsys):
    """It once went to compare.png in the working folder (the repository's root)."""
    monkeypatch.chdir(tmp_path)
    assert llm_main(["plot", *map(str, two_runs)]) == 0
    assert "wrote runs/compare.png" in capsys.readouterr().out
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.png")] == ["runs/compare.png"]


def test_llm_plot_on_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert llm_main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path} is not a run" in err, err
    assert not (tmp_path / "x.png").exists()


def test_a_run_stopped_by_sigterm_is_drawn_to_its_checkpoint_not_its_last_logged_step(
    stopped, two_runs, tmp_path, capsys
):
    """`llm plot` drew an interrupted run to its last logged step (100) while its checkpoint was at
    108 (issue 39): the step it stopped at is now written, marked, and dropped again by the resume."""
    run_dir, at_stop, resumed = stopped
    assert [(r["step"], r.get("stopped")) for r in at_stop] == [(2, None), (4, None), (5, True)]
    assert at_stop[-1]["tokens"] == at_stop[0]["tokens"] * 5 // 2 and "loss" in at_stop[-1]
    # After the resume, the file is the uninterrupted run's, step for step (no line at 5).
    uninterrupted = read_metrics(two_runs[0] / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == [2, 4, 6, 8]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in uninterrupted], abs=1e-6)
    assert not any("stopped" in r for r in resumed)
    # Drawn to 5 while it stood there: the table's steps and the curve's last point.
    stopped_records = tmp_path / "at-stop"
    stopped_records.mkdir()
    lines = "".join(json.dumps(r) + "\n" for r in at_stop)
    (stopped_records / "metrics.jsonl").write_text(lines)
    shutil.copy(run_dir / "config.yaml", stopped_records / "config.yaml")
    assert llm_main(["plot", str(stopped_records), "--out", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["slow", "5"]
    curve = run_figure(load_run(str(stopped_records))).axes[0].lines[0]
    assert list(curve.get_xdata())[-1] == at_stop[-1]["tokens"]


def test_the_first_and_the_last_samples_are_put_side_by_side(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [
        {"step": 200, "prompt": "中国", "text": "1 2 3 4"},
        {"step": 200, "prompt": "北京", "text": "的的的"},
        {"step": 400, "prompt": "中国", "text": "人民 的 生活"},
        {"step": 600, "prompt": "中国", "text": "经济\n发展"},
        {"step": 600, "prompt": "北京", "text": "市 政府"},
    ]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert first_and_last_samples(path).splitlines() == [
        "samples, first generation (step 200) and last (step 600):",
        "  中国",
        "    step 200 | 1 2 3 4",
        "    step 600 | 经济 发展",
        "  北京",
        "    step 200 | 的的的",
        "    step 600 | 市 政府",
    ]
    path.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n")
    assert first_and_last_samples(path) == ""  # one generation: nothing to compare
