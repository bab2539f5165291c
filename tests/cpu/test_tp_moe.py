"""The TP MoE layer on emulated ranks against the unsharded float64 MoE: output, input gradient, every
parameter gradient (router included), over random, skewed and empty-expert routing, k = 1, 2 and 8,
both paths of the MoE pair, the fused and the unfused SwiGLU, W = 1 to 4, fp32 and fp16, repeated
steps with fresh routing and a straggling rank."""

import pytest

from tileweave.testing.emulated import run_ranks
from support.moe_layer_scenarios import LayerCase, tp_moe_check, tp_moe_errors_check, tp_moe_seq_sharded_check

TOLERANCE = {"float32": 1e-5, "float16": 2e-3}

CASES = {
    # two steps, fresh tokens and routing each; rank 1's copies straggle; the gathered input re-gathered
    "w2-uniform-k2-steps": (2, LayerCase(tokens=8, hidden=16, ffn=16, experts=4, top_k=2, steps=2,
                                         straggler=1, save_gathered=False, seed=11)),
    # k = 1 over a Zipf-skewed routing (uneven experts), weights not renormalised (else all 1)
    "w4-skewed-k1": (4, LayerCase(tokens=16, hidden=16, ffn=16, experts=8, top_k=1, routing="skewed",
                                  normalize_topk=False, seed=12)),
    # two experts without a token, uneven counts on the rest; a width of 72 bytes
    "w4-empty-k2": (4, LayerCase(tokens=12, hidden=18, ffn=32, experts=6, top_k=2, routing="empty",
                                 empty_experts=2, seed=13)),
    # one rank (no communication), k = 8 of 10 experts, Zipf-skewed: uneven and nearly empty experts
    "w1-skewed-k8": (1, LayerCase(tokens=8, hidden=16, ffn=16, experts=10, top_k=8, routing="skewed", seed=15)),
    # three ranks, two experts without a token
    "w3-empty-k2": (3, LayerCase(tokens=12, hidden=16, ffn=24, experts=5, top_k=2, routing="empty",
                                 empty_experts=2, seed=16)),
    # the two layers apart with the SwiGLU in torch (the form ops without epilogues run)
    "w2-unfused-k2": (2, LayerCase(tokens=8, hidden=16, ffn=16, experts=4, top_k=2, fused_swiglu=False, seed=17)),
    # k = 8 = E, fp16, on the MoE pair's fallback path
    "w2-k8-fp16-fallback": (2, LayerCase(tokens=8, hidden=16, ffn=16, experts=8, top_k=8, dtype="float16",
                                         policy="fallback", seed=14)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tp_moe_matches_float64_reference(name):
    world, case = CASES[name]
    tol = TOLERANCE[case.dtype]
    for rank, result in enumerate(run_ranks(world, tp_moe_check, case)):
        assert result["gap"] > 0.5, ("the data must route unambiguously", result["gap"])
        assert len(result["steps"]) == case.steps
        for step, errors in enumerate(result["steps"]):
            for key, err in errors.items():
                assert err < tol, (name, rank, step, key, errors)
        assert result["round_trip"], "full_state_dict must give back the loaded weights"
        expected = ("fallback", "fallback") if case.policy == "fallback" else ("fused", "chunked")
        if world == 1:
            expected = ("local", "local")
        assert result["paths"] == expected, result["paths"]


def test_tp_moe_rejects_bad_arguments():
    found = run_ranks(2, tp_moe_errors_check)[1]
    assert "ffn=5 must be divisible by the TP group size 2" in found["ffn"]
    assert "top_k must be an int from 1 to num_experts=4, got 5" in found["top_k"]
    assert "x_shard must be [T/W, hidden=16] or [B, S/W, hidden], got (4, 8)" in found["hidden"]
    assert "experts.gate must be [4, 16, 16], got [4, 16, 8]" in found["state"]


def test_tp_moe_takes_sequence_sharded_inputs():
    # [B, S/W, hidden] in and out, three sequences over two ranks, against float64 of all the tokens.
    case = LayerCase(tokens=12, hidden=16, ffn=8, experts=4, top_k=2)
    for result in run_ranks(2, tp_moe_seq_sharded_check, case, 3):
        assert result["shape"] and result["out"] < 1e-5 and result["dx"] < 1e-5, result
