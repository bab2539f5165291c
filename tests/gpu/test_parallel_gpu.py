"""tileweave.parallel's styles on GPUs against the same modules unsharded in float64 (two ranks may
share one GPU, TILEWEAVE_GPU_RANKS=2: the MLP's layouts use no DTensor collective; the Llama's norms and
embedding do, which gloo does not run on CUDA tensors, so it needs one GPU per rank). Skipped without
CUDA GPUs."""

import pytest

from gpus import RANKS, needs_two, one_gpu_per_rank
from support import scenarios
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
TOL = 3e-3
"""float32 GEMMs may round their inputs to tf32 (DESIGN.md: ~3e-4 per GEMM, several in a row)."""


@needs_two
@pytest.mark.parametrize("layout, batch", [("sequence", 2), ("sequence", 1), ("dtensor", 2), ("replicate", 2)])
def test_mlp_styles_gpu(layout, batch):
    for result in run_ranks(RANKS, scenarios.styles_mlp_check, batch, 64 * RANKS, layout, gpus=True):
        result.pop("paths"), result.pop("placements")
        for key, err in result.items():
            assert err < TOL, (key, result)


@needs_two
@one_gpu_per_rank("DTensor's collectives need NCCL")
def test_llama_plan_gpu():
    for result in run_ranks(RANKS, scenarios.styles_llama_check, 2, 16 * RANKS, gpus=True):
        assert result.pop("paths") == "fused chunked", result
        for key, err in result.items():
            assert err < TOL, (key, result)
