"""``TPMoE(fp8=...)`` on emulated ranks: for each recipe (tensorwise, rowwise, blockwise) the output, the
input gradient, both expert weight gradients and the router's gradient against float64 of the same
quantized math, written independently (``support.fp8_moe_layer_reference``), at one and two ranks, with
fresh tokens and routing per step, a straggling rank, the gathered input kept or gathered again; in the
same runs every cast and GEMM of the forward and backward checked on its own
(``support.fp8_moe_capture``: casts, the weight gradients' along the tokens too, and weights bit for
bit torch's, each GEMM and weight gradient within float32's bound of float64 of its own operands) and the
results against the exact layer within ``END_TO_END_FACTOR`` times the quantization's own effect, the
checks the GPU tests rely on; a doubled expert weight scale, a doubled scale of h's cast and of a weight
gradient's cast, each fail their own. The layer's refusals by name."""

import pytest

from support.moe_layer_scenarios import LayerCase, tp_moe_fp8_errors_check
from support.scenarios import fp8_moe_layer as S
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
    for rank, result in enumerate(run_ranks(world, S.tp_moe_fp8_check, recipe, case)):
        assert result["gap"] > 0.5, ("the data must route unambiguously", result["gap"])
        assert len(result["steps"]) == case.steps
        for step, errors in enumerate(result["steps"]):
            for key in S.KEYS:
                assert errors[key] < TOL, (name, rank, step, key, errors)
            assert 1e-3 < errors["out_exact"] < 0.2, (name, rank, step, errors)  # float8 ran: a few percent
        assert result["dtypes"] == [result["dtype"]], result["dtypes"]  # outputs and gradients in the model's
        expected = ("fallback", "fallback") if case.policy == "fallback" else ("fused", "chunked")
        assert result["paths"] == (("local", "local") if world == 1 else expected), result["paths"]
        # each cast and GEMM on its own, as on a GPU (where the GEMMs get the tensor cores' room instead)
        assert result["expected"], result["calls"]
        assert result["casts"] == [] and result["weights"] == [] and result["operands"] == [], result
        assert result["links"] == [], result["links"]
        assert result["gemm_fp32"] <= 1 and result["gemm"] < TOL, result
        assert result["swiglu_grad"] <= 1 and result["wgrad_fp32"] <= 1 and result["wgrad"] < TOL, result
        for key, e in result["end_to_end"].items():
            assert e["effect"] < S.EFFECT_MAX and e["exact"] <= S.END_TO_END_FACTOR * e["effect"], (key, e)


def test_a_doubled_weight_scale_and_doubled_cast_scales_each_fail_their_check():
    """Three planted defects in one run, each caught by its own check only. One expert's forward ``w0``
    scales doubled: the GEMM computes what it was given (its check passes, and so does h's cast, the
    SwiGLU of the pre-activations it computed); the weight operand it was given differs from torch's
    quantization of the checkpoint in that call only, on every rank, and the output leaves the end-to-end
    bound. The first row's scale of h's cast doubled after layer 0's epilogue wrote it: that cast differs
    from the reference cast of the captured pre-activations' SwiGLU in that scale alone, and layer 1
    still matches float64 of what it was given. The ``w1`` weight gradient's ``dO`` scales doubled after
    its cast: that cast differs from torch's (its scales, not its elements), the weight gradient's GEMM
    still matches float64 of what it was given, and ``d_w1`` leaves the end-to-end bound."""
    case = LayerCase(tokens=8, hidden=32, ffn=48, experts=3, top_k=2, seed=25)
    for result in run_ranks(2, S.tp_moe_fp8_check, "rowwise", case, (1, 2.0), 2.0, 2.0):
        assert result["weights"] == ["step 0 x @ w0"], result
        assert result["casts"] == ["step 0 h @ w1", "step 0 w1 grad lhs"], result
        assert result["details"][0].startswith("step 0 h @ w1: 0 of "), result["details"]
        assert " and 1 of " in result["details"][0], result["details"]
        assert result["details"][1].startswith("step 0 w1 grad lhs: 0 of "), result["details"]
        assert result["operands"] == [] and result["links"] == [], result
        assert result["gemm_fp32"] <= 1 and result["swiglu_grad"] <= 1 and result["wgrad_fp32"] <= 1, result
        for key in ("out", "d_w1"):
            e = result["end_to_end"][key]
            assert e["exact"] > 3 * S.END_TO_END_FACTOR * e["effect"], (key, e)


def test_tp_moe_fp8_refusals():
    found = run_ranks(2, tp_moe_fp8_errors_check)[1]
    assert "fp8 blockwise scaling needs hidden and ffn/W to be multiples of 128" in found["blockwise hidden"], found
    assert "hidden = 96" in found["blockwise hidden"] and "ffn/W = 64" in found["blockwise ffn"], found
    assert "fp8 must be None, a Float8Recipe or one of" in found["recipe"], found
    assert "fp8 needs ops that take float8 arguments" in found["ops"], found
