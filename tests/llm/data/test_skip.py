"""Skip windows (`data.skip`): merged half-open windows of data batches, and the loader that drops them."""

from __future__ import annotations

import pytest
import torch

from llm.data.skip import SkippingLoader, SkipWindows
from llm.errors import ConfigError
from tests.support.training import load, write_recipe


def test_windows_are_half_open_merged_and_kept_in_order():
    windows = SkipWindows([[20, 25], [4, 9]])
    assert windows.as_lists() == [[4, 9], [20, 25]]
    assert [i in windows for i in (3, 4, 8, 9, 19, 20, 24, 25)] == [False, True, True, False] * 2
    assert windows.add(9, 12)  # touching: merged
    assert windows.add(15, 21)  # overlapping: merged
    assert not windows.add(5, 7)  # already skipped: nothing new
    assert not windows.add(7, 7)  # empty
    assert windows.as_lists() == [[4, 12], [15, 25]]
    assert windows.covers(15, 25) and windows.covers(4, 4) and not windows.covers(11, 16)


def test_the_loader_drops_the_batches_of_the_windows_and_counts_every_batch_it_takes():
    samples = [torch.tensor([i]) for i in range(20)]  # 10 batches of 2: batch k holds 2k, 2k + 1
    loader = SkippingLoader(samples, batch_size=2, windows=SkipWindows([[1, 3], [8, 12]]))
    loader.next_index = 0
    firsts = [int(batch[0]) // 2 for batch in loader]
    assert firsts == [0, 3, 4, 5, 6, 7]
    assert loader.next_index == 10 and len(loader) == 10
    # A resume at batch 4 of the next epoch: the loader counts on from there.
    loader.next_index = 12
    assert [int(b[0]) // 2 for b in loader][:3] == [0, 1, 2]  # indices 12, 13, 14: nothing skipped


@pytest.mark.parametrize(
    ("skip", "message"),
    [
        ("[[5,5]]", "data.skip.0=[5, 5] must be a window [from, to) of batches with 0 <= from < to"),
        ("[[7,3]]", "data.skip.0=[7, 3] must be a window"),
        ("[[1,2],[3]]", "data.skip.1=[3] must be a window"),
        ("[[-1,4]]", "data.skip.0=[-1, 4] must be a window"),
    ],
)
def test_a_bad_window_is_refused_in_one_line(tmp_path, train_data, skip, message):
    with pytest.raises(ConfigError) as err:
        load(write_recipe(tmp_path / "r.yaml", train_data), f"data.skip={skip}")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_recipe_windows_reach_the_training_loader(tmp_path, train_data):
    from llm.data import build_dataloader

    cfg = load(write_recipe(tmp_path / "r.yaml", train_data), "data.skip=[[2,5]]")
    loader = build_dataloader(cfg, "train", 8)
    assert isinstance(loader, SkippingLoader) and loader.windows.as_lists() == [[2, 5]]
    assert not isinstance(build_dataloader(cfg, "eval", 8), SkippingLoader)
