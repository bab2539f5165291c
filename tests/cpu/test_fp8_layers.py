"""The TP linears' FP8 training on emulated ranks: for each recipe (tensorwise, rowwise, blockwise) the
forward output and the input, weight and bias gradients against float64 of the same quantized math,
written independently (``support.fp8_reference``), at one, two and three ranks; M and N off the tiles
(the blockwise weight gradient's tokens padded); the layers' refusals by name."""

import pytest

from support.scenarios import fp8_layers as scenarios
from tileweave.testing.emulated import run_ranks

TOL = 1e-5  # float32 outputs of float8 products that match the reference's bit for bit

# (layer, recipe, M tokens over the group, in_features, out_features, bias, save_gathered, steps)
CASES = {
    1: [("row", "rowwise", 40, 128, 72, True, True, 2), ("column", "blockwise", 40, 256, 128, True, True, 1)],
    2: [("column", "tensorwise", 48, 128, 80, True, True, 2), ("row", "tensorwise", 48, 96, 80, True, True, 1),
        ("column", "rowwise", 48, 128, 80, False, False, 1), ("column", "blockwise", 48, 128, 256, True, True, 1),
        ("row", "blockwise", 48, 256, 128, True, True, 1)],
    3: [("column", "rowwise", 39, 64, 48, True, True, 1)],
}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp8_linears_match_float64_of_the_same_quantized_math(world):
    for rows in run_ranks(world, scenarios.fp8_linear_check, CASES[world]):
        for row in rows:
            for name in ("y", "dx", "dw") + (("db",) if row["case"][5] else ()):
                assert row[name] < TOL, (name, row)
            assert row["dtypes"] == ["torch.float32"], row  # outputs and gradients in the input's dtype
            if world > 1:
                assert row["paths"][0] in ("fused", "chunked") and row["paths"][1] in ("fused", "chunked"), row


def test_fp8_configurations_are_refused_by_name():
    out = run_ranks(2, scenarios.fp8_refusals_check)[0]
    for name in ("blockwise column out_features/W", "blockwise column in_features", "blockwise row in_features/W",
                 "blockwise row out_features"):
        assert "ValueError" in out[name] and "multiples of 128" in out[name], (name, out[name])
    assert "out_features/W = 200" in out["blockwise column out_features/W"], out
    assert "in_features/W = 96" in out["blockwise row in_features/W"], out
    assert "fp8 must be None, a Float8Recipe or one of" in out["unknown recipe"], out
    assert "fp8 applies to the sequence-parallel layers" in out["not sequence parallel"], out
    assert "Float8Recipe.grad_dtype must be" in out["recipe field"], out
