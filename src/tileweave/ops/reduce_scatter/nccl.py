"""GEMM+ReduceScatter's unfused path: one GEMM, then NCCL reduce-scatter (on the CPU, tileweave's matmul
and an fp32 all-reduce). It captures in a CUDA graph like any NCCL + cuBLAS code. Float8 calls run
tileweave's scaled ``matmul`` (its partial in the output dtype on GPUs, as NCCL sums it; fp32 on the
CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.skeleton import Call


def run(call: Call, a, b, bias, out, scaled=None) -> None:
    backend = call.backend
    if scaled is not None:
        partial = matmul(a, b, **scaled.matmul_args(out_dtype=out.dtype if a.is_cuda else torch.float32))
        if a.is_cuda:
            dist.reduce_scatter_tensor(out, partial, group=backend.group)
        else:
            dist.all_reduce(partial, group=backend.group)
            out.copy_(partial.chunk(backend.world_size)[backend.rank])
    elif a.is_cuda:
        dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=backend.group)
    else:
        partial = matmul(a, b).float()
        dist.all_reduce(partial, group=backend.group)
        out.copy_(partial.chunk(backend.world_size)[backend.rank])
    if bias is not None:
        out += bias
    call.record("fallback")


def run_local(call: Call, a, b, bias, out, scaled=None) -> None:
    """A group of one: the GEMM alone."""
    matmul(a, b, bias=bias, out=out, **({} if scaled is None else scaled.matmul_args()))
    call.record("local")
