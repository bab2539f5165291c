"""GEMM + AllReduce's epilogue in a group of one (``ops/all_reduce/local.epilogue``: the one-shot kernel on
one rank, whole rows per program) in Triton's interpreter, against float64: bias, residual, RMSNorm."""

import zlib

import pytest
import torch

from tileweave.ops.all_reduce.local import epilogue

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n", [(1, 64), (3, 200), (8, 130)])
@pytest.mark.parametrize("bias,residual,norm", [(True, False, False), (False, True, False), (False, True, True),
                                                (True, True, True)])
def test_epilogue_matches_reference(dtype, m, n, bias, residual, norm):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{m},{n},{bias},{residual},{norm},{dtype}".encode()))
    part = torch.randn(m, n, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    r = torch.randn(m, n, generator=gen).to(dtype) if residual else None
    g = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype) if norm else None
    y = torch.full((m, n), float("nan"), dtype=dtype)
    resid = torch.full((m, n), float("nan"), dtype=dtype) if norm else None
    eps = 1e-5
    epilogue(part, b, r, g, eps, y, resid)
    total = part.double() + (b.double() if bias else 0) + (r.double() if residual else 0)
    if norm:
        # The norm of the rounded sum, as a separate RMSNorm after the add would see it.
        rounded = resid.double()
        assert ((rounded - total).norm() / total.norm()).item() < TOL[dtype]
        ref = rounded / torch.sqrt(rounded.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    else:
        ref = total
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
