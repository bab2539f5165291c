"""The dense pair in FP8 on real GPUs (compiled kernels, the copy engines, NCCL): AllGather+GEMM and
GEMM+ReduceScatter with tensorwise, rowwise and blockwise scales on every path, against float64 of every
rank's dequantized inputs (``support.scenarios.fp8_dense``), and bad FP8 arguments refused on every rank.
Skipped without CUDA or without FP8 tensor cores; TILEWEAVE_GPU_RANKS=2 runs both ranks on one GPU
(``tileweave.testing.shared_gpu``)."""

import pytest

from gpus import RANKS, needs_two
from support.scenarios import fp8_dense as scenarios
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
needs_fp8 = pytest.mark.skipif(not __import__("torch").cuda.is_available()
                               or __import__("torch").cuda.get_device_capability() < (8, 9),
                               reason="needs FP8 tensor cores")

# float32: Hopper's FP8 MMA keeps fewer bits than fp32 within a K step (tests/gpu/test_fp8_gpu.py's TOL).
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 3e-4}
PATH = {("ag", "mesh"): "fused", ("ag", "ring"): "fused", ("ag", "chunked"): "chunked",
        ("ag", "fallback"): "fallback", ("rs", "chunked"): "chunked", ("rs", "pull"): "chunked",
        ("rs", "oneshot"): "oneshot", ("rs", "fallback"): "fallback"}
# (op, variant, scaling, rows per rank, K (K_loc for "rs"), N, out_dtype, bias, weight layout, straggler, delay)
CASES = [
    ("ag", "mesh", "tensorwise", 512, 1024, 1000, "bfloat16", True, True, -1, 0.0),
    ("ag", "mesh", "blockwise", 384, 1024, 1152, "float32", False, True, 1, 0.05),
    ("ag", "ring", "rowwise", 200, 512, 520, "bfloat16", True, True, -1, 0.0),
    ("ag", "chunked", "blockwise", 256, 512, 640, "bfloat16", False, True, -1, 0.0),
    ("ag", "fallback", "tensorwise", 256, 512, 640, "float16", True, True, -1, 0.0),
    ("rs", "chunked", "rowwise", 512, 1024, 1000, "bfloat16", True, True, 0, 0.05),
    ("rs", "pull", "blockwise", 384, 1024, 1152, "float32", True, True, -1, 0.0),
    ("rs", "oneshot", "tensorwise", 100, 512, 520, "bfloat16", True, True, -1, 0.0),
    ("rs", "fallback", "rowwise", 256, 512, 640, "bfloat16", False, True, -1, 0.0),
]


@needs_two
@needs_fp8
def test_fp8_dense_ops_gpu():
    for rows in run_ranks(RANKS, scenarios.fp8_dense_check, CASES, gpus=True, timeout_s=300):
        for row in rows:
            kind, variant, scaling, *_, out_dtype = row["case"][:7]
            assert row["err"] < TOL[out_dtype], row
            assert row["dtype"] == out_dtype and row["path"] == PATH[kind, variant], row
            assert row["gathered"] is (True if kind == "ag" else None), row


@needs_two
@needs_fp8
def test_bad_fp8_arguments_gpu():
    outcomes = run_ranks(RANKS, scenarios.fp8_dense_errors_check, gpus=True, timeout_s=300)
    assert all(o == outcomes[0] for o in outcomes)
    assert all(outcome != "no error" for outcome in outcomes[0].values()), outcomes[0]
