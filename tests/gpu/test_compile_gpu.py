"""The fused ops under torch.compile on real GPUs: each call one graph node (the custom ops of
``tileweave.ops.registry``), the compiled results against float64 from the unsharded inputs. Skipped
without CUDA; TILEWEAVE_GPU_RANKS=2 runs them with both ranks on one GPU."""

import pytest

from gpus import RANKS, needs_two
from support import moe_scenarios, scenarios
from tileweave.testing.emulated import run_ranks
from support.scenarios import all_reduce

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
TOL = 3e-3
"""fp32 inputs, which the GPU GEMMs may round to tf32 (about 3e-4 per GEMM)."""


CHECKS = {
    "dense": (scenarios.compile_check, ["tileweave.all_gather_gemm.default", "tileweave.gemm_reduce_scatter.default"]),
    "gemm_all_reduce": (all_reduce.compile_check, ["tileweave.gemm_all_reduce.default",
                                                   "tileweave.gemm_all_reduce_norm.default"]),
    "moe": (moe_scenarios.compile_check, ["tileweave.moe_all_gather_gemm_gathered.default",
                                          "tileweave.moe_gemm_reduce_scatter.default"]),
}


@needs_two
@pytest.mark.parametrize("name", list(CHECKS))
def test_compiled_gpu(name):
    check, ops = CHECKS[name]
    for result in run_ranks(RANKS, check, gpus=True, timeout_s=300):
        assert result["graphs"] == 1 and result["ops"] == ops, result
        errors = [value for key, value in result.items() if key.startswith("err")]
        assert errors and max(errors) < TOL, result
        assert result.get("gathered_exact", True), result
