"""The inference (replicated-activation) TP linears and the TP decoder on emulated ranks, against
float64 references computed from the unsharded weights (the decoder's in
``tileweave.testing.decoder_reference``, written apart from ``tileweave.nn.decoder``)."""

import pytest

from support import decoder_scenarios as S
from tileweave.testing.emulated import run_ranks

TOL = {"float32": 1e-5, "float16": 2e-3}


@pytest.mark.parametrize("world, m, dtype, bias", [(2, 5, "float32", True), (4, 3, "float16", False)])
def test_inference_linears_forward_and_gradients(world, m, dtype, bias):
    # column (local GEMM; dgrad all-reduced) then row (gemm_all_reduce; backward local), through the
    # sequence_parallel=False layers, two calls with fresh weights and inputs; odd sizes.
    for result in run_ranks(world, S.inference_linears_check, m, 12, 8 * world, 10, dtype, bias):
        assert result.pop("same_y") and result.pop("same_dx"), result
        assert result.pop("path") in {"oneshot", "twoshot", "fallback"}, result
        keys = {"y", "dx", "d_col_w", "d_row_w"} | ({"d_col_b", "d_row_b"} if bias else set())
        assert set(result) == keys, result
        for key, err in result.items():
            assert err < TOL[dtype], (key, result)


# fp32 at two ranks: the decoder tests below (every decode step runs it)
@pytest.mark.parametrize("world, dtype", [(3, "float16")])
def test_row_parallel_residual_norm(world, dtype):
    for result in run_ranks(world, S.residual_norm_check, 3, 6 * world, 10, dtype):
        assert result["same"] and result["dtype"] == f"torch.{dtype}", result
        assert result["normed"] < TOL[dtype] and result["h"] < TOL[dtype], result


@pytest.mark.parametrize("world, batch, chunks, steps, expect_prefill, generate, layers", [
    # prompt of 3 then 2 more tokens (attending to the cache), both sequence-parallel (6 and 4 rows)
    (2, 2, [3, 2], 3, {"sp"}, True, 2),
    # 3 rows do not split over 2 ranks: replicated prefill on gemm_all_reduce
    (2, 1, [3], 2, {"replicated"}, True, 2),
    # four ranks, one layer (on two cores): 4 rows sequence-parallel, then 6 rows replicated
    (4, 2, [2, 3], 1, {"sp", "replicated"}, False, 1),
])
def test_decoder_prefill_and_decode_match_reference(world, batch, chunks, steps, expect_prefill, generate, layers):
    results = run_ranks(world, S.decoder_check, batch, chunks, steps, True, 0, generate, layers)
    for result in results:
        assert result["prefill"] < 1e-5 and result["decode"] < 1e-5, result
        assert result["same"], result
        prefill = {"sp" if "all_gather_gemm" in p else "replicated" for p in result["paths"] if p.startswith("prefill")}
        assert prefill == expect_prefill, result["paths"]
        assert any(p.startswith("decode gemm_all_reduce=") for p in result["paths"]), result["paths"]
        # greedy generation from the prompt: the reference's tokens, with choices far from ties
        assert result["margin"] > 1e-4, result
        if generate:
            assert result["tokens"] == result["want"], result


def test_decode_steps_over_the_whole_cache_match_reference(world=2):
    # Keys spanning every preallocated slot (a CUDA-graph step): the decode attention kernel finds the
    # filled ones on the device; the logits must be those of the reference all the same.
    results = run_ranks(world, S.decoder_check, 2, [5], 3, True, 3, False, 1, True)
    for result in results:
        assert result["prefill"] < 1e-5 and result["decode"] < 1e-5 and result["same"], result


def test_decoder_refuses_bad_inputs():
    for result in run_ranks(2, S.decoder_errors_check):
        assert "vocab=17 must be divisible by the TP group size 2" in result["vocab"], result
        assert "heads=4 must be divisible by kv_heads=3" in result["kv_heads"], result
        assert "tokens must be integer [batch, seq], got torch.float32" in result["dtype"], result
        assert "tokens has batch 3, the cache was made for 2" in result["batch"], result
        assert "0 cached + 5 new tokens exceed max_seq=4" in result["max_seq"], result
        # an id outside the vocabulary, named on every rank (it was an IndexError on one)
        assert "token ids must be in [0, vocab=32), got ids from 0 to 32" in result["token_id"], result
        assert "got ids from -1 to 2" in result["negative_id"], result
