"""GEMM+ReduceScatter's chunked transport with pulls, two ranks (``GemmReduceScatter.pull``): each rank
computes the peer's row blocks into its symmetric buffer, and the owner's copy stream pulls them
straight into the output rows, on which the own rows' GEMM then accumulates in place. This saves the
local device-to-device copy that an out-of-place ``addmm`` makes of every received partial.

Flags, by epoch: our arrival words for the peer's blocks (its caller's stream raises each after the
block's GEMM), our landed words (our copy stream raises each once the block has landed), and the
RELEASED words of the two send buffers (each owner's copy stream raises the peer's after its last pull).
Not graphable (its flags carry epochs).

With several blocks per owner (``PULL_MAX_BLOCKS`` at most) each pulled block lands in its rows of
``out`` and the own rows' GEMM of that block adds onto it in place, while the next block is pulled.
With one block that would put the whole pull between the two GEMMs, so there the pull lands in a
private buffer while the own rows' GEMM writes ``out``, and one add follows: the own partial is then
rounded to the output dtype before the sum, like the peer's (the sum itself is in fp32, and the same on
every run).

Float8 calls: the GEMMs are tileweave's scaled ``matmul`` (the rows' a-scales with them), the peer's
blocks in the output dtype; an own block's fp32 partial is added to the pulled one in fp32, rounded once
(so the in-place accumulation becomes a read and a write of the block).
"""

from __future__ import annotations

import torch

from tileweave.ops.compute.matmul import matmul
from tileweave.ops.reduce_scatter.blocks import BLOCK_FLAGS, block_plan, block_rows, blocks_for
from tileweave.ops.skeleton import Call, finish_streams
from tileweave.ops.workspace import BLOCK_ARRIVAL, BLOCK_LANDED, RELEASED, Workspace
from tileweave.runtime.backend import Backend


def run(call: Call, a, b, bias, out, scaled=None) -> None:
    backend = call.backend
    rank = backend.rank
    m, n = a.shape[0], b.shape[1]
    mc = m // 2
    nbytes = mc * n * out.element_size()
    blocks = blocks_for(mc, a.shape[1], n, pull=True, chunk_rows=call.options.get("chunk_rows", 0))
    ws, entry = block_plan(call, a, m, n, nbytes, "rs-pull", _plan, send_bytes=nbytes if blocks == 1 else 0,
                           blocks=blocks, dtype=out.dtype)
    rows_of, send, peer_send, announce, arrivals, landed, release_peer, released, recv = entry
    ws.epoch += 1
    epoch = ws.epoch
    # Issue order matters on the GPU: two streams may share one hardware queue, so a stream wait on the
    # peer's flag is issued only after the work of ours that the peer waits for (each block's GEMM and
    # announcement before the copy stream waits for the peer's same block); queued before them, the
    # copy stream's first wait can deadlock both ranks.
    backend.comm_begin()  # the copy stream after out's allocation
    # Our send buffer is free once the peer has pulled the previous call's blocks out of it.
    backend.main_wait(released, epoch - 1)
    peer_rows = a[(1 - rank) * mc:(2 - rank) * mc]
    for r, address, arrival, done in zip(rows_of, announce, arrivals, landed):
        # The bias goes into the peer's rows here, once (the owner's GEMM then adds onto them in place).
        if scaled is not None:
            peer_r = slice((1 - rank) * mc + r.start, (1 - rank) * mc + r.stop)
            matmul(peer_rows[r], b, bias=bias, out=send[r], **scaled.matmul_args(peer_r))
        elif bias is None:
            torch.mm(peer_rows[r], b, out=send[r])
        else:
            torch.addmm(bias, peer_rows[r], b, out=send[r])
        backend.main_write(address, epoch)
        # The peer's block of our rows, once announced, straight into its rows of out (one block: recv).
        backend.comm_wait(arrival, epoch)
        backend.comm_copy(out[r] if recv is None else recv, peer_send[r])
        backend.comm_write(done, epoch)
    backend.comm_write(release_peer, epoch)
    own = a[rank * mc:(rank + 1) * mc]
    if recv is None:
        for r, done in zip(rows_of, landed):
            backend.main_wait(done, epoch)
            if scaled is not None:
                own_r = slice(rank * mc + r.start, rank * mc + r.stop)
                out[r].copy_(matmul(own[r], b, **scaled.matmul_args(own_r, out_dtype=torch.float32)) + out[r].float())
            else:
                torch.addmm(out[r], own[r], b, out=out[r])  # in place: C is D, no copy of the partial
    elif scaled is not None:
        own_part = matmul(own, b, **scaled.matmul_args(slice(rank * mc, (rank + 1) * mc), out_dtype=torch.float32))
        backend.main_wait(landed[0], epoch)
        out.copy_(own_part + recv.float())
    else:
        torch.mm(own, b, out=out)  # while the copy stream pulls
        backend.main_wait(landed[0], epoch)
        out.add_(recv)
    # No closing join of the copy stream (two driver calls): the caller's stream has already waited for
    # every pulled block by its landed word, the copy stream's last write (the peer's release) orders
    # nothing here, and the next call's copies queue behind this call's work on both streams. This path
    # never runs under CUDA-graph capture, which would need the join.
    finish_streams(call.backend)
    call.record("chunked")


def _plan(ws: Workspace, backend: Backend, mc: int, n: int, dtype: torch.dtype, blocks: int) -> tuple:
    """Per block: its rows; our send buffer and the peer's; our arrival words in the peer's flags and
    the peer's in ours; our landed words; the peer's RELEASED word for us and ours for it; with one
    block, the private buffer the pull lands in (None otherwise)."""
    rank, peer = backend.rank, 1 - backend.rank
    recv = ws.local[:mc * n * dtype.itemsize].view(dtype).view(mc, n) if blocks == 1 else None
    return (block_rows(mc, blocks), ws.data.view(rank, dtype, (mc, n)), ws.data.view(peer, dtype, (mc, n)),
            tuple(ws.block_flag_address(peer, BLOCK_ARRIVAL, rank * BLOCK_FLAGS + j) for j in range(blocks)),
            tuple(ws.block_flag_address(rank, BLOCK_ARRIVAL, peer * BLOCK_FLAGS + j) for j in range(blocks)),
            tuple(ws.block_flag_address(rank, BLOCK_LANDED, j) for j in range(blocks)),
            ws.flag_address(peer, RELEASED, rank), ws.flag_address(rank, RELEASED, peer), recv)
