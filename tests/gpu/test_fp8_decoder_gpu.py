"""The TP decoder's FP8 inference on real GPUs (one rank per GPU, or two ranks sharing one with
TILEWEAVE_GPU_RANKS=2): rowwise and blockwise, prefill and decode, and the decode step captured in a CUDA
graph. Skipped without CUDA GPUs.

Checked one cast and one GEMM at a time (``support.fp8_decoder_capture``), not by the logits against
float64 of the same quantized math: on a GPU an activation before a cast may differ from the reference's
in its last float32 bits (another attention kernel, another order of sums), which moves it across a
float8 rounding boundary, a whole e4m3 step of 6-12%, and the flips compound over the layers. So each
cast must equal torch's own cast of the activation the GPU produced, bit for bit; each weight operand
torch's quantization of the checkpoint; each GEMM float64 of its own operands; the attention float64 of
its own q, k, v. The logits are compared with the exact (unquantized) model, within
``END_TO_END_FACTOR`` times the quantization's own effect (its docstring: the derivation), which any
gross error (a wrong scale or layout) exceeds several times over.

One run per scaling feeds the tests of a kind (``decoder_run``), each test one property, so that a
failure names which one failed. The GEMMs are held to the tensor cores' bound, not float32's: Hopper's
FP8 MMA keeps fewer bits than fp32 while it accumulates inside one K step (torch's exact scaled matmul
too), so no FP8 GEMM there meets float32's bound; the CPU tests hold the same GEMMs to it.
"""

import functools

import pytest

from gpus import RANKS, needs_gpu, needs_two, one_gpu_per_rank
from support.scenarios import fp8_decoder as S
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu]
needs_own_gpus = one_gpu_per_rank("the decode benchmark times NCCL")
TOL = 1e-5
"""float32 results against float64 of the same inputs (design.md's fp32 tolerance)."""
SCALINGS = ["rowwise", "blockwise"]


@functools.cache
def decoder_run(scaling: str) -> list[dict]:
    # three rows per sequence: a 6-row chunk sequence-parallel where the rows divide by the ranks, a
    # 3-row chunk replicated (at one rank, both sequence-parallel), then three decode steps; two layers
    return run_ranks(RANKS, S.fp8_decoder_gemm_check, scaling, 3, [2, 1], 3, 2, 5, gpus=True)


@needs_gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_decoder_gpu_casts_and_weights_are_torchs_bit_for_bit(scaling):
    for result in decoder_run(scaling):
        assert result["expected"], result["calls"]
        assert result["casts"] == [] and result["weights"] == [], result


@needs_gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_decoder_gpu_gemms_match_float64_of_their_operands(scaling):
    """Within the bound that leaves room for Hopper's FP8 MMA inside one K step (``MMA_UNIT``: about
    1e-3 of the terms' magnitudes, 64 times below one e4m3 step)."""
    for result in decoder_run(scaling):
        assert result["gemm_mma"] <= 1, result


@needs_gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_decoder_gpu_attention_and_norm_in_float32(scaling):
    for result in decoder_run(scaling):
        assert result["attention"] < TOL and result["cache"] < TOL and result["norm"] < TOL, result


@needs_gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_decoder_gpu_logits_within_the_quantization_effect_of_the_exact_model(scaling):
    """The exact model's logits, within ``END_TO_END_FACTOR`` times the distance of the float64 reference
    of the same quantized math from them (``effect``); ``quantized`` (the distance from that reference)
    is reported, not bounded: it is where float8 rounding flips show."""
    for result in decoder_run(scaling):
        assert result["effect"] < S.EFFECT_MAX, result
        assert result["exact"] <= S.END_TO_END_FACTOR * result["effect"], result
        assert result["same"] and result["state_dict"] < 1e-6, result


@needs_gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_decode_step_in_a_cuda_graph(scaling):
    env = {"TILEWEAVE_GRAPHABLE": "1"}
    for result in run_ranks(RANKS, S.fp8_graph_decode_check, scaling, "float32", 4, 7, gpus=True, env=env):
        assert result["captured"] and result["graph_vs_eager"] < 1e-4, result
        assert result["expected"] and result["casts"] == [] and result["weights"] == [], result
        assert result["gemm_mma"] <= 1 and result["attention"] < TOL and result["norm"] < TOL, result
        assert result["effect"] < S.EFFECT_MAX and result["exact"] <= S.END_TO_END_FACTOR * result["effect"], result


@needs_gpu
def test_fp8_decode_step_in_a_cuda_graph_bf16():
    # bfloat16 activations: GEMM outputs, norms and attention at bfloat16's precision; the casts and
    # weights still torch's bit for bit (of the bfloat16 activations the GPU produced)
    env = {"TILEWEAVE_GRAPHABLE": "1"}
    for result in run_ranks(RANKS, S.fp8_graph_decode_check, "blockwise", "bfloat16", 3, 9, gpus=True, env=env):
        assert result["captured"] and result["graph_vs_eager"] < 2e-2, result
        assert result["expected"] and result["casts"] == [] and result["weights"] == [], result
        assert result["gemm_mma"] <= 1 and result["attention"] < 2e-2 and result["norm"] < 1e-2, result
        assert result["effect"] < S.EFFECT_MAX and result["exact"] <= S.END_TO_END_FACTOR * result["effect"], result


@pytest.mark.multigpu
@needs_two
@needs_own_gpus
def test_decode_bench_fp8_gpu(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    proc = subprocess.run([sys.executable, "-m", "tileweave.bench.decode", "--out", str(tmp_path), "--models",
                           "llama3-8b", "--m", "1,64", "--context", "128", "--dtype", "fp8"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads((tmp_path / "decode.json").read_text())["results"]
    assert {r["dtype"] for r in records} == {"bf16", "fp8-rowwise", "fp8-blockwise"}
    assert {r["variant"] for r in records if r["dtype"] == "fp8-rowwise"} == {"tileweave", "torch"}
    for r in records:
        assert r["ok"] and r["ms"] > 0 and r["timed"] == "cuda graph replays", r
