"""The MoE pair in FP8 on emulated ranks (Triton's interpreter computes e4m3 dots exactly): layer 0 with
and without the SwiGLU epilogue and layer 1, tensorwise, rowwise and blockwise, fused and unfused paths,
against float64 of every rank's dequantized operands (``support.scenarios.fp8_moe``); the gathered float8
rows and their scales returned bit for bit; T*k rows and N off the tiles; a tensorwise scale that differs
per rank; a straggling copy engine; bad FP8 arguments refused by name on every rank, also when only one
rank's are bad."""

import pytest

from support.scenarios import fp8_moe as scenarios
from tileweave.testing.emulated import run_ranks

TOL = {"float32": 1e-5, "float16": 2e-3}
PATHS = {"fused": ("fused", "chunked"), "fallback": ("fallback", "fallback"), "auto": ("fused", "chunked")}

# (scaling, tokens per rank, hidden, F_loc, experts, top-k, out dtype, swiglu, policy, straggler, delay_s)
CASES = {
    1: [("blockwise", 5, 128, 128, 3, 2, "float32", True, "auto", -1, 0.0)],
    2: [("tensorwise", 5, 64, 40, 3, 2, "float32", True, "fused", 1, 0.1),   # scales differ per rank, late rank
        ("rowwise", 7, 64, 24, 4, 2, "float16", False, "fused", -1, 0.0),
        ("blockwise", 3, 128, 128, 2, 2, "float32", False, "fused", 0, 0.1),
        ("rowwise", 3, 32, 40, 2, 1, "float32", True, "fallback", -1, 0.0)],
}


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_moe_pair_matches_float64_of_the_dequantized_operands(world):
    for rows in run_ranks(world, scenarios.fp8_moe_pair_check, CASES[world]):
        assert len(rows) == len(CASES[world])
        for row in rows:
            case = row["case"]
            tol = TOL[case[6]]
            assert row["err0"] < tol and row["err1"] < tol, row
            if case[7]:
                assert row["err_pre"] < tol, row
            assert row["dtypes"] == [f"torch.{case[6]}"], row
            assert (row["path0"], row["path1"]) == (("local", "local") if world == 1 else PATHS[case[8]]), row
            assert row["gathered_exact"], row


def test_bad_fp8_arguments_are_refused_by_name_on_every_rank():
    outcomes = run_ranks(2, scenarios.fp8_moe_errors_check)
    assert outcomes[0] == outcomes[1]  # every rank raised the same error, also for one rank's bad arguments
    expected = {"no scales": "need scale_a and scale_b", "no scale_b": "scale_b missing",
                "scale_a shape": "match no scaling", "scale_b shape": "match no scaling",
                "scale_b dtype": "scale_b must be a float32 tensor", "scale_a device": "scale_a must be a float32",
                "scales on fp16": "apply to float8 inputs only", "mixed operands": "has dtype",
                "out_dtype": "out_dtype must be one of", "blockwise K": "multiple of 128",
                "scale_a shape, one rank": "match no scaling",
                "scale_b dtype, one rank": "scale_b must be a float32 tensor",
                "no scales, one rank": "need scale_a and scale_b", "bf16 out on the CPU": "out_dtype is bfloat16"}
    for layer in ("layer 0", "layer 1"):
        for name, text in expected.items():
            got = outcomes[0][f"{layer}: {name}"]
            assert got != "no error" and text in got, (layer, name, got)
            if name.endswith("one rank"):
                assert "the arguments of rank 1" in got, (layer, name, got)
    assert outcomes[0]["after"] == "ok"


def test_the_walk_of_a_float8_input_goes_through_at_most_six_files():
    # test_op_walk.py's rule (support.walk) on float8 calls, the scales among the inputs: the float8
    # checks live beside the grouped GEMM's launcher, so FP8 adds no file to either layer's walk.
    for found in run_ranks(2, scenarios.fp8_moe_walk_check):
        for (layer, policy), walks in found.items():
            for files in walks:
                assert len(files) <= 6, (layer, policy, files)
            assert "ops/compute/grouped_gemm.py" in walks[0], (layer, policy, walks[0])
