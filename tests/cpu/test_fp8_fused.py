"""The dense pair in FP8 on emulated ranks (Triton's interpreter computes e4m3 dots exactly): AllGather+GEMM
and GEMM+ReduceScatter with tensorwise, rowwise and blockwise scales, on every path each op has (the
fused kernel over a mesh or a ring, the chunked transports pushing or pulling, the one-shot path, the
unfused path, "auto"), against float64 of every rank's dequantized inputs (``support.scenarios.fp8_dense``),
AllGather+GEMM's gathered rows and scales returned bit for bit; M and N off the tiles, two K blocks and
two N blocks of blockwise scales, a tensorwise scale that differs per rank, a straggler; bad FP8 arguments refused by name on every rank, also when only one rank's are bad.

Sizes are small (the interpreter runs programs one after another): the budget of this file is about a
minute on two cores."""

import pytest

from support.scenarios import fp8_dense as scenarios
from tileweave.testing.emulated import run_ranks

TOL = {"float32": 1e-5, "float16": 2e-3}
PATH = {("ag", "mesh"): "fused", ("ag", "ring"): "fused", ("ag", "chunked"): "chunked", ("ag", "auto"): "fused",
        ("ag", "fallback"): "fallback", ("rs", "chunked"): "chunked", ("rs", "pull"): "chunked",
        ("rs", "oneshot"): "oneshot", ("rs", "fallback"): "fallback", ("rs", "auto"): "chunked"}

# (op, variant, scaling, rows per rank, K (K_loc for "rs"), N, out_dtype, bias, weight layout, straggler, delay)
TWO_RANKS = [
    ("ag", "mesh", "tensorwise", 24, 128, 40, "float32", True, True, -1, 0.0),
    ("ag", "mesh", "blockwise", 24, 256, 136, "float16", True, True, 1, 0.05),  # two K blocks, two N blocks
    ("ag", "ring", "rowwise", 13, 64, 40, "float32", False, False, -1, 0.0),     # row-major b
    ("ag", "chunked", "blockwise", 24, 128, 40, "float32", False, True, -1, 0.0),
    ("ag", "auto", "rowwise", 24, 64, 40, "float16", True, True, -1, 0.0),
    ("ag", "fallback", "tensorwise", 24, 128, 40, "float32", True, True, -1, 0.0),
    ("rs", "chunked", "rowwise", 24, 64, 40, "float32", True, True, -1, 0.0),
    ("rs", "pull", "blockwise", 24, 256, 136, "float16", True, True, 0, 0.05),
    ("rs", "oneshot", "tensorwise", 13, 128, 40, "float32", True, False, -1, 0.0),
    ("rs", "auto", "tensorwise", 24, 64, 40, "float16", False, True, -1, 0.0),
    ("rs", "fallback", "blockwise", 24, 128, 40, "float32", True, True, -1, 0.0),
]
THREE_RANKS = [
    ("ag", "ring", "tensorwise", 13, 64, 40, "float32", True, True, 2, 0.05),   # forwarded scales, a straggler
    ("ag", "mesh", "rowwise", 24, 64, 40, "float16", False, True, -1, 0.0),
    ("rs", "chunked", "blockwise", 24, 128, 40, "float32", True, True, 1, 0.05),
    ("rs", "oneshot", "rowwise", 13, 64, 40, "float32", False, True, 0, 0.05),
]
ONE_RANK = [
    ("ag", "auto", "blockwise", 24, 128, 40, "float32", True, True, -1, 0.0),
    ("rs", "auto", "rowwise", 24, 64, 40, "float16", True, False, -1, 0.0),
]


@pytest.mark.parametrize("world,cases", [(2, TWO_RANKS), (3, THREE_RANKS), (1, ONE_RANK)], ids=["2", "3", "1"])
def test_fp8_dense_ops_match_float64_on_every_path(world, cases):
    for rows in run_ranks(world, scenarios.fp8_dense_check, cases):
        for row in rows:
            kind, variant, scaling, *_, out_dtype = row["case"][:7]
            assert row["err"] < TOL[out_dtype], row
            assert row["dtype"] == out_dtype, row
            assert row["path"] == ("local" if world == 1 else PATH[kind, variant]), row
            assert row["gathered"] is (True if kind == "ag" else None), row  # rows and scales returned


def test_bad_fp8_arguments_are_refused_by_name_on_every_rank():
    outcomes = run_ranks(2, scenarios.fp8_dense_errors_check)
    assert outcomes[0] == outcomes[1]  # every rank raised the same error, also for one rank's bad arguments
    expected = {"no scales": "need scale_a and scale_b", "scale_a shape": "match no scaling",
                "scale_b dtype": "scale_b must be a float32 tensor", "mixed operands": "both must be float8",
                "scales on fp16": "apply to float8 inputs only", "out_dtype": "out_dtype must be one of",
                "bias dtype": "bias", "blockwise K": "multiple of 128",
                "scale_a shape, one rank": "match no scaling",
                "scale_b device or dtype, one rank": "scale_b must be a float32 tensor",
                "no scales, one rank": "need scale_a and scale_b", "bf16 out on the CPU": "out_dtype is bfloat16"}
    for kind in ("ag", "rs"):
        for name, text in expected.items():
            got = outcomes[0][f"{kind}: {name}"]
            assert got != "no error" and text in got, (kind, name, got)
            if name.endswith("one rank"):
                assert "the arguments of rank 1" in got, (kind, name, got)
    assert "policy='oneshot' does not take float8" in outcomes[0]["ag: oneshot"]
    assert "gathered_out is not supported with float8" in outcomes[0]["ag: gathered_out"]
