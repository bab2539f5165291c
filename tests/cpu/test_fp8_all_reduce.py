"""GEMM + AllReduce in FP8 on emulated ranks: each rank's scaled partial (tensorwise, rowwise,
blockwise) summed over the ranks, with bias, residual and RMSNorm, against float64 of the dequantized
inputs (Triton's interpreter computes e4m3 dots exactly); bad FP8 arguments refused by name on every
rank."""

from support.scenarios import all_reduce as scenarios
from tileweave.testing.emulated import run_ranks

TOL = {"float32": 1e-5, "float16": 2e-3}
CASES = [
    ("tensorwise", "oneshot", 6, 32, 24, "float32", False),
    ("rowwise", "twoshot", 5, 48, 40, "float32", True),      # M and N off the tiles, the fused norm
    ("blockwise", "oneshot", 4, 128, 136, "float16", True),  # K_loc = 128, N past one 128-column block
    ("rowwise", "fallback", 4, 32, 24, "float32", False),    # the unfused path
]


def test_fp8_gemm_all_reduce_matches_float64_on_every_path():
    results = run_ranks(2, scenarios.fp8_check, CASES)
    for rows in results:
        for row in rows:
            scaling, policy, out_dtype, norm = row["case"]
            assert row["err"] < TOL[out_dtype], row
            assert row["same"] and row["dtype"] == f"torch.{out_dtype}", row
            assert row["path"] == policy, row


def test_bad_fp8_arguments_are_refused_by_name_on_every_rank():
    outcomes = run_ranks(2, scenarios.fp8_errors_check)
    assert outcomes[0] == outcomes[1]
    expected = {"no scales": "need scale_a and scale_b", "scale_a shape": "match no scaling",
                "scale dtype": "scale_a must be a float32 tensor", "mixed operands": "both must be float8",
                "scales on fp32": "apply to float8 inputs only", "out_dtype": "out_dtype must be one of",
                "bias dtype": "bias"}
    for name, text in expected.items():
        assert outcomes[0][name] != "no error" and text in outcomes[0][name], (name, outcomes[0][name])
