"""``Float8Recipe(cache_weights=True)``: each weight cast once per state of the weight, on emulated ranks,
against the same layer casting at every call (bitwise the same outputs and gradients over micro-batches
of different sizes, an in-place change, a replaced weight, a change through ``.data`` refreshed)."""

import pytest

from support.scenarios import fp8_weight_cache as S
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("kind, scaling, world", [("dense", "rowwise", 2)])
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


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_the_experts_and_blockwise_twin_casts_are_kept_per_weight_state(scaling):
    # The casts the MoE layer and the blockwise dense layers take (quantize_experts in both orientations,
    # Float8Recipe.weights' twin), made once per state of the weight: equal to a fresh cast, bit for bit,
    # and made again after an in-place change.
    import dataclasses

    import torch

    from tileweave.nn import fp8
    from tileweave.nn.fp8 import Float8Recipe
    from tileweave.nn.moe_fp8 import quantize_experts

    plain = getattr(Float8Recipe, scaling)()
    recipe = dataclasses.replace(plain, cache_weights=True)
    w = torch.nn.Parameter(torch.randn(2, 128, 256))
    dense = torch.nn.Parameter(torch.randn(128, 256))
    made = []
    quantize = fp8.quantize
    fp8.quantize = lambda x, *a, **k: made.append(x) or quantize(x, *a, **k)
    try:
        for step in range(2):
            for transpose in (False, True):  # the forward's cast of w [E, N, K], the backward's of w as [E, K, N]
                got = [quantize_experts(recipe, w, transpose=transpose) for _ in range(2)]
                want = quantize_experts(plain, w, transpose=transpose)
                assert all(torch.equal(a, b) for cast in got for a, b in zip(cast, want))
                assert got[0][0].data_ptr() == got[1][0].data_ptr()  # the second call took the kept cast
            if scaling == "blockwise":  # a dense layer's weight: both orientations from one pass, kept
                twin = [recipe.weights(dense) for _ in range(2)]
                assert twin[0] is twin[1] and torch.equal(twin[0][1].data, plain.weights(dense)[1].data)
            with torch.no_grad():
                w.mul_(0.5)  # the optimizer's step: every kept cast is stale
                dense.mul_(0.5)
        # Per step, each orientation cast once for the cached recipe and once for the plain one (and the
        # blockwise twin once each, on the view w[0]).
        casts = sum(1 for x in made if x is w)
        assert casts == 2 * 2 * 2, casts
    finally:
        fp8.quantize = quantize
