"""``TPMoE(fp8=...)`` on emulated ranks: for each recipe (tensorwise, rowwise, blockwise) the output, the
input gradient, both expert weight gradients and the router's gradient against float64 of the same
quantized math, written independently (``support.fp8_moe_layer_reference``), at one and two ranks, with
fresh tokens and routing per step, a straggling rank, the gathered input kept or gathered again; the
layer's refusals by name."""

import pytest

from support.moe_layer_scenarios import LayerCase, tp_moe_fp8_check, tp_moe_fp8_errors_check
from tileweave.testing.emulated import run_ranks

TOL = 1e-5  # float32 results of float8 products that match the reference's quantization

CASES = {
    "w1-blockwise": (1, "blockwise", LayerCase(tokens=6, hidden=128, ffn=128, experts=3, top_k=2, seed=21)),
    "w2-tensorwise-steps": (2, "tensorwise", LayerCase(tokens=10, hidden=32, ffn=48, experts=4, top_k=2, steps=2,
                                                       straggler=1, seed=22)),
    "w2-rowwise-regather": (2, "rowwise", LayerCase(tokens=6, hidden=32, ffn=80, experts=4, top_k=2,
                                                    save_gathered=False, policy="fallback", seed=23)),
    "w2-blockwise": (2, "blockwise", LayerCase(tokens=6, hidden=128, ffn=256, experts=2, top_k=2, seed=24)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tp_moe_fp8_matches_float64_of_the_same_quantized_math(name):
    world, recipe, case = CASES[name]
    for rank, result in enumerate(run_ranks(world, tp_moe_fp8_check, recipe, case)):
        assert result["gap"] > 0.5, ("the data must route unambiguously", result["gap"])
        assert len(result["steps"]) == case.steps
        for step, errors in enumerate(result["steps"]):
            for key in ("out", "dx", "d_w0", "d_w1", "d_router"):
                assert errors[key] < TOL, (name, rank, step, key, errors)
            assert 1e-3 < errors["out_exact"] < 0.2, (name, rank, step, errors)  # float8 ran: a few percent
        assert result["dtypes"] == [result["dtype"]], result["dtypes"]  # outputs and gradients in the model's
        expected = ("fallback", "fallback") if case.policy == "fallback" else ("fused", "chunked")
        assert result["paths"] == (("local", "local") if world == 1 else expected), result["paths"]


def test_tp_moe_fp8_refusals():
    found = run_ranks(2, tp_moe_fp8_errors_check)[1]
    assert "fp8 blockwise scaling needs hidden and ffn/W to be multiples of 128" in found["blockwise hidden"], found
    assert "hidden = 96" in found["blockwise hidden"] and "ffn/W = 64" in found["blockwise ffn"], found
    assert "fp8 must be None, a Float8Recipe or one of" in found["recipe"], found
    assert "fp8 needs ops that take float8 arguments" in found["ops"], found
