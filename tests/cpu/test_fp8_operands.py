"""Which values each float8 cast of the TP linears reads (``support.scenarios.fp8_operands``): every
operand of the forward, input-gradient and weight-gradient GEMMs of a step, as the layer hands it to
its ops, equals the reference's cast of the values the recipe table documents, element for element and
scale for scale, for each recipe; a column layer with an RMSNorm fused into its cast, keeping its
gathered input or gathering it again, and a row layer with a SwiGLU fused in. In float16: a cast from
the model-dtype values where the fused producer's float32 values (or the forward's float8 rows) are
documented differs in a few elements, which only a bitwise check sees on the CPU."""

from support.scenarios.fp8_operands import fp8_operands_check
from tileweave.testing.emulated import run_ranks

# (layer, recipe, M tokens over the group, in_features, out_features, save_gathered, producer); blockwise
# needs the local feature dimensions in multiples of 128, and M = 48 pads the weight gradient's tokens
CASES = [("column", recipe, 48, 128, 256, False, "norm") for recipe in ("tensorwise", "rowwise", "blockwise")]
CASES += [("column", "blockwise", 48, 128, 256, True, "norm"),  # the gathered float8 rows kept
          ("row", "tensorwise", 48, 256, 128, True, "swiglu"), ("row", "blockwise", 48, 256, 128, True, "swiglu"),
          ("column", "rowwise", 48, 128, 80, False, None)]  # no producer: the input regathered in its dtype


def test_fp8_casts_read_the_documented_values():
    for rows in run_ranks(2, fp8_operands_check, CASES, "float16"):
        for row in rows:
            assert row["gemms"] == ["forward", "dgrad", "wgrad"], row
            assert row["differ"] == [], row
