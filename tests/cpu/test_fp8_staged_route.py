"""The staged blockwise FP8 kernel (scales brought into shared memory by TMA) takes only the scale
layouts TMA can read; the launcher refuses others by name before any kernel. No GPU: ``arguments``
derives a launch on the host."""

import pytest
import torch

from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod

STAGED = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 4, "num_warps": 4, "kernel": "staged"}


def _operands(m, n, k, a_m_major, b_k_major):
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    w = torch.randn(n, k).to(torch.float8_e4m3fn)
    kb, nb = k // 128, -(-n // 128)
    scale_a = torch.rand(kb, m).t() if a_m_major else torch.rand(m, kb)
    scale_b = torch.rand(nb, kb).t() if b_k_major else torch.rand(kb, nb)
    return a, w, scaling_mod.dense_scales("matmul", m, n, k, scale_a + 0.5, scale_b + 0.5)


@pytest.mark.parametrize("m,k", [(256, 512), (1000, 2048), (4096, 7168)])
def test_staged_takes_m_major_and_k_major_scales(m, k):
    a, w, scales = _operands(m, 384, k, True, True)
    assert fp8_sm90.staged_suits(scales)
    grid, tensors, ints, constexprs, options = fp8_sm90.arguments(
        a, w.t(), torch.empty(m, 384, dtype=torch.bfloat16), None, scales, config=STAGED, programs=132)
    assert fp8_sm90.kernel_of(STAGED).fn.__name__ == "fp8_gemm_sm90_staged_kernel"
    assert grid == min(132, -(-m // 128) * 3) and options == {"num_warps": 4}


@pytest.mark.parametrize("m,k,a_m_major,b_k_major,why", [
    (256, 512, False, True, "scale_a row-major"),
    (256, 512, True, False, "scale_b N-major"),
    (258, 512, True, True, "scale_a's column pitch 258 * 4 bytes"),
    (256, 384, True, True, "scale_b's row pitch 3 * 4 bytes"),
])
def test_staged_refuses_scales_tma_cannot_read(m, k, a_m_major, b_k_major, why):
    a, w, scales = _operands(m, 384, k, a_m_major, b_k_major)
    assert not fp8_sm90.staged_suits(scales), why
    with pytest.raises(ValueError, match="'staged' FP8 kernel takes blockwise scales"):
        fp8_sm90.arguments(a, w.t(), torch.empty(m, 384, dtype=torch.bfloat16), None, scales, config=STAGED,
                           programs=132)


def test_staged_is_for_blockwise_only():
    m, n, k = 256, 384, 512
    a, w = torch.randn(m, k).to(torch.float8_e4m3fn), torch.randn(n, k).to(torch.float8_e4m3fn)
    scales = scaling_mod.dense_scales("matmul", m, n, k, torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5)
    assert not fp8_sm90.staged_suits(scales)
    with pytest.raises(ValueError, match="'staged'"):
        fp8_sm90.arguments(a, w.t(), torch.empty(m, n, dtype=torch.bfloat16), None, scales, config=STAGED,
                           programs=132)
