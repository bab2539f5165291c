"""AllGather+GEMM's chunked transport: the push transport (``push``) with cuBLAS instead of the fused
kernel, one GEMM for the own rows while the shards travel, then one per peer's rows once the caller's
stream has waited for that peer's ready flag (a stream memory op, no SM spins)."""

from __future__ import annotations

import torch

from tileweave.ops.all_gather.push import run_pushed
from tileweave.ops.skeleton import Call
from tileweave.ops.workspace import READY


def _gemms(call: Call, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    backend = call.backend
    w, rank = backend.world_size, backend.rank
    mc = a_shard.shape[0]
    for step in range(w):
        src = (rank + step) % w
        rows = slice(src * mc, (src + 1) * mc)
        if step:
            backend.main_wait(ws.flag_address(rank, READY, src), ready)
        lhs = a_shard if step == 0 else pushes.gathered[rows]
        if bias is not None:
            torch.addmm(bias, lhs, b, out=out[rows])
        else:
            torch.mm(lhs, b, out=out[rows])


def run(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    return run_pushed(call, _gemms, a_shard, b, bias, out, return_gathered, gathered_out)
