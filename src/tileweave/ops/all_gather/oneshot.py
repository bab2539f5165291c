"""AllGather+GEMM's one-shot path: the shard into its rows of this call's slot of the one-shot buffer
(a symmetric ``[M, K]`` gather buffer), then one kernel (``tileweave.kernels.oneshot``) that signals
the peers, waits for theirs and copies their rows of their slots into ours over NVLink, then one cuBLAS
GEMM over the whole slot. Two slots, used in turn (``oneshot_slots``): no call waits for anything but
the peers' shards of the same call, and a returned gathered view stays intact until this rank's call
after next (more than the op promises: until its next call)."""

from __future__ import annotations

import torch

from tileweave.ops.compute.oneshot_launch import launch_gather_rows
from tileweave.ops.dense import oneshot_finish, oneshot_launch_plan, oneshot_start
from tileweave.ops.skeleton import Call
from tileweave.ops.workspace import oneshot_slots


def run(call: Call, a_shard, b, bias, out, return_gathered: bool, gathered_out, scaled=None):
    if scaled is not None:  # the op's checks refuse it first; a plan never gets here with float8
        raise TypeError("all_gather_gemm's one-shot path does not take float8 inputs")
    backend = call.backend
    call.memory.return_lent()
    mc, k = a_shard.shape
    rank, w = backend.rank, backend.world_size
    m = mc * w

    def make(ws) -> tuple:
        return (oneshot_slots(ws, (m, k), a_shard.dtype),
                oneshot_launch_plan(call, ws, a_shard.dtype, rows=mc, cols=k, parts=w - 1))

    ws, gathered, gather_plan, epoch = oneshot_start(call, m, k, a_shard.dtype, make)
    gathered[rank * mc:(rank + 1) * mc].copy_(a_shard)
    launch_gather_rows(gather_plan, gathered, epoch)
    if out is None:  # cuBLAS allocating its output costs the host less than writing into one
        out = torch.mm(gathered, b) if bias is None else torch.addmm(bias, gathered, b)
    elif bias is None:
        torch.mm(gathered, b, out=out)
    else:
        torch.addmm(bias, gathered, b, out=out)
    oneshot_finish(call)
    if gathered_out is not None:
        return out, gathered_out.copy_(gathered)
    return (out, gathered) if return_gathered else out
