"""AllGather+GEMM's unfused path: NCCL all-gather, then one GEMM (cuBLAS; tileweave's matmul on the
CPU). It captures in a CUDA graph like any NCCL + cuBLAS code."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.skeleton import Call


def run(call: Call, a_shard, b, bias, out, return_gathered: bool, gathered_out):
    backend = call.backend
    gathered = gathered_out
    if gathered is None:
        gathered = torch.empty((a_shard.shape[0] * backend.world_size, a_shard.shape[1]), dtype=a_shard.dtype,
                               device=a_shard.device)
    a_shard = a_shard.contiguous()
    if a_shard.is_cuda:
        dist.all_gather_into_tensor(gathered, a_shard, group=backend.group)
        # cuBLAS allocating its own output costs the host about half of writing into a given one.
        if out is None:
            out = torch.matmul(gathered, b) if bias is None else torch.addmm(bias, gathered, b)
        elif bias is None:
            torch.mm(gathered, b, out=out)
        else:
            torch.addmm(bias, gathered, b, out=out)
    else:
        dist.all_gather(list(gathered.chunk(backend.world_size)), a_shard, group=backend.group)
        out = matmul(gathered, b, bias=bias, out=out)
    call.record("fallback")
    return (out, gathered) if return_gathered else out


def run_local(call: Call, a_shard, b, bias, out, return_gathered: bool, gathered_out):
    """A group of one: the GEMM alone."""
    out = matmul(a_shard, b, bias=bias, out=out)
    call.record("local")
    if gathered_out is not None:
        return out, gathered_out.copy_(a_shard)
    return (out, a_shard) if return_gathered else out
