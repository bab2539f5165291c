"""How many ranks the GPU tests start (``tileweave.testing.emulated.gpu_ranks``)."""

import random

import pytest
import torch

from tileweave.testing.emulated import GPU_RANKS_ENV, gpu_ranks


def test_one_rank_per_visible_gpu_by_default(monkeypatch):
    monkeypatch.delenv(GPU_RANKS_ENV, raising=False)
    assert gpu_ranks() == torch.cuda.device_count()


def test_the_variable_sets_the_ranks(monkeypatch):
    ranks = random.randint(1, 64)
    monkeypatch.setenv(GPU_RANKS_ENV, str(ranks))
    assert gpu_ranks() == ranks


@pytest.mark.parametrize("value", ["0", "two", "-2", "1.5"])
def test_a_bad_value_is_named(monkeypatch, value):
    monkeypatch.setenv(GPU_RANKS_ENV, value)
    with pytest.raises(ValueError, match=f"{GPU_RANKS_ENV}='{value}'"):
        gpu_ranks()
