"""The fused ops under torch.compile on real GPUs: each call one graph node (the custom ops of
``tileweave.ops.registry``), the compiled results against float64 from the unsharded inputs. Skipped
without CUDA; TILEWEAVE_GPU_RANKS=2 runs them with both ranks on one GPU."""

import pytest

from gpus import RANKS, needs_two
from tileweave.testing import moe_scenarios, scenarios
from tileweave.testing.emulated import run_ranks
from tileweave.testing.scenarios import all_reduce

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
TOL = 3e-3
"""fp32 inputs, which the GPU GEMMs may round to tf32 (about 3e-4 per GEMM)."""


@needs_two
def test_dense_pair_compiled_gpu():
    for result in run_ranks(RANKS, scenarios.compile_check, gpus=True, timeout_s=300):
        assert result["graphs"] == 1, result
        assert result["ops"] == ["tileweave.all_gather_gemm.default", "tileweave.gemm_reduce_scatter.default"], result
        assert result["err"] < TOL, result


@needs_two
def test_gemm_all_reduce_compiled_gpu():
    for result in run_ranks(RANKS, all_reduce.compile_check, gpus=True, timeout_s=300):
        assert result["graphs"] == 1, result
        assert result["ops"] == ["tileweave.gemm_all_reduce.default", "tileweave.gemm_all_reduce_norm.default"], result
        assert result["err"] < TOL, result


@needs_two
def test_moe_pair_compiled_gpu():
    for result in run_ranks(RANKS, moe_scenarios.compile_check, gpus=True, timeout_s=300):
        assert result["graphs"] == 1, result
        assert result["ops"] == ["tileweave.moe_all_gather_gemm_gathered.default",
                                 "tileweave.moe_gemm_reduce_scatter.default"], result
        assert result["err0"] < TOL and result["err1"] < TOL and result["gathered_exact"], result
