"""The MoE layer's compute kernels compiled on a GPU against float64: the SwiGLU epilogue of the grouped
GEMM (its TMA box over an nn.Linear weight and its pointer path), the top-k reduce, the SwiGLU's backward
pass and the grouped weight gradient, at sizes past one tile in every dimension. Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from gpus import needs_gpu
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.swiglu import swiglu_grad
from tileweave.ops.compute.topk_reduce import topk_reduce

pytestmark = [pytest.mark.gpu, needs_gpu]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-3}


def _rel(got, ref):
    got = got.double()
    assert torch.isfinite(got).all()
    return ((got - ref).norm() / ref.norm()).item()


def _plan(gen, experts, sources, rows):
    """Offsets of ``sources * experts`` groups with uneven counts (some empty) summing to ``rows``."""
    weights = torch.rand(sources * experts, generator=gen) ** 3
    weights[1] = 0.0
    counts = torch.distributions.Multinomial(rows, weights / weights.sum()).sample().long().tolist()
    counts[-1] += rows - sum(counts)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    expert = torch.tensor([g % experts for g, c in enumerate(counts) for _ in range(c)], device="cuda")
    return offsets, expert


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nk", [True, False], ids=["linear-weight", "row-major"])
def test_swiglu_epilogue_gpu(dtype, nk):
    gen = torch.Generator().manual_seed(1)
    experts, hidden, ffn, rows = 6, 320, 200, 1500
    offsets, expert = _plan(gen, experts, 2, rows)
    x = torch.randn(700, hidden, generator=gen).to("cuda", dtype)
    a_rows = torch.randint(0, 700, (rows,), generator=gen).cuda()
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / hidden ** 0.5).to("cuda", dtype)
    b = w.transpose(1, 2) if nk else w.transpose(1, 2).contiguous()
    pre = torch.full((rows, 2 * ffn), float("nan"), device="cuda", dtype=dtype)
    h = grouped_gemm(x, b, offsets, a_rows=a_rows, experts=experts, epilogue=SwiGLU(pre=pre))
    y = torch.einsum("pk,pnk->pn", x.double()[a_rows], w.double()[expert])
    assert _rel(h, F.silu(y[:, :ffn]) * y[:, ffn:]) < TOL[dtype]
    assert _rel(pre, torch.stack([y[:, :ffn], y[:, ffn:]], 2).reshape(rows, 2 * ffn)) < TOL[dtype]


def test_topk_reduce_gpu():
    gen = torch.Generator().manual_seed(2)
    tokens, k, hidden = 3001, 6, 2112
    z = torch.randn(tokens * k, hidden, generator=gen).to("cuda", torch.bfloat16)
    pair_row = torch.randperm(tokens * k, generator=gen).view(tokens, k).to(torch.int32).cuda()
    weights = torch.rand(tokens, k, generator=gen).cuda()
    out = topk_reduce(z, pair_row, weights, out_dtype=torch.bfloat16)
    ref = (z.double()[pair_row.long()] * weights.double()[..., None]).sum(1)
    assert _rel(out, ref) < 1e-2
    fp32 = topk_reduce(z, pair_row, weights)
    assert _rel(fp32, ref) < 1e-6 and torch.equal(fp32, topk_reduce(z, pair_row, weights))


def test_swiglu_grad_gpu():
    gen = torch.Generator().manual_seed(3)
    rows, n = 2049, 704
    g = torch.randn(rows, n, generator=gen).to("cuda", torch.bfloat16)
    pre = torch.randn(rows, 2 * n, generator=gen).to("cuda", torch.bfloat16)
    scale = torch.rand(rows, generator=gen).cuda()
    dy, h_scaled, row_dot = swiglu_grad(g, pre, scale)
    gate, up = pre.double()[:, 0::2], pre.double()[:, 1::2]
    sig, h = torch.sigmoid(gate), F.silu(gate) * up
    dh = g.double() * scale.double()[:, None]
    assert _rel(dy, torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * F.silu(gate)], 1)) < 1e-2
    assert _rel(h_scaled, h * scale.double()[:, None]) < 1e-2
    assert _rel(row_dot, (g.double() * h).sum(1)) < 1e-5


@pytest.mark.parametrize("gather", ["lhs", "rhs"])
def test_grouped_wgrad_gpu(gather):
    gen = torch.Generator().manual_seed(4)
    experts, n, k, rows, sources = 5, 300, 520, 3000, 2
    offsets, expert = _plan(gen, experts, sources, rows)
    src = torch.randint(0, 900, (rows,), generator=gen).cuda()
    lhs = torch.randn(900 if gather == "lhs" else rows, n, generator=gen).to("cuda", torch.bfloat16)
    rhs = torch.randn(900 if gather == "rhs" else rows, k, generator=gen).to("cuda", torch.bfloat16)
    scale = torch.rand(rows, generator=gen).cuda() if gather == "lhs" else None
    out = grouped_wgrad(lhs, rhs, offsets, experts=experts, scale=scale,
                        lhs_rows=src if gather == "lhs" else None, rhs_rows=src if gather == "rhs" else None)
    left = (lhs[src] if gather == "lhs" else lhs).double()
    if scale is not None:
        left = left * scale.double()[:, None]
    right = (rhs[src] if gather == "rhs" else rhs).double()
    ref = torch.stack([left[expert == e].t() @ right[expert == e] for e in range(experts)])
    assert _rel(out, ref) < 1e-2
