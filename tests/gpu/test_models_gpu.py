"""A checkpoint loaded with ``tileweave.models.from_pretrained`` generating on GPUs, the decode step eager
and captured in a CUDA graph (two ranks sharing one GPU with TILEWEAVE_GPU_RANKS=2). Skipped without
CUDA GPUs."""

import pytest

from gpus import RANKS, needs_two
from support import hf_models
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@needs_two
def test_generate_with_a_cuda_graph_decode_step_gpu(tmp_path):
    for r in run_ranks(RANKS, hf_models.graph_check, str(tmp_path / "llama"), 6, gpus=True):
        assert r["eager"] == r["want"], r
        assert r["graphed"] == r["want"] and r["again"] == r["want"], r


@needs_two
def test_moe_generate_with_a_cuda_graph_decode_step_gpu(tmp_path):
    # Mixtral: prefill on the MoE pair (27 rows: replicated at two ranks), decode on TPMoE.replicated
    for r in run_ranks(RANKS, hf_models.moe_graph_check, str(tmp_path / "mixtral"), 6, gpus=True):
        assert r["eager"] == r["want"], r
        assert r["graphed"] == r["want"] and r["again"] == r["want"], r
