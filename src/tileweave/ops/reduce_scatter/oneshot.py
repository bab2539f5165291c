"""GEMM+ReduceScatter's one-shot path: one cuBLAS GEMM over all M rows into this call's slot of the
one-shot buffer, then one kernel (``tileweave.kernels.oneshot``) that signals the peers, waits for
theirs and sums this rank's rows of every rank's partial, the peers' read over NVLink. Two slots, used
in turn (``oneshot_slots``): no call waits for anything but the peers' partials of the same call. The
partials are rounded to the output dtype, as NCCL's are; the sum is fp32 in rank order, the same
bitwise on every run. An expired wait is reported by the next call from a word the kernel writes into
pinned host memory (at once in debug mode and on the CPU). Float8 calls: the GEMM is tileweave's scaled
``matmul`` into a slot of the output dtype."""

from __future__ import annotations

import torch

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.compute.oneshot_launch import launch_reduce_rows
from tileweave.ops.dense import oneshot_finish, oneshot_launch_plan, oneshot_start
from tileweave.ops.skeleton import Call
from tileweave.ops.workspace import oneshot_slots


def run(call: Call, a, b, bias, out, scaled=None) -> None:
    backend = call.backend
    m, n = a.shape[0], b.shape[1]
    w, rank = backend.world_size, backend.rank
    dtype = out.dtype  # the partials' (a's, or a float8 call's output dtype)

    def make(ws) -> tuple:
        return (oneshot_slots(ws, (m, n), dtype),
                oneshot_launch_plan(call, ws, dtype, rows=m // w, cols=n, row0=rank * (m // w)))

    ws, part, reduce_plan, epoch = oneshot_start(call, m, n, dtype, make)
    if scaled is None:
        torch.mm(a, b, out=part)
    else:
        matmul(a, b, out=part, **scaled.matmul_args())
    launch_reduce_rows(reduce_plan, part, out, bias, epoch)
    oneshot_finish(call)
