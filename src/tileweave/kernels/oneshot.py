"""The one-shot paths' kernels: every rank's data is in its symmetric buffer before the kernel starts,
and one kernel per call moves what this rank needs of its peers' over NVLink.

Both run right after the work that filled this rank's buffer on the caller's stream, so when one
starts, this rank's data for the call is complete. Every program first tells every peer so (the epoch
into the peer's flag word for this rank, a release at system scope; every program, so that none relies
on another being scheduled or resident), then waits until every peer has told it the same, and then
moves data:

* ``reduce_rows_kernel`` (GEMM+ReduceScatter): every rank's buffer holds its whole partial ``[M, N]``;
  this rank sums its rows of all of them in fp32 in rank order (the result is the same bitwise on every
  run), adds the bias once and writes the output.
* ``gather_rows_kernel`` (AllGather+GEMM): every rank's buffer is an ``[M, K]`` gather buffer holding its
  own shard in its rows; this rank copies every peer's rows of theirs into its own, which a GEMM then
  reads whole.

A wait that expires records its code in ``err_ptr`` (device memory, atomic max) and in ``host_err_ptr``,
pinned host memory that the host reads on its next call without a driver call or a copy.
"""

import triton
import triton.language as tl

from tileweave.kernels.sync import wait_epoch


@triton.jit
def _signal_and_wait(signal_ptr, ready_ptr, err_ptr, host_err_ptr, epoch, max_spin, rank, WORLD: tl.constexpr):
    """Tell every peer this rank's data for ``epoch`` is in (``signal_ptr[p]``: the int64 address of
    rank p's flag word for this rank), then wait for every peer's word here (``ready_ptr[p]``). Returns
    0 once all are in, 1 if a wait expired. Callers mask their loads with it: the loads then depend on
    the waits' results and cannot be scheduled above them, and after an expired wait none is made."""
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
    return missed


@triton.jit(do_not_specialize=["epoch", "max_spin", "rank"])
def reduce_rows_kernel(part_ptr, peer_offs_ptr, signal_ptr, ready_ptr, out_ptr, bias_ptr, err_ptr, host_err_ptr,
                       epoch, max_spin, rank, rows, n, row0, stride_p, stride_out,
                       WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
    """``part_ptr``: this rank's partial for this call (``[M, N]``, row stride ``stride_p``); rank p's
    is at ``part_ptr + peer_offs_ptr[p]`` (int64 element offsets). Writes
    ``out[r, :] = sum over p of part_p[row0 + r, :] (+ bias)`` for ``r < rows``."""
    pid = tl.program_id(0)
    missed = _signal_and_wait(signal_ptr, ready_ptr, err_ptr, host_err_ptr, epoch, max_spin, rank, WORLD)
    tiles_n = tl.cdiv(n, BN)
    tiles = tl.cdiv(rows, BM) * tiles_n
    for t in range(pid, tiles, P):
        r = (t // tiles_n) * BM + tl.arange(0, BM)
        c = (t % tiles_n) * BN + tl.arange(0, BN)
        mask = (r < rows)[:, None] & (c < n)[None, :] & (missed == 0)
        offs = (row0 + r).to(tl.int64)[:, None] * stride_p + c[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            acc += tl.load(part_ptr + tl.load(peer_offs_ptr + p) + offs, mask=mask).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c < n).to(tl.float32)[None, :]
        dst = out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["epoch", "max_spin", "rank"])
def gather_rows_kernel(buf_ptr, peer_offs_ptr, signal_ptr, ready_ptr, err_ptr, host_err_ptr,
                       epoch, max_spin, rank, mc, k, stride,
                       WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr):
    """``buf_ptr``: this rank's gather buffer for this call (``[W * mc, k]``, row stride ``stride``),
    its own rows already in; rank p's is at ``buf_ptr + peer_offs_ptr[p]``. Copies rows
    ``[p * mc, (p + 1) * mc)`` of every peer p's buffer into the same rows of this rank's."""
    pid = tl.program_id(0)
    missed = _signal_and_wait(signal_ptr, ready_ptr, err_ptr, host_err_ptr, epoch, max_spin, rank, WORLD)
    tiles_k = tl.cdiv(k, BN)
    per_peer = tl.cdiv(mc, BM) * tiles_k
    for t in range(pid, (WORLD - 1) * per_peer, P):
        src = (rank + 1 + t // per_peer) % WORLD
        local = t % per_peer
        r = (local // tiles_k) * BM + tl.arange(0, BM)
        c = (local % tiles_k) * BN + tl.arange(0, BN)
        mask = (r < mc)[:, None] & (c < k)[None, :] & (missed == 0)
        offs = (src * mc + r).to(tl.int64)[:, None] * stride + c[None, :]
        tile = tl.load(buf_ptr + tl.load(peer_offs_ptr + src) + offs, mask=mask)
        tl.store(buf_ptr + offs, tile, mask=mask)
