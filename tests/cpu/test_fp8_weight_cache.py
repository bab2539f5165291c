"""``Float8Recipe(cache_weights=True)``: each weight cast once per state of the weight, on emulated ranks,
against the same layer casting at every call (bitwise the same outputs and gradients over micro-batches
of different sizes, an in-place change, a replaced weight, a change through ``.data`` refreshed)."""

import pytest

from support.scenarios import fp8_weight_cache as S
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("kind, scaling, world", [("moe", "tensorwise", 1), ("dense", "blockwise", 2)])
def test_weights_cast_once_per_state(kind, scaling, world):
    for phases in run_ranks(world, S.weight_cache_check, scaling, kind):
        for name, phase in phases.items():
            assert phase["equal"], (name, phase)
            assert phase["plain_casts"] > 0, (name, phase)  # the uncaching layer casts at every call
        # Two micro-batches a step: the uncaching layer casts each weight in each; the cached one once
        # per weight and orientation per state, none in a step whose weights did not change.
        first, same = phases["first step"], phases["same weights"]
        assert 0 < first["cached_casts"] <= first["plain_casts"] // 2, first
        assert same["cached_casts"] == 0, same
        for name in ("changed in place", "replaced", "changed through .data, refreshed"):
            assert 0 < phases[name]["cached_casts"] <= first["cached_casts"], (name, phases[name])
        # one weight replaced: only its casts are made again
        assert phases["replaced"]["cached_casts"] < first["cached_casts"], phases
