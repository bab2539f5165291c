"""The one-shot reduce-scatter: every rank's partial product is already in its symmetric buffer; each
rank sums its own rows of all of them.

Each rank's GEMM writes its whole partial ``[M, N]`` into its slot of the symmetric buffer, on the
caller's stream. This kernel runs next on that stream, so when it starts the partial is complete. Every
program first tells every peer so (the epoch into the peer's READY word for this rank, a release at
system scope), then waits until every peer has told it the same, and then reads rows
``[row0, row0 + rows)`` of every rank's partial, its own locally and the peers' over NVLink, sums them
in fp32 in rank order (so the result is the same bitwise on every run), adds the bias once and writes
the output. One launch after the GEMM; no copy engine, no stream memory op, no NCCL.
"""

import triton
import triton.language as tl

from tileweave.kernels.sync import wait_epoch


@triton.jit(do_not_specialize=["epoch", "max_spin", "rank"])
def reduce_rows_kernel(part_ptr, peer_offs_ptr, signal_ptr, ready_ptr, out_ptr, bias_ptr, err_ptr, host_err_ptr,
                       epoch, max_spin, rank, rows, n, row0, stride_p, stride_out,
                       WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
    """``part_ptr``: this rank's slot for this call (``[M, N]``, row stride ``stride_p``); rank p's
    slot is at ``part_ptr + peer_offs_ptr[p]`` (int64 element offsets). ``signal_ptr[p]``: the int64
    address of rank p's READY word for this rank; ``ready_ptr[p]``: this rank's READY word for rank p.
    Writes ``out[r, :] = sum over p of part_p[row0 + r, :] (+ bias)`` for ``r < rows``. A wait that
    expires records its code in ``err_ptr`` (device memory, atomic max) and in ``host_err_ptr``: pinned
    host memory, which the host reads on its next call without a driver call or a copy."""
    pid = tl.program_id(0)
    # Every program signals (the same value, idempotent): none relies on another being scheduled.
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        flag = tl.load(signal_ptr + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    missed = 0
    code = 0
    for step in tl.static_range(1, WORLD):
        src = (rank + step) % WORLD
        late = wait_epoch(ready_ptr + src, epoch, err_ptr, 100 + src, max_spin)
        missed = tl.maximum(missed, late)
        code = tl.maximum(code, late * (100 + src))
    if code != 0:
        tl.store(host_err_ptr, code)
    tiles_n = tl.cdiv(n, BN)
    tiles = tl.cdiv(rows, BM) * tiles_n
    for t in range(pid, tiles, P):
        r = (t // tiles_n) * BM + tl.arange(0, BM)
        c = (t % tiles_n) * BN + tl.arange(0, BN)
        mask = (r < rows)[:, None] & (c < n)[None, :]
        # ``missed`` (0 once the flags are in) makes the loads depend on the waits' results.
        offs = (row0 + r).to(tl.int64)[:, None] * stride_p + c[None, :] + missed
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            acc += tl.load(part_ptr + tl.load(peer_offs_ptr + p) + offs, mask=mask).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c < n).to(tl.float32)[None, :]
        dst = out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
