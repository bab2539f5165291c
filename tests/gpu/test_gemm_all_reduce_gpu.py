"""GEMM + AllReduce on real GPUs against float64 (bf16 and fp16): the fused transports compiled, and their
graphable protocol under CUDA-graph capture. Skipped without CUDA; TILEWEAVE_GPU_RANKS=2 runs the
distributed tests with both ranks on one GPU (tileweave.testing.shared_gpu)."""

import dataclasses

import pytest

from gpus import RANKS, SHARED, needs_two, one_gpu_per_rank
from support.scenarios import all_reduce as scenarios
from support.scenarios.all_reduce import DecodeCase as C
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
needs_own_gpus = one_gpu_per_rank("NCCL under CUDA-graph capture")


def _check(per_rank):
    for rows in per_rank:
        for row in rows:
            assert row["err"] < row["tol"], row
    for rows in per_rank[1:]:
        assert [row["sums"] for row in rows] == [row["sums"] for row in per_rank[0]]


@needs_two
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_transports_gpu(dtype):
    """Decode shapes (M 1-512, N off the tile sizes) on both transports and protocols, with and without
    the fused epilogue, a straggler; bitwise the same on every rank and on both protocols."""
    base = [C(m=1, k=1024, n=4096), C(m=8, k=512, n=1000, bias=True),
            C(m=64, k=1024, n=4096, residual=True, norm=True, bias=True, straggler=RANKS - 1, delay_s=0.05),
            C(m=333, k=256, n=2050, residual=True), C(m=512, k=512, n=4096, residual=True, norm=True)]
    cases = [dataclasses.replace(case, dtype=dtype, policy=policy, graphable=graphable, iters=3)
             for policy in ("oneshot", "twoshot") for graphable in (False, True) for case in base]
    per_rank = run_ranks(RANKS, scenarios.all_reduce_check, cases, gpus=True)
    _check(per_rank)
    rows = per_rank[0]
    assert all(row["path"] == row["case"]["policy"] for row in rows)
    for policy in ("oneshot", "twoshot"):
        constant = [row["sums"] for row in rows if row["case"]["policy"] == policy and row["case"]["graphable"]]
        epoch = [row["sums"] for row in rows if row["case"]["policy"] == policy and not row["case"]["graphable"]]
        assert constant == epoch


@needs_two
def test_auto_and_fallback_gpu():
    cases = [C(m=m, k=512, n=4096, dtype="bfloat16", policy=policy, residual=True, norm=True)
             for policy in ("auto", "fallback") for m in (1, 32, 256)]
    if SHARED:  # the unfused path runs gloo on CUDA tensors there: only the fused transports' rows
        cases = cases[:3]
    _check(run_ranks(RANKS, scenarios.all_reduce_check, cases, gpus=True))


@needs_two
@pytest.mark.parametrize("policy", ["oneshot", "twoshot"])
@pytest.mark.parametrize("norm", [False, True])
def test_cuda_graph_capture_and_replay(policy, norm):
    for result in run_ranks(RANKS, scenarios.cuda_graph_check, policy, 48, 1024, 4096, norm, gpus=True):
        assert result["path"] == policy, result
        assert max(result["errors"]) < result["tol"], result
        assert result["replayed"] == result["eager"], result


@needs_two
def test_missing_peer_gpu():
    kinds = [("oneshot", False), ("twoshot", False), ("oneshot", True)]
    # Every call first agrees with the peers, so the missing rank is found there, within the host's bound
    # (5 s here, for each of the three ops).
    results = run_ranks(RANKS, scenarios.missing_peer_check, kinds, 1 << 16, gpus=True,
                        env={"TILEWEAVE_TIMEOUT_S": "5"})
    for kind, outcome in zip(kinds, results[0]):
        assert outcome["raised"] and "rank 1" in outcome["message"] and "expired" in outcome["message"], \
            (kind, outcome)
        assert outcome["seconds"] < 30, (kind, outcome)


@needs_two
def test_bad_inputs_gpu():
    outcomes = run_ranks(RANKS, scenarios.input_errors_check, gpus=True)[0]
    assert all(outcome != "no error" for name, outcome in outcomes.items() if name != "good call after"), outcomes
    assert outcomes["good call after"] == "oneshot (4, 12) True", outcomes


FP8_CASES = [
    ("tensorwise", "oneshot", 64, 256, 512, "bfloat16", False),
    ("rowwise", "twoshot", 200, 512, 1000, "bfloat16", True),
    ("blockwise", "oneshot", 8, 512, 1024, "float32", True),
    ("rowwise", "fallback", 16, 256, 512, "bfloat16", False),
]


@needs_two
@pytest.mark.skipif(not __import__("torch").cuda.is_available()
                    or __import__("torch").cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")
def test_fp8_gemm_all_reduce_gpu():
    # float32: Hopper's FP8 MMA keeps fewer bits than fp32 within a K step (as in test_fp8_gpu.py)
    tol = {"bfloat16": 1e-2, "float32": 3e-4}
    for rows in run_ranks(RANKS, scenarios.fp8_check, FP8_CASES, gpus=True, timeout_s=300):
        for row in rows:
            scaling, policy, out_dtype, norm = row["case"]
            assert row["err"] < tol[out_dtype] and row["same"] and row["path"] == policy, row


@pytest.mark.skipif(RANKS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_local_path_gpu(dtype):
    """A group of one: the GEMM, then one epilogue kernel (rows of up to 8192 columns at once, wider ones
    in steps), against float64; with and without bias, residual and norm; decode rows and a prefill's."""
    base = [C(m=1, k=4096, n=4096, residual=True, norm=True), C(m=8, k=1000, n=8192, bias=True, residual=True),
            C(m=64, k=512, n=12000, residual=True, norm=True, bias=True), C(m=333, k=256, n=1000, residual=True,
                                                                             norm=True),
            C(m=5, k=2048, n=520, bias=True), C(m=3, k=14336, n=4096)]
    cases = [dataclasses.replace(case, dtype=dtype, policy="auto", iters=2) for case in base]
    rows = run_ranks(1, scenarios.all_reduce_check, cases, gpus=True)[0]
    for row in rows:
        assert row["err"] < row["tol"] and row["path"] == "local", row


@pytest.mark.skipif(RANKS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm", [False, True])
def test_local_path_cuda_graph(norm):
    result = run_ranks(1, scenarios.cuda_graph_check, "auto", 4, 4096, 4096, norm, gpus=True)[0]
    assert result["path"] == "local", result
    assert max(result["errors"]) < result["tol"], result
    assert result["replayed"] == result["eager"], result
