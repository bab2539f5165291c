"""GEMM+ReduceScatter's chunked transport, pushing: cuBLAS GEMMs per owner and row block, owners' blocks
first, each copied to its owner's receive slot by the copy engines as soon as it is done; the own rows
last, each block adding the arrived partials (in rank order: deterministic) in its GEMM.

Flags: the block arrival words, one per (source, row block), and the workspace's RELEASED words for
the receive slots. Each block is computed into its own slot of the workspace's send buffer, so that no
allocation waits on the copy stream; the call ends by joining that stream, so the next call may
overwrite it. Graphable: with constant-valued flags, a producer waits until its RELEASED word for an
owner is 1, sets it to 0, and after each block's copy sets the owner's arrival word for it to 1; the
owner waits for arrival == 1, adds the block, and once all are in sets its arrival words back to 0 and
then each producer's RELEASED word to 1. Memory: ``2 (W-1)/W x [M, N]`` (receive slots, send buffer).

Float8 calls: every block's GEMM is tileweave's scaled ``matmul`` (the rows' a-scales with them), the
sent partials in the output dtype; an own block's partial stays fp32 and is added to the arrived ones
(fp32, rank order) before the one rounding.
"""

from __future__ import annotations

import torch

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.reduce_scatter.blocks import BLOCK_FLAGS, block_plan, block_rows
from tileweave.ops.skeleton import Call, finish_streams
from tileweave.ops.workspace import BLOCK_ARRIVAL, RELEASED, FlagValues, Workspace
from tileweave.runtime.backend import Backend


def run(call: Call, a, b, bias, out, scaled=None) -> None:
    backend = call.backend
    w, rank = backend.world_size, backend.rank
    m, n = a.shape[0], b.shape[1]
    mc = m // w
    nbytes = (w - 1) * mc * n * out.element_size()
    ws, (sends, owns, arrivals, releases) = block_plan(call, a, m, n, nbytes, "rs-chunked", _plan, send_bytes=nbytes,
                                                       dtype=out.dtype)
    ws.epoch += 1
    values = FlagValues(ws.epoch, call.graphable)
    for released, per_block in sends:
        for j, (a_rows, part, dst, arrival) in enumerate(per_block):
            if scaled is None:
                torch.mm(a[a_rows], b, out=part)
            else:
                matmul(a[a_rows], b, out=part, **scaled.matmul_args(a_rows))
            backend.comm_begin()  # the copy stream waits for this block's GEMM
            if j == 0:
                values.claim(backend, released)
            backend.comm_copy(dst, part)
            backend.comm_write(arrival, values.ready)
    own = a[rank * mc:(rank + 1) * mc]
    for rows, block_arrivals, slots in owns:
        for address in block_arrivals:
            backend.main_wait(address, values.ready)
        if scaled is not None:
            own_rows = slice(rank * mc + rows.start, rank * mc + rows.stop)
            total = matmul(own[rows], b, **scaled.matmul_args(own_rows, out_dtype=torch.float32))
            for slot in slots:  # in rank order, after the own partial: deterministic
                total += slot.float()
            if bias is not None:
                total += bias.float()
            out[rows].copy_(total)
            continue
        if len(slots) == 1 and bias is None:
            partials = slots[0]
        else:  # in rank order: the sum is deterministic
            total = sum(slot.float() for slot in slots)
            partials = (total + bias.float() if bias is not None else total).to(a.dtype)
        torch.addmm(partials, own[rows], b, out=out[rows])
    values.release(backend, arrivals, releases)
    backend.comm_end()
    finish_streams(call.backend)
    call.record("chunked")


def _plan(ws: Workspace, backend: Backend, mc: int, n: int, dtype: torch.dtype, blocks: int) -> tuple:
    """Views, buffers and flag addresses for one shape: per owner (its RELEASED flag for us, per block:
    our rows of ``a``, our send slot, its receive rows for us, its arrival flag), per own block (rows,
    arrival flags and receive rows of each source in rank order), all our arrival flags, the releases."""
    w, rank = backend.world_size, backend.rank
    rows_of = block_rows(mc, blocks)
    send = ws.local[:(w - 1) * mc * n * dtype.itemsize].view(dtype).view(w - 1, mc, n)
    sends = []
    for step in range(w - 1):
        owner = (rank + 1 + step) % w
        dst = ws.data.view(owner, dtype, (w - 1, mc, n))[(rank - owner - 1) % w]
        sends.append((ws.flag_address(rank, RELEASED, owner), tuple(
            (slice(owner * mc + r.start, owner * mc + r.stop), send[step, r], dst[r],
             ws.block_flag_address(owner, BLOCK_ARRIVAL, rank * BLOCK_FLAGS + j))
            for j, r in enumerate(rows_of))))
    slots = ws.data.view(rank, dtype, (w - 1, mc, n))
    sources = [src for src in range(w) if src != rank]
    owns = tuple((r, tuple(ws.block_flag_address(rank, BLOCK_ARRIVAL, src * BLOCK_FLAGS + j) for src in sources),
                  tuple(slots[(src - rank - 1) % w, r] for src in sources))
                 for j, r in enumerate(rows_of))
    releases = tuple(ws.flag_address(p, RELEASED, rank) for p in sources)
    return tuple(sends), owns, tuple(address for _, own, _ in owns for address in own), releases
