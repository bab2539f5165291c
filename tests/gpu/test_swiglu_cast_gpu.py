"""The grouped GEMM's SwiGLU epilogue writing h's float8 cast (``SwiGLU(cast=...)``) compiled on a GPU,
with the configs it picks there, at MoE layer 0's shapes: the pre-activations of exact float8 operands
equal their float64 products, and the cast equals ``quantize`` (on the GPU) of the plain epilogue's
float32 h under the same config, bit for bit, call after call (the rowwise and tensorwise amaxes are
atomic maxima raised concurrently over the SMs here); h against float64. Skipped without a CUDA GPU."""

import pytest
import torch

from gpus import needs_gpu
from support.scenarios.moe_cast import E4M3, E5M2, dequantized_a, dequantized_b, exact_fp8, gen, scales
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_config, grouped_gemm
from tileweave.ops.compute.quantize import quantize

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("cast,dtype,pow2", [("blockwise_1x128", E4M3, False), ("rowwise", E4M3, True),
                                             ("tensorwise", E4M3, False), ("tensorwise", E5M2, False)],
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("f,experts,rows", [(704, 64, 6000), (768, 8, 20000)])  # DeepSeek-V2-Lite, F off 128
def test_swiglu_cast_gpu(cast, dtype, pow2, f, experts, rows):
    k = 2048
    scaling = cast.removesuffix("_1x128")
    g = gen("gpu", cast, f)
    counts = (torch.rand(experts, generator=g) ** 3 * 2 * rows / experts).long()  # uneven experts
    counts[::7] = 0  # and empty ones
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int().cuda()
    p = int(counts.sum())
    a = exact_fp8(g, 4096, k, high=2)  # sums exact in float32 at K = 2048 (support.scenarios.moe_cast)
    a_rows = torch.randint(0, 4096, (p,), generator=g)
    b = exact_fp8(g, experts, 2 * f, k, high=2).transpose(1, 2)
    scale_a, scale_b = scales(g, scaling, 4096, 2 * f, k, experts)
    config = grouped_config(p, 2 * f, k, experts, E4M3, torch.device("cuda"), swiglu=True,
                            block_cast=cast == "blockwise_1x128")
    args = dict(a_rows=a_rows.cuda(), scale_a=scale_a.cuda(), scale_b=scale_b.cuda(), out_dtype=torch.float32,
                config=config)
    pre = torch.empty(p, 2 * f, device="cuda")
    h = grouped_gemm(a.cuda(), b.cuda(), offsets, epilogue=SwiGLU(pre=pre), **args)
    ref = quantize(h, cast, dtype=dtype, power_of_two=pow2, pad=cast == "blockwise_1x128")
    for _ in range(5):
        got = grouped_gemm(a.cuda(), b.cuda(), offsets, **args,
                           epilogue=SwiGLU(cast=cast, cast_dtype=dtype, power_of_two=pow2))
        assert int((got.data.view(torch.uint8) != ref.data[:, :f].view(torch.uint8)).sum()) == 0
        assert torch.equal(got.scale, ref.scale)
    # The pre-activations are exact (integer float8 values, power-of-two scales); h against float64.
    experts_of = torch.repeat_interleave(torch.arange(experts), counts)
    x = dequantized_a(a, scale_a)[a_rows]
    w = dequantized_b(b, scale_b)
    sample = torch.randperm(p, generator=g)[:512]
    exact = torch.stack([x[r] @ w[experts_of[r]] for r in sample.tolist()])
    assert torch.equal(pre.cpu()[sample].view(-1, f, 2).double(), torch.stack([exact[:, :f], exact[:, f:]], 2))
    silu = exact[:, :f] * torch.sigmoid(exact[:, :f]) * exact[:, f:]
    assert float((h.cpu()[sample].double() - silu).norm() / silu.norm()) < 1e-6
