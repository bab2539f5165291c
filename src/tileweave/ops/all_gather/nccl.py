"""AllGather+GEMM's unfused path: NCCL all-gather, then one GEMM (cuBLAS; tileweave's matmul on the
CPU). It captures in a CUDA graph like any NCCL + cuBLAS code. Float8 calls gather the rows as bytes
and the a-scales in their gathered form (``tileweave.ops.dense``), then run tileweave's scaled
``matmul`` once over all rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.compute.matmul import matmul
from tileweave.ops.skeleton import Call


def run(call: Call, a_shard, b, bias, out, return_gathered: bool, gathered_out, scaled=None):
    backend = call.backend
    if scaled is not None:
        # float8 travels as bytes (what every backend moves); the scales as float32 rows.
        rows = common.all_gather_rows(a_shard, backend)
        gathered_scales = common.all_gather_rows(scaled.shard_rows(a_shard.shape[0]), backend)
        out = matmul(rows, b, bias=bias, out=out, **scaled.gathered_args(gathered_scales, b.shape[1]))
        call.record("fallback")
        return (out, rows, gathered_scales) if return_gathered else out
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


def run_local(call: Call, a_shard, b, bias, out, return_gathered: bool, gathered_out, scaled=None):
    """A group of one: the GEMM alone."""
    out = matmul(a_shard, b, bias=bias, out=out, **({} if scaled is None else scaled.matmul_args()))
    call.record("local")
    if scaled is not None and return_gathered:
        return out, a_shard, scaled.shard_rows(a_shard.shape[0])
    if gathered_out is not None:
        return out, gathered_out.copy_(a_shard)
    return (out, a_shard) if return_gathered else out
