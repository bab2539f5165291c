"""The inference layers, the TP decoder, the generation example and the decode benchmark on real GPUs
(one rank per GPU; the layers' tests also with two ranks sharing one GPU, TILEWEAVE_GPU_RANKS=2).
Skipped without CUDA GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpus import RANKS, needs_two, one_gpu_per_rank
from support import decoder_scenarios as S
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
needs_own_gpus = one_gpu_per_rank("NCCL")
ROOT = Path(__file__).resolve().parents[2]
TOL = {"bfloat16": 2e-2, "float16": 3e-3, "float32": 3e-3}
"""float32 as tf32 where the GEMMs round their inputs so (DESIGN.md: ~3e-4 per GEMM, several in a row)."""


@needs_two
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 37, 256])
def test_inference_linears_gpu(dtype, m):
    for result in run_ranks(RANKS, S.inference_linears_check, m, 1000, 512 * RANKS, 768, dtype, True, gpus=True):
        assert result.pop("same_y") and result.pop("same_dx"), result
        result.pop("path")
        for key, err in result.items():
            assert err < TOL[dtype], (key, result)


@needs_two
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_row_parallel_residual_norm_gpu(dtype):
    for result in run_ranks(RANKS, S.residual_norm_check, 64, 1024 * RANKS, 4096, dtype, gpus=True):
        assert result["same"] and result["normed"] < TOL[dtype] and result["h"] < TOL[dtype], result


@needs_two
def test_decoder_gpu_matches_reference():
    for result in run_ranks(RANKS, S.decoder_check, 2, [4, 3], 4, gpus=True):
        assert result["prefill"] < TOL["float32"] and result["decode"] < TOL["float32"], result
        assert result["same"], result
        assert result["tokens"] == result["want"], result


@needs_two
@needs_own_gpus
def test_generate_example_gpus():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--gpus", "--batch", "4",
                           "--prompt-len", "16", "--new-tokens", "8"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "tokens match" in proc.stdout, proc.stdout + proc.stderr


@needs_two
@needs_own_gpus
def test_decode_bench_gpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "tileweave.bench.decode", "--out", str(tmp_path), "--models",
                           "llama3-8b", "--m", "1,64", "--context", "128"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads((tmp_path / "decode.json").read_text())["results"]
    assert {r["variant"] for r in records} == {"tileweave", "nccl", "symm_one_shot", "symm_two_shot"}
    for r in records:
        assert r["ok"] and r["ms"] > 0 and r["timed"] == "cuda graph replays", r
