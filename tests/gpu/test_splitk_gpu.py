"""The decode-shaped GEMM (split-K) compiled on a GPU against float64: bf16 and fp16, the shapes of a decode
step (M 1-64, odd N, K off the step), eager and replayed from a CUDA graph with new inputs, bitwise
repeatable."""

import pytest
import torch

from gpus import needs_gpu  # noqa: F401 - skips the module under the interpreter
import tileweave

pytestmark = [pytest.mark.gpu, needs_gpu]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel(got, ref):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (8, 1000, 14336), (33, 6144, 4096), (64, 520, 1000),
                                   (5, 8192, 3584)])
def test_splitk_matches_reference(dtype, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * 7919 + n + k)
    a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    tileweave.matmul(a, w.t(), bias=bias, out=out)
    assert tileweave.last_path("matmul") == "splitk"
    ref = a.double() @ w.double().t() + bias.double()
    assert _rel(out, ref) < TOL[dtype]
    again = tileweave.matmul(a, w.t(), bias=bias)
    assert torch.equal(out, again)


def test_splitk_in_a_cuda_graph_with_new_inputs():
    m, n, k = 4, 4096, 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tileweave.matmul(a, w.t(), out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tileweave.matmul(a, w.t(), out=out)
    for _ in range(3):
        a.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, a.double() @ w.double().t()) < TOL[torch.bfloat16]
