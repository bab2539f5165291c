"""``quantize`` compiled on a GPU, with the tiles it picks there, against torch's own reductions and
float8 casts on the same GPU, bit for bit: stacks of experts' weights at MoE shapes, each expert as it
is and transposed through its strides (an input gradient's operand), and rows whose amax is given.
Skipped without a CUDA GPU."""

import pytest
import torch

from gpus import needs_gpu
from tileweave.ops.compute.quantize import quantize

pytestmark = [pytest.mark.gpu, needs_gpu]
E4M3 = torch.float8_e4m3fn


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor: torch divides by a Python number as a product with its reciprocal, which is
    # not the correctly rounded quotient.
    return amax.clamp(min=1e-12) / torch.full_like(amax, 448.0)


def _reference(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float32 ``x [B, R, C]`` by torch on the GPU (R a multiple of 128 for blocks)."""
    b, r, c = x.shape
    if granularity == "tensorwise":
        each = scale = _scale(x.abs().amax())
    elif granularity == "rowwise":
        each = scale = _scale(x.abs().amax(2, keepdim=True))
    else:
        scale = _scale(x.view(b, r // 128, 128, c // 128, 128).abs().amax((2, 4)))
        each = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return (x / each).clamp(-448.0, 448.0).to(E4M3), scale


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise_128x128"])
@pytest.mark.parametrize("transpose", [False, True], ids=["as-is", "transposed"])
@pytest.mark.parametrize("experts,n,k", [(128, 1536, 2048), (8, 4096, 1792)])  # qwen3 w0, a mixtral w1 slice
def test_quantize_a_stack_of_experts_gpu(granularity, transpose, experts, n, k):
    gen = torch.Generator(device="cuda").manual_seed(experts + n)
    w = torch.randn(experts, n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w *= torch.exp2(torch.randint(-6, 7, (experts, n, 1), device="cuda", generator=gen)).bfloat16()
    got = quantize(w.transpose(1, 2) if transpose else w, granularity, transpose=transpose)
    q, scale = _reference(w.float(), granularity)
    assert got.data.shape == (experts, n, k) and got.data.is_contiguous()
    assert torch.equal(got.scale.reshape(scale.shape), scale)
    assert int((got.data.view(torch.uint8) != q.view(torch.uint8)).sum()) == 0


def test_given_row_amaxes_gpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(20000, 704, device="cuda", generator=gen) * 8
    q, scale = _reference(x[None], "rowwise")
    got = quantize(x, "rowwise", amax=x.abs().amax(1))
    assert torch.equal(got.scale, scale[0])
    assert int((got.data.view(torch.uint8) != q[0].view(torch.uint8)).sum()) == 0


MAX = {E4M3: 448.0, torch.float8_e5m2: 57344.0}


def _reference_2d(x: torch.Tensor, granularity: str, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float32 ``x [R, C]`` (C a multiple of 128 for blocks, R too for 128 x 128) by torch."""
    r, c = x.shape
    top = torch.full((), MAX[dtype], device=x.device)
    if granularity == "tensorwise":
        each = scale = x.abs().amax().clamp(min=1e-12) / top
    elif granularity == "rowwise":
        each = scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / top
    elif granularity == "blockwise_1x128":
        scale = x.view(r, c // 128, 128).abs().amax(2).clamp(min=1e-12) / top
        each = scale.repeat_interleave(128, 1)
    else:
        scale = x.view(r // 128, 128, c // 128, 128).abs().amax((1, 3)).clamp(min=1e-12) / top
        each = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (x / each).clamp(-MAX[dtype], MAX[dtype]).to(dtype), scale


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise_1x128", "blockwise_128x128"])
@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("transpose", [False, True], ids=["as-is", "transposed"])
def test_quantize_rounds_as_torch_casts_gpu(granularity, dtype, transpose):
    # Every granularity and format, read as it is or transposed, against torch's cast bit for bit: rows
    # of magnitudes 2^-30 .. 2^10 (values down in float8's subnormals and below), one all-zero row.
    gen = torch.Generator(device="cuda").manual_seed(len(granularity) + 7 * transpose)
    r, c = 1024, 1536
    x = torch.randn(r, c, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-30, 11, (r, 1), device="cuda", generator=gen).float())
    x[5] = 0
    x = x.bfloat16()
    got = quantize(x.t() if transpose else x, granularity, dtype=dtype, transpose=transpose)
    q, scale = _reference_2d(x.float(), granularity, dtype)
    assert torch.equal(got.scale.reshape(scale.shape), scale)
    assert int((got.data.view(torch.uint8) != q.view(torch.uint8)).sum()) == 0


@pytest.mark.parametrize("first,transpose,granularity", [
    ("tensorwise", True, "tensorwise"), ("rowwise", True, "rowwise"), ("rowwise", False, "blockwise_1x128"),
    ("blockwise_1x128", True, "blockwise_128x128"), ("blockwise_1x128", True, "blockwise_1x128"),
    ("blockwise_1x128", False, "rowwise")])
def test_requantize_float8_gpu(first, transpose, granularity):
    # A float8 operand with its scales (one, per row, per 1 x 128 block) quantized again, on the tiles
    # the GPU takes (the input's scales read once per tile, row or column, or per element): against
    # torch's reductions and cast of the dequantized values.
    gen = torch.Generator(device="cuda").manual_seed(len(first) + len(granularity) + transpose)
    r, c = 1024, 1536
    x = torch.randn(r, c, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-8, 9, (r, 1), device="cuda", generator=gen).float())
    q8, s8 = quantize(x, first)
    got = quantize(q8, granularity, transpose=transpose, x_scale=s8)
    each = s8.repeat_interleave(128, 1) if first == "blockwise_1x128" else s8
    deq = q8.float() * each
    q, scale = _reference_2d(deq.t() if transpose else deq, granularity, E4M3)
    assert torch.equal(got.scale.reshape(scale.shape), scale)
    assert int((got.data.view(torch.uint8) != q.view(torch.uint8)).sum()) == 0


@pytest.mark.parametrize("transpose", [False, True], ids=["as-is", "transposed"])
def test_twin_cast_gpu(transpose):
    # A weight's 128 x 128 cast with its transpose from the same pass (twin=True), as the blockwise layers
    # keep it for the input gradient: both against torch's cast bit for bit, subnormals included.
    gen = torch.Generator(device="cuda").manual_seed(11 + transpose)
    r, c = 1024, 1536
    x = torch.randn(r, c, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-30, 11, (r, 1), device="cuda", generator=gen).float())
    x[5] = 0
    x = x.bfloat16()
    got, twin = quantize(x.t() if transpose else x, "blockwise_128x128", transpose=transpose, twin=True)
    for out, ref in ((got, _reference_2d(x.float(), "blockwise_128x128", E4M3)),
                     (twin, _reference_2d(x.float().t().contiguous(), "blockwise_128x128", E4M3))):
        assert out.data.is_contiguous() and torch.equal(out.scale.reshape(ref[1].shape), ref[1])
        assert int((out.data.view(torch.uint8) != ref[0].view(torch.uint8)).sum()) == 0


@pytest.mark.parametrize("rows", [1024, 1000])
def test_twin_of_row_blocks_gpu(rows):
    # An output gradient's 1 x 128 cast with the 1 x 128 cast of its transpose (the tokens padded to a
    # multiple of 128) from one pass, against torch's casts bit for bit.
    gen = torch.Generator(device="cuda").manual_seed(rows)
    c = 1536
    x = torch.randn(rows, c, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-30, 11, (rows, 1), device="cuda", generator=gen).float())
    x = x.bfloat16()
    got, twin = quantize(x, "blockwise_1x128", twin=True)
    padded = torch.nn.functional.pad(x.float().t(), (0, -rows % 128))
    for out, ref in ((got, _reference_2d(x.float(), "blockwise_1x128", E4M3)),
                     (twin, _reference_2d(padded.contiguous(), "blockwise_1x128", E4M3))):
        assert out.data.is_contiguous() and torch.equal(out.scale.reshape(ref[1].shape), ref[1])
        assert int((out.data.view(torch.uint8) != ref[0].view(torch.uint8)).sum()) == 0
