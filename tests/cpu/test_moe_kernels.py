"""The MoE layer's compute kernels in Triton's interpreter against float64 references written here: the
grouped GEMM's SwiGLU epilogue, the top-k reduce, the SwiGLU's backward pass and the grouped weight
gradient; uneven, empty and single-row groups, odd widths, gathered rows, every dtype the interpreter
computes exactly (bfloat16 goes through float32 there)."""

import pytest
import torch
import torch.nn.functional as F

from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.swiglu import swiglu_grad
from tileweave.ops.compute.topk_reduce import topk_reduce

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(got, ref):
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite values in the output"
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def _experts_of(counts, experts):
    return [g % experts for g, c in enumerate(counts) for _ in range(c)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_reduce_matches_float64(dtype, k):
    gen = torch.Generator().manual_seed(k)
    tokens, hidden = 11, 37
    z = torch.randn(tokens * k + 5, hidden, generator=gen).to(dtype)
    pair_row = torch.randperm(tokens * k + 5, generator=gen)[:tokens * k].view(tokens, k).to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen)
    ref = (z.double()[pair_row.long()] * weights.double()[..., None]).sum(1)
    out = topk_reduce(z, pair_row, weights)
    assert out.dtype == torch.float32 and _rel(out, ref) < 1e-6
    assert torch.equal(out, topk_reduce(z, pair_row, weights)), "two calls must agree bitwise"
    rounded = topk_reduce(z, pair_row.long(), weights, out_dtype=dtype)
    assert rounded.dtype == dtype and _rel(rounded, ref) < TOL[dtype]
    unweighted = topk_reduce(z, pair_row, None)
    assert _rel(unweighted, z.double()[pair_row.long()].sum(1)) < 1e-6


def test_topk_reduce_refuses_bad_shapes():
    z = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"weights must be a float tensor \[n, k\] = \[2, 3\]"):
        topk_reduce(z, torch.zeros(2, 3, dtype=torch.int32), torch.rand(3, 2))
    with pytest.raises(ValueError, match="pair_row must be an int32/int64 tensor"):
        topk_reduce(z, torch.zeros(2, 3, dtype=torch.int16))


def _swiglu_case(gen, dtype, nk):
    experts, k, n = 3, 40, 18
    counts = [5, 0, 37, 9, 1, 11]                       # two sources' groups, an empty one, a single row
    rows = sum(counts)
    a = torch.randn(20, k, generator=gen).to(dtype)
    a_rows = torch.randint(0, 20, (rows,), generator=gen)
    w = torch.randn(experts, 2 * n, k, generator=gen).to(dtype) / k ** 0.5     # [E, 2N, K]: gate rows, up rows
    b = w.transpose(1, 2) if nk else w.transpose(1, 2).contiguous()
    y = torch.stack([a.double()[a_rows[p]] @ w.double()[e].t() for p, e in enumerate(_experts_of(counts, experts))])
    return a, a_rows, b, _offsets(counts), experts, n, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nk", [True, False], ids=["linear-weight", "row-major"])
def test_swiglu_epilogue_matches_float64(dtype, nk):
    gen = torch.Generator().manual_seed(3)
    a, a_rows, b, offsets, experts, n, y = _swiglu_case(gen, dtype, nk)
    pre = torch.full((y.shape[0], 2 * n), float("nan")).to(dtype)
    h = grouped_gemm(a, b, offsets, a_rows=a_rows, experts=experts, epilogue=SwiGLU(pre=pre))
    gate, up = y[:, :n], y[:, n:]
    assert h.shape == (y.shape[0], n)
    assert _rel(h, F.silu(gate) * up) < TOL[dtype]
    interleaved = torch.stack([gate, up], 2).reshape(y.shape[0], 2 * n)
    assert _rel(pre, interleaved) < TOL[dtype]
    without = grouped_gemm(a, b, offsets, a_rows=a_rows, experts=experts, epilogue=SwiGLU())
    assert torch.equal(without, h)


def test_swiglu_epilogue_refuses_odd_width():
    with pytest.raises(ValueError, match="gate and up columns"):
        grouped_gemm(torch.randn(4, 8), torch.randn(1, 8, 5), _offsets([4]), epilogue=SwiGLU())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_swiglu_grad_matches_float64(dtype):
    gen = torch.Generator().manual_seed(5)
    rows, n = 37, 45
    g = torch.randn(rows, n, generator=gen).to(dtype)
    pre = torch.randn(rows, 2 * n, generator=gen).to(dtype)
    scale = torch.rand(rows, generator=gen)
    dy, h_scaled, row_dot = swiglu_grad(g, pre, scale)
    gate, up = pre.double()[:, 0::2], pre.double()[:, 1::2]
    # autograd of the definition in float64 gives the reference derivative
    gate_ = gate.clone().requires_grad_(True)
    up_ = up.clone().requires_grad_(True)
    h = F.silu(gate_) * up_
    (h * (g.double() * scale.double()[:, None])).sum().backward()
    assert _rel(dy, torch.cat([gate_.grad, up_.grad], 1)) < TOL[dtype]
    assert _rel(h_scaled, h.detach() * scale.double()[:, None]) < TOL[dtype]
    assert _rel(row_dot, (g.double() * h.detach()).sum(1)) < 1e-6
    assert torch.equal(row_dot, swiglu_grad(g, pre, scale)[2]), "two calls must agree bitwise"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gather", ["lhs", "rhs"])
def test_grouped_wgrad_matches_float64(dtype, gather):
    gen = torch.Generator().manual_seed(7)
    experts, n, k = 3, 21, 34
    counts = [5, 0, 37, 9, 1, 11]                       # sources 0 and 1; expert 1 has rows from source 1 only
    rows = sum(counts)
    src_rows = torch.randint(0, 25, (rows,), generator=gen)
    lhs = torch.randn(25 if gather == "lhs" else rows, n, generator=gen).to(dtype)
    rhs = torch.randn(25 if gather == "rhs" else rows, k, generator=gen).to(dtype)
    scale = torch.rand(rows, generator=gen) if gather == "lhs" else None
    out = grouped_wgrad(lhs, rhs, _offsets(counts), experts=experts, scale=scale,
                        lhs_rows=src_rows if gather == "lhs" else None, rhs_rows=src_rows if gather == "rhs" else None)
    ref = torch.zeros(experts, n, k, dtype=torch.float64)
    for p, e in enumerate(_experts_of(counts, experts)):
        left = lhs.double()[src_rows[p] if gather == "lhs" else p] * (float(scale[p]) if scale is not None else 1.0)
        ref[e] += torch.outer(left, rhs.double()[src_rows[p] if gather == "rhs" else p])
    assert out.shape == (experts, n, k) and out.dtype == dtype
    assert _rel(out, ref) < TOL[dtype]


def test_grouped_wgrad_gives_zeros_to_experts_without_rows():
    out = grouped_wgrad(torch.randn(6, 4), torch.randn(6, 5), _offsets([6, 0, 0]), experts=3)
    assert torch.equal(out[1:], torch.zeros(2, 4, 5))


def test_grouped_wgrad_refuses_bad_offsets():
    with pytest.raises(ValueError, match="offsets must have S\\*E \\+ 1 entries for E = 2"):
        grouped_wgrad(torch.randn(6, 4), torch.randn(6, 5), _offsets([6, 0, 0]), experts=2)
