"""bfloat16 on the CPU, where Triton's interpreter computes it wrongly: every Triton path either
computes it correctly (the plain GEMM runs it in float32) or refuses it with an error that says why.
Never a silent wrong result."""

import torch

from tileweave.ops.compute.matmul import linear, matmul
from support import scenarios
from tileweave.testing.emulated import run_ranks

BF16_TOL = 1e-2  # bf16 inputs rounded (2^-8 relative) and a bf16 output, against float64


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def test_matmul_and_linear_compute_bf16_correctly():
    g = torch.Generator().manual_seed(2511)
    a = torch.randn(40, 24, generator=g).bfloat16()
    b = torch.randn(24, 36, generator=g).bfloat16()
    bias = torch.randn(36, generator=g).bfloat16()
    for _ in range(2):  # a repeat takes the cached launch route
        y = matmul(a, b, bias=bias)
        assert y.dtype == torch.bfloat16
        assert _rel(y, a.double() @ b.double() + bias.double()) < BF16_TOL
    w = torch.randn(36, 24, generator=g).bfloat16()
    y = linear(a.reshape(4, 10, 24), w)
    assert y.shape == (4, 10, 36) and y.dtype == torch.bfloat16
    assert _rel(y.reshape(40, 36), a.double() @ w.double().t()) < BF16_TOL


def test_fused_ops_and_layers_refuse_bf16_or_compute_it():
    for rank_results in run_ranks(2, scenarios.bf16_cpu_check):
        assert set(rank_results) == {"ag_fused", "ag_oneshot", "ag_fallback", "rs_fused", "rs_oneshot",
                                     "rs_fallback", "column_layer", "row_layer"}
        for name, result in rank_results.items():
            if result.startswith("refused: "):
                assert "bfloat16" in result and "interpreter" in result, (name, result)
            else:
                assert float(result.split()[1]) < BF16_TOL, (name, result)
