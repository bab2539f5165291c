"""The TP linears' FP8 training on emulated ranks: for each recipe (tensorwise, rowwise, blockwise) the
forward output and the input, weight and bias gradients against float64 of the same quantized math,
written independently (``support.fp8_reference``), at one and two ranks; M and N off the tiles
(the blockwise weight gradient's tokens padded); a column layer with an RMSNorm and a row layer with a
SwiGLU fused into its input's cast, the reference quantizing the norm's and the SwiGLU's values; the
layers' refusals by name; the four linears of ``TPTransformerBlock(fp8=...)``, each against the same
reference on the tensors it received."""

import pytest

from support.scenarios import fp8_layers as scenarios
from tileweave.testing.emulated import run_ranks

TOL = 1e-5  # float32 outputs of float8 products that match the reference's bit for bit

# (layer, recipe, M tokens over the group, in_features, out_features, bias, save_gathered, steps); the block's
# test below adds the tensorwise and rowwise row-parallel layers at two ranks
CASES = {
    # the block's test has blockwise at one rank; here its weight cast again in backward
    1: [("row", "rowwise", 40, 128, 72, True, True, 2), ("column", "blockwise-recast", 40, 128, 256, False, True, 1)],
    2: [("column", "tensorwise", 48, 128, 80, True, True, 2), ("column", "rowwise", 48, 128, 80, False, False, 1), ("column", "blockwise", 48, 128, 256, True, True, 1),
        ("row", "blockwise", 48, 256, 128, True, True, 1),
        # the producers fused into the input's cast: a norm with the input gathered again in backward, a SwiGLU
        ("column", "tensorwise", 48, 128, 80, False, False, 1, "norm"),
        ("row", "rowwise", 48, 256, 72, True, True, 1, "swiglu")],
}


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_linears_match_float64_of_the_same_quantized_math(world):
    for rows in run_ranks(world, scenarios.fp8_linear_check, CASES[world]):
        for row in rows:
            names = ("y", "dx", "dw") + (("db",) if row["case"][5] else ())
            for name in names + (("dnorm",) if "norm" in row["case"] else ()):
                assert row[name] < TOL, (name, row)
            assert row["dtypes"] == ["torch.float32"], row  # outputs and gradients in the input's dtype
            if world > 1:
                assert row["paths"][0] in ("fused", "chunked") and row["paths"][1] in ("fused", "chunked"), row


def test_fp8_options_refusals_and_fast_accumulation():
    result = run_ranks(1, scenarios.fp8_options_check)[0]
    # The recipes' accumulation reaches the kernels: the forward GEMM fast (tensor cores across K steps)
    # and both backward GEMMs exact, unless backward_fast_accum; blockwise always scales per K step.
    assert result["scalings"] == {"rowwise": ["outer_fast", "outer", "outer"],
                                  "rowwise, backward_fast_accum": ["outer_fast"] * 3,
                                  "blockwise": ["block"] * 3}, result["scalings"]
    out = result["refusals"]
    for name in ("blockwise column out_features/W", "blockwise column in_features", "blockwise row in_features/W",
                 "blockwise row out_features"):
        assert "ValueError" in out[name] and "multiples of 128" in out[name], (name, out[name])
    assert "out_features/W = 200" in out["blockwise column out_features/W"], out
    assert "in_features/W = 96" in out["blockwise row in_features/W"], out
    assert "fp8 must be None, a Float8Recipe or one of" in out["unknown recipe"], out
    assert "fp8 applies to the sequence-parallel layers" in out["not sequence parallel"], out
    assert "Float8Recipe.grad_dtype must be" in out["recipe field"], out


@pytest.mark.parametrize("world,cases", [(1, [("blockwise", 128, 2, 20)]),
                                         (2, [("tensorwise", 64, 2, 16), ("rowwise", 64, 2, 12)])], ids=["1", "2"])
def test_fp8_block_runs_each_linear_on_the_recipe(world, cases):
    # Inside TPTransformerBlock(fp8=...), every linear's output and gradients are the recipe's quantized
    # math on the inputs and output gradients it received (the fused q|k|v and gate|up weights quantized
    # as one); the block as a whole stays near the unquantized float64 block, and is not it (float8 ran).
    for rows in run_ranks(world, scenarios.fp8_block_check, cases):
        for row in rows:
            assert row["fp8"] == row["case"][0], row
            for layer in ("qkv", "o", "gate_up", "down"):
                for key in ("y", "dx", "dw") + (("dnorm",) if layer in ("qkv", "gate_up") else ()):
                    assert row[f"{layer}_{key}"] < TOL, (layer, key, row)
            for key in ("y_exact", "dx_exact"):
                assert 1e-3 < row[key] < 0.15, (key, row)  # e4m3 keeps 3 bits: a few percent
