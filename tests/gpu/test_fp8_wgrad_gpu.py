"""The FP8 grouped weight gradient and the cast of its operands compiled on a GPU: ``grouped_wgrad`` for
each scaling against float64 of its dequantized operands, and against torch's ``_scaled_grouped_mm``
(2d-2d, rowwise) where this torch has it; ``quantize_segments`` against torch's cast of the same groups,
bit for bit. Two sources' groups of uneven sizes (empty ones, past 128 rows and off multiples of 16), N
and K off the tiles. Skipped without a GPU of compute capability 8.9 or more (FP8 tensor cores)."""

import pytest
import torch

from gpus import needs_gpu
from support.fp8_reference import quantize_along_rows32
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.quantize import quantize_segments

pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Hopper's FP8 MMA keeps fewer bits than fp32 while it accumulates (test_fp8_gpu.py): a float32 output is
# exact to the product of one 128-row step summed in fp32; with use_fast_accum=True the error grows with
# the rows.
TOL = {torch.float32: 3e-4, torch.bfloat16: 1e-2}
FAST_TOL = 3e-3
GRANULARITY = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise_1x128"}
KIND = {"tensorwise": "tensor", "rowwise": "row", "blockwise": "1x128"}


def _plan(experts, sources, seed):
    """``(offsets [S*E + 1] on the GPU, counts)``: uneven groups, one empty, one of 1 row, one long."""
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.rand(sources * experts, generator=gen) ** 3 * 900).long().tolist()
    counts[1], counts[2], counts[-1] = 0, 1, 1500
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return offsets, counts


def _pieces(scaling, counts, experts):
    """The plan rows that share scales: all, each expert's (of every source), each group's."""
    starts = torch.tensor([0] + counts).cumsum(0).tolist()
    group_rows = [torch.arange(starts[g], starts[g + 1]) for g in range(len(counts))]
    if scaling == "tensorwise":
        return [torch.arange(starts[-1])]
    if scaling == "rowwise":
        return [torch.cat(group_rows[e::experts]) for e in range(experts)]
    return group_rows


def _read(seg, counts, scaling, experts):
    """``(float8 values [P, C], their scales [P, C])``: the plan rows of a ``quantize_segments`` operand and
    their scales, read as the weight gradient reads them (padded rows; scale rows per expert, or block j of
    group g at row ``offsets[g] // 128 + g + j``)."""
    data, scale, offsets = seg.data.cpu(), seg.scale.cpu(), seg.offsets.cpu()
    at = torch.cat([int(offsets[g]) + torch.arange(c) for g, c in enumerate(counts)])
    values = data[:, at].t()
    if scaling == "tensorwise":
        return values, scale.expand(values.shape)
    if scaling == "rowwise":
        rows = [g % experts for g, c in enumerate(counts) for _ in range(c)]
    else:
        rows = [int(offsets[g]) // 128 + g + j // 128 for g, c in enumerate(counts) for j in range(c)]
    return values, scale[torch.tensor(rows)]


def _dequantized(seg, counts, scaling, experts):
    values, scale = _read(seg, counts, scaling, experts)
    return values.double() * scale.double()


def _operands(scaling, experts, sources, n, k):
    """``(lhs, rhs, counts)``: a gradient in plan order and gathered tokens, cast by ``quantize_segments``
    as ``Float8Recipe``'s presets cast them."""
    offsets, counts = _plan(experts, sources, seed=len(scaling))
    rows = sum(counts)
    gen = torch.Generator().manual_seed(7)
    dy = (torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to("cuda", torch.bfloat16)
    x = torch.randn(900, k, generator=gen).to("cuda", torch.bfloat16)
    tok = torch.randint(0, 900, (rows,), generator=gen).cuda()
    lhs = quantize_segments(dy, offsets, experts, GRANULARITY[scaling], dtype=E5M2 if scaling == "tensorwise" else E4M3,
                            power_of_two=scaling == "rowwise")
    return lhs, quantize_segments(x, offsets, experts, GRANULARITY[scaling], rows=tok), counts


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_grouped_wgrad_gpu(scaling, out_dtype):
    experts, sources, n, k = 6, 2, 300, 520
    lhs, rhs, counts = _operands(scaling, experts, sources, n, k)
    out = grouped_wgrad(lhs.data.t(), rhs.data.t(), lhs.offsets, experts=experts, lhs_scale=lhs.scale,
                        rhs_scale=rhs.scale, out_dtype=out_dtype)
    left, right = _dequantized(lhs, counts, scaling, experts), _dequantized(rhs, counts, scaling, experts)
    expert = torch.tensor([g % experts for g, c in enumerate(counts) for _ in range(c)])
    ref = torch.stack([left[expert == e].t() @ right[expert == e] for e in range(experts)])
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < TOL[out_dtype]
    if scaling != "blockwise":
        fast = grouped_wgrad(lhs.data.t(), rhs.data.t(), lhs.offsets, experts=experts, lhs_scale=lhs.scale,
                             rhs_scale=rhs.scale, out_dtype=torch.float32, use_fast_accum=True).double().cpu()
        assert ((fast - ref).norm() / ref.norm()).item() < FAST_TOL


def test_fp8_grouped_wgrad_equals_torchs_scaled_grouped_mm():
    """torch's 2d-2d scaled grouped GEMM (rowwise: scales ``[E * N]`` and ``[E * K]``, ours flattened; its
    offsets are group ends, multiples of 16) on one source's groups, where this torch takes it."""
    experts, n, k = 6, 300, 520
    lhs, rhs, _ = _operands("rowwise", experts, 1, n, k)
    end = int(lhs.offsets[experts])
    try:
        theirs = torch._scaled_grouped_mm(
            lhs.data[:, :end], rhs.data[:, :end].t(), lhs.scale.flatten(), rhs.scale.flatten(),
            offs=lhs.offsets[1:].contiguous(), out_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, ValueError, NotImplementedError) as exc:
        pytest.skip(f"this torch takes no 2d-2d float8 _scaled_grouped_mm here: {str(exc).splitlines()[0]}")
    mine = grouped_wgrad(lhs.data.t(), rhs.data.t(), lhs.offsets, experts=experts, lhs_scale=lhs.scale,
                         rhs_scale=rhs.scale)
    err = ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item()
    assert err < TOL[torch.bfloat16], err


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
def test_quantize_segments_gpu_equals_torchs_cast(scaling):
    experts, sources, cols = 4, 2, 2176
    offsets, counts = _plan(experts, sources, seed=3)
    rows = sum(counts)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randn(1000, cols, generator=gen) * torch.rand(1000, 1, generator=gen) * 30
    x8 = (tokens / 4).to(E4M3)
    x_scale = torch.rand(1000, cols // 128 + 1, generator=gen)[:, :cols // 128] + 0.5  # strided, as gathered
    tok = torch.randint(0, 1000, (rows,), generator=gen)
    dtype, pow2 = (E5M2 if scaling == "tensorwise" else E4M3), scaling == "rowwise"
    seg = quantize_segments(x8.cuda(), offsets, experts, GRANULARITY[scaling], rows=tok.cuda(), dtype=dtype,
                            power_of_two=pow2, x_scale=x_scale.cuda())
    values = (x8.float() * x_scale.repeat_interleave(128, 1))[tok]
    q, scale_at = quantize_along_rows32(values, _pieces(scaling, counts, experts), KIND[scaling], dtype, pow2)
    values, scale = _read(seg, counts, scaling, experts)
    assert torch.equal(values.view(torch.uint8), q.view(torch.uint8)), "the float8 values"
    assert torch.equal(scale, scale_at), "the scales"
    padded = seg.offsets.cpu()
    data = seg.data.cpu()[:, :int(padded[-1])]
    keep = torch.ones(data.shape[1], dtype=torch.bool)
    keep[torch.cat([int(padded[g]) + torch.arange(c) for g, c in enumerate(counts)])] = False
    assert not data[:, keep].float().any(), "the padding rows are zeros"
