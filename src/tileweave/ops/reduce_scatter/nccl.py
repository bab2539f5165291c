"""GEMM+ReduceScatter's unfused path: one GEMM, then NCCL reduce-scatter (on the CPU, tileweave's matmul
and an fp32 all-reduce). It captures in a CUDA graph like any NCCL + cuBLAS code."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.skeleton import Call


def run(call: Call, a, b, bias, out) -> None:
    backend = call.backend
    if a.is_cuda:
        dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=backend.group)
    else:
        partial = matmul(a, b).float()
        dist.all_reduce(partial, group=backend.group)
        out.copy_(partial.chunk(backend.world_size)[backend.rank])
    if bias is not None:
        out += bias
    call.record("fallback")


def run_local(call: Call, a, b, bias, out) -> None:
    """A group of one: the GEMM alone."""
    matmul(a, b, bias=bias, out=out)
    call.record("local")
