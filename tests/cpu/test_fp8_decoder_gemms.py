"""Each float8 GEMM of the TP decoder checked on its own on emulated ranks (``support.fp8_decoder_capture``):
every activation cast equal to torch's own cast bit for bit, every weight operand equal to torch's
quantization of the checkpoint, every GEMM within float32's error bound of float64 of its own operands,
the attention and the fused RMSNorm at float32 precision; and the logits against the exact model within
``END_TO_END_FACTOR`` times the quantization's own effect, the bound the GPU tests rely on. A doubled
weight scale fails both."""

import pytest

from support.scenarios import fp8_decoder as S
from tileweave.testing.emulated import run_ranks

TOL = 1e-5  # float32 results against float64 of the same inputs (measured: below 2e-7)

# (world, scaling, batch, prompt chunks, decode steps, layers, seed): one rank, a 4-row prefill on the
# sequence-parallel ops, then a decode step on the replicated ones; two ranks, a 6-row prefill
# sequence-parallel, a 3-row one replicated, a decode step
CASES = [(1, "blockwise", 2, [2], 1, 1, 1), (2, "rowwise", 3, [2, 1], 1, 1, 2)]


@pytest.mark.parametrize("world, scaling, batch, chunks, steps, layers, seed", CASES)
def test_every_fp8_gemm_matches_float64_of_its_own_operands(world, scaling, batch, chunks, steps, layers, seed):
    for result in run_ranks(world, S.fp8_decoder_gemm_check, scaling, batch, chunks, steps, layers, seed):
        assert result["expected"], result["calls"]  # every layer's four GEMMs, on the expected ops, in order
        assert result["casts"] == [] and result["weights"] == [], result
        assert result["gemm_fp32"] <= 1 and result["gemm"] < TOL, result
        assert result["norm"] < TOL and result["attention"] < TOL and result["cache"] < TOL, result
        # on the CPU the model is also the float64 reference of its quantized math, end to end
        assert result["quantized"] < TOL, result
        assert result["effect"] < S.EFFECT_MAX, result
        assert result["exact"] <= S.END_TO_END_FACTOR * result["effect"], result
        assert result["same"] and result["state_dict"] < 1e-6, result


def test_a_doubled_weight_scale_fails_the_weight_check_and_the_end_to_end_bound():
    """The GEMM itself computes what it was given (its check passes); the weight operand it was given
    differs from torch's quantization of the checkpoint, in every call of that weight and no other, and
    the logits leave the end-to-end bound."""
    (result,) = run_ranks(1, S.fp8_decoder_gemm_check, "rowwise", 2, [3, 2], 1, 1, 0, "float32", (0, "o", 2.0))
    assert result["weights"] == ["prefill 0 layer 0 o (gemm_reduce_scatter)",
                                 "prefill 1 layer 0 o (gemm_reduce_scatter)",
                                 "decode 0 layer 0 o (gemm_all_reduce)"], result
    assert result["casts"] == [] and result["gemm_fp32"] <= 1, result
    assert result["exact"] > 3 * S.END_TO_END_FACTOR * result["effect"], result
