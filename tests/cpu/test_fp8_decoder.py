"""The TP decoder's FP8 inference on emulated ranks: rowwise and blockwise, one and two ranks, prefill
(sequence-parallel and replicated) and decode, against float64 of the same quantized math written apart
from the library (``support.scenarios.fp8_decoder``); the refusals by name."""

import pytest

from support.scenarios import fp8_decoder as S
from tileweave.testing.emulated import run_ranks

TOL = 1e-5  # float32 logits of float8 products whose operands match the reference's bit for bit

# (world, scaling, batch, prompt chunks, decode steps, layers, seed, convert a loaded model with to_fp8)
# (test_fp8_decoder_gemms.py runs each GEMM of a one-rank blockwise and a two-rank rowwise decoder too)
CASES = [
    (1, "blockwise", 1, [2], 1, 1, 1, True),
    # two ranks: a 6-row chunk sequence-parallel (AllGather+GEMM, GEMM+ReduceScatter in float8), a 3-row
    # chunk replicated (GEMM+AllReduce), then decode steps on GEMM+AllReduce; blockwise: 4 rows sequence-parallel
    (2, "rowwise", 3, [2, 1], 2, 1, 2, True),
    (2, "blockwise", 2, [2], 1, 1, 3, False),
]


@pytest.mark.parametrize("world, scaling, batch, chunks, steps, layers, seed, convert", CASES)
def test_fp8_decoder_matches_float64_of_the_same_quantized_math(world, scaling, batch, chunks, steps, layers, seed,
                                                                convert):
    for result in run_ranks(world, S.fp8_decoder_check, scaling, batch, chunks, steps, layers, seed, convert):
        assert result["fp8"] == scaling and result["weights"] == ["torch.float8_e4m3fn"], result
        assert result["prefill"] < TOL and result["decode"] < TOL, result
        # the quantization itself moves the logits by orders of magnitude more than the tolerance
        assert result["prefill_exact"] > 1e-3 and result["decode_exact"] > 1e-3, result
        assert result["same"], result  # the logits bitwise the same on every rank
        assert result["state_dict"] < TOL, result  # full_state_dict: the weights dequantized
        decode = [p for p in result["paths"] if p.startswith("decode")]
        assert decode == ["decode gemm_all_reduce=" + ("local" if world == 1 else "oneshot")], result["paths"]
        if world > 1:
            sp = [p for p in result["paths"] if "all_gather_gemm" in p]
            assert sp and all("=local" not in p and "=fallback" not in p for p in sp), result["paths"]


def test_fp8_decoder_refuses_what_it_cannot_run():
    for result in run_ranks(2, S.fp8_refusals_check):
        assert "fp8 must be None or one of 'rowwise', 'blockwise', got 'tensorwise'" in result["scaling"], result
        assert "not available for mixture-of-experts layers" in result["moe"], result
        assert "ffn per rank (ffn/W) = 192" in result["ffn"] and "TP size 2" in result["ffn"], result
        assert "hidden = 320" in result["hidden"], result
        assert "head_dim to divide 128" in result["head_dim"] and "head_dim = 256" in result["head_dim"], result
        assert "already float8 ('rowwise')" in result["twice"], result
        assert "hidden = 32" in result["convert"], result
