"""The RMSNorm and SwiGLU fused with their float8 cast on a GPU (compiled kernels): the float8 data and
scales equal ``quantize`` (on the GPU) of the values computed on the CPU by the documented formula
(``support.fp8_reference``), bit for bit, at a Llama-3-70B row width and rows off the tiles; the values
against float64. Skipped without a CUDA GPU."""

import pytest
import torch

from gpus import needs_gpu
from support.fp8_reference import rms_norm32, swiglu32
from tileweave.ops.compute.fused_quantize import rms_norm_quantize, swiglu_quantize
from tileweave.ops.compute.quantize import quantize

pytestmark = [pytest.mark.gpu, needs_gpu]
FORMS = [("rowwise", torch.float8_e4m3fn, True), ("blockwise_1x128", torch.float8_e4m3fn, False),
         ("tensorwise", torch.float8_e4m3fn, False), ("tensorwise", torch.float8_e5m2, False)]


def _mismatches(got, ref) -> tuple[int, int]:
    """Float8 elements and scales that differ."""
    return (int((got.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum()),
            int((got.scale != ref.scale).sum()))


@pytest.mark.parametrize("granularity,dtype,pow2", FORMS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_quantize_gpu(granularity, dtype, pow2, in_dtype):
    gen = torch.Generator().manual_seed(1)
    rows, cols = 1999, 8192
    x = (torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=gen).float()))
    x, w = x.to(in_dtype), (1 + 0.5 * torch.randn(cols, generator=gen)).to(in_dtype)
    got = rms_norm_quantize(x.cuda(), w.cuda(), 1e-5, granularity, dtype=dtype, power_of_two=pow2)
    values = rms_norm32(x, w, 1e-5)  # on the CPU: the formula's correctly rounded steps
    ref = quantize(values.cuda(), granularity, dtype=dtype, power_of_two=pow2)
    # The float64 sum of squares rounds to the same float32 unless it lies within an ulp of float64 of a
    # rounding boundary: no row here does.
    assert _mismatches(got.q, ref) == (0, 0)
    exact = x.double() / torch.sqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-5) * w.double()
    assert float((values.double() - exact).norm() / exact.norm()) < 1e-6


@pytest.mark.parametrize("granularity,dtype,pow2", FORMS, ids=lambda v: str(v).removeprefix("torch."))
def test_swiglu_quantize_gpu(granularity, dtype, pow2):
    gen = torch.Generator().manual_seed(2)
    rows, cols = 1999, 3584  # Llama-3-70B's ffn / 8
    gate_up = (4 * torch.randn(rows, 2 * cols, generator=gen)).bfloat16()
    gate, up = gate_up.cuda().chunk(2, dim=1)
    q, values = swiglu_quantize(gate, up, granularity, dtype=dtype, power_of_two=pow2, return_values=True)
    h = swiglu32(*gate_up.chunk(2, dim=1))
    # The sigmoid's fixed float32 steps, compiled without FMA contraction, give the CPU's bits.
    assert _mismatches(q, quantize(h.cuda(), granularity, dtype=dtype, power_of_two=pow2)) == (0, 0)
    assert torch.equal(values.cpu(), h.bfloat16())  # values written in bf16
    exact = gate_up.double().chunk(2, dim=1)
    exact = exact[0] * torch.sigmoid(exact[0]) * exact[1]
    assert float((h.double() - exact).norm() / exact.norm()) < 1e-6
