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


@pytest.mark.parametrize("m,k", [(256, 512), (1000, 2048), (4096, 7168), (256, 1792)])
def test_staged_takes_m_major_and_k_major_scales(m, k):
    # Any K (1792: 14 blocks, a weight-scale pitch of 56 bytes): the weight scales are read as one row.
    a, w, scales = _operands(m, 384, k, True, True)
    assert fp8_sm90.staged_suits(scales)
    grid, tensors, ints, constexprs, options = fp8_sm90.arguments(
        a, w.t(), torch.empty(m, 384, dtype=torch.bfloat16), None, scales, config=STAGED, programs=132)
    assert fp8_sm90.kernel_of(STAGED).fn.__name__ == "fp8_gemm_sm90_staged_kernel"
    assert grid == min(132, -(-m // 128) * 3) and options == {"num_warps": 4}


def _offset(t: torch.Tensor) -> torch.Tensor:
    # The same values and strides, 4 bytes past a 16-byte boundary.
    store = torch.empty(t.untyped_storage().nbytes() // 4 + 1)
    out = store[1:].as_strided(t.shape, t.stride())
    return out.copy_(t)


@pytest.mark.parametrize("m,k,a_m_major,b_k_major,shift,why", [
    (256, 512, False, True, None, "scale_a row-major"),
    (256, 512, True, False, None, "scale_b N-major"),
    (258, 512, True, True, None, "scale_a's column pitch 258 * 4 bytes"),
    (256, 512, True, True, "a", "scale_a 4 bytes off a 16-byte boundary"),
    (256, 512, True, True, "b", "scale_b 4 bytes off a 16-byte boundary"),
])
def test_staged_refuses_scales_tma_cannot_read(m, k, a_m_major, b_k_major, shift, why):
    a, w, scales = _operands(m, 384, k, a_m_major, b_k_major)
    if shift is not None:
        scale_a, scale_b = (_offset(t) if shift == name else t for name, t in (("a", scales.a), ("b", scales.b)))
        scales = scaling_mod.dense_scales("matmul", m, 384, k, scale_a, scale_b)
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


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1024, 1024, 1024), (4096, 4096, 8192 + 128)])
def test_blockwise_route_by_scale_layout(out_dtype, m, n, k):
    # Small or large, the staged kernel for scales TMA reads (4 buffers with a float32 output, whose
    # store tiles need the fifth's shared memory), else the two-half kernel that loads them itself.
    staged = scaling_mod.dense_scales("matmul", m, n, k, torch.rand(k // 128, m).t() + 0.5,
                                      torch.rand(n // 128, k // 128).t() + 0.5)
    config = fp8_sm90.config_for(staged, out_dtype, m, n, k)
    assert config["kernel"] == "staged" and config["STAGES"] == (4 if out_dtype == torch.float32 else 5)
    row_major = scaling_mod.dense_scales("matmul", m, n, k, torch.rand(m, k // 128) + 0.5,
                                         torch.rand(n // 128, k // 128).t() + 0.5)
    assert fp8_sm90.config_for(row_major, out_dtype, m, n, k)["kernel"] == "halves"
