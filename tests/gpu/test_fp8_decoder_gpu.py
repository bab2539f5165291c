"""The TP decoder's FP8 inference on real GPUs (one rank per GPU, or two ranks sharing one with
TILEWEAVE_GPU_RANKS=2): rowwise and blockwise against float64 of the same quantized math, prefill and
decode, and the decode step captured in a CUDA graph. Skipped without CUDA GPUs."""

import pytest

from gpus import RANKS, needs_gpu, needs_two, one_gpu_per_rank
from support.scenarios import fp8_decoder as S
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu]
needs_own_gpus = one_gpu_per_rank("the decode benchmark times NCCL")
TOL = 3e-3
"""float32 logits: the LM head's GEMM may run in tf32 (docs/design.md: ~3e-4 per GEMM); the float8
GEMMs themselves are exact to float32."""


@needs_gpu
@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_decoder_gpu_matches_float64_of_the_same_quantized_math(scaling):
    # a 4-row chunk sequence-parallel where the rows divide by the ranks, a 3-row chunk replicated
    for result in run_ranks(RANKS, S.fp8_decoder_check, scaling, 2, [2, 3], 3, 2, 5, True, gpus=True):
        assert result["prefill"] < TOL and result["decode"] < TOL, result
        assert result["prefill_exact"] > 10 * TOL, result  # the quantization's own effect is far above TOL
        assert result["same"] and result["state_dict"] < 1e-6, result


@needs_gpu
@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_decode_step_in_a_cuda_graph(scaling):
    env = {"TILEWEAVE_GRAPHABLE": "1"}
    for result in run_ranks(RANKS, S.fp8_graph_decode_check, scaling, "float32", 4, 7, gpus=True, env=env):
        assert result["captured"], result
        assert result["graph"] < TOL and result["graph_vs_eager"] < 1e-4, result
        assert result["exact"] > 10 * TOL, result


@needs_gpu
def test_fp8_decode_step_in_a_cuda_graph_bf16():
    # bfloat16 activations: the reference quantizes float64 activations, so only bf16's tolerance holds
    env = {"TILEWEAVE_GRAPHABLE": "1"}
    for result in run_ranks(RANKS, S.fp8_graph_decode_check, "blockwise", "bfloat16", 3, 9, gpus=True, env=env):
        assert result["captured"], result
        assert result["graph"] < 3e-2 and result["graph_vs_eager"] < 2e-2, result


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
