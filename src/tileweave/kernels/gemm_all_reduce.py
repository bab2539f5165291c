"""The all-reduce kernels of GEMM + AllReduce: each rank's partial ``[M, N]`` is in its slot of a symmetric
buffer (the GEMM wrote it there) when the kernel starts; the kernel sums every rank's partial in fp32 in
rank order, adds the bias once and, fused, the residual and the RMSNorm. A program owns whole rows
(``BM`` at a time) and walks N in ``BN`` columns: first the sum (+ bias + residual), stored, with each
row's sum of squares; then, with a norm, the stored sum read back and scaled by
``rsqrt(mean + eps) * norm_weight``.

* ``oneshot_kernel``: every rank sums all M rows of every partial (reads (W-1) partials over NVLink).
* ``twoshot_kernel``: rank r sums its rows ``[r*M/W, (r+1)*M/W)`` into its own slot (in place of its
  partial's rows, which no peer reads), flags each finished block of rows to every peer, and copies
  every peer's reduced blocks from the peer's slot as they are flagged: (W-1)/W of the traffic twice.

Flags (int32, in the op's flag buffer, ``tileweave.ops.all_reduce.transports`` has the layout):

* ``ready[src]``: src's partial of this call is in its slot. ``done[src * MAX_BLOCKS + j]``: src's
  reduced block j is in its slot (two-shot).
* Epoch protocol (``CONSTANT`` off): the words carry the call's epoch and are never reset; every
  program signals (the same value, so none relies on another being scheduled). Slots alternate by call,
  which keeps a rank from overwriting a slot a peer still reads (see the transport).
* Constant protocol (``CONSTANT``, graphable): a word is 1 when written and its reader sets it back to
  0. One program signals ``ready`` (the first to claim ``sync[0]``), so no late program can set a word
  that its reader has already reset; the last program to finish (``sync[1]`` counts them) resets
  ``ready`` and ``sync``, then sets ``free`` at every peer: this rank has finished reading the peer's
  slot, which the peer's next call waits for before its GEMM overwrites it.

A wait that expires records its code in ``err_ptr`` and in ``host_err_ptr`` (pinned host memory the host
reads without a driver call); the loads after it are masked off, and the kernel finishes.
"""

import triton
import triton.language as tl

from tileweave.kernels.sync import wait_epoch

MAX_BLOCKS = 256
"""Row blocks per rank's share of the rows that the two-shot kernel flags (its ``done`` words per source)."""
ERR_PARTIAL = tl.constexpr(100)
"""Error code base: the partial of rank ``code - ERR_PARTIAL`` never arrived."""
ERR_REDUCED = tl.constexpr(300)
"""Error code base: the reduced rows of rank ``code - ERR_REDUCED`` never arrived (two-shot)."""


@triton.jit
def _announce(ready_sig_ptr, sync_ptr, value, rank, WORLD: tl.constexpr, CONSTANT: tl.constexpr):
    """Set this rank's ``ready`` word at every peer (``ready_sig_ptr[p]``: its int64 address) to ``value``."""
    if CONSTANT:
        first = tl.atomic_xchg(sync_ptr, 1, sem="acq_rel", scope="gpu") == 0
    else:
        first = True
    if first:
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            flag = tl.load(ready_sig_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit
def _wait_ready(ready_ptr, value, err_ptr, host_err_ptr, max_spin, rank, WORLD: tl.constexpr):
    """Wait for every peer's ``ready`` word here; 1 if one expired (its code recorded), else 0."""
    missed = 0
    code = 0
    for step in tl.static_range(1, WORLD):
        src = (rank + step) % WORLD
        late = wait_epoch(ready_ptr + src, value, err_ptr, ERR_PARTIAL + src, max_spin)
        missed = tl.maximum(missed, late)
        code = tl.maximum(code, late * (ERR_PARTIAL + src))
    if code != 0:
        tl.store(host_err_ptr, code)
    return missed


@triton.jit
def _close(ready_ptr, sync_ptr, free_sig_ptr, rank, P: tl.constexpr, WORLD: tl.constexpr):
    """Constant protocol, at the end of every program: the last one resets this call's words and frees
    this rank's reads of every peer's slot."""
    tl.debug_barrier()  # every thread's loads of the peers' slots are done
    finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == P - 1:
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        for step in tl.static_range(1, WORLD):
            src = (rank + step) % WORLD
            tl.atomic_xchg(ready_ptr + src, 0, sem="relaxed", scope="sys")
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            flag = tl.load(free_sig_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, 1, sem="release", scope="sys")


@triton.jit
def _reduce_rows(part_ptr, peer_offs_ptr, r, row_ok, n, stride_p, bias_ptr, res_ptr, stride_res, norm_ptr, eps,
                 y_ptr, stride_y, resid_ptr, stride_r,
                 WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows ``r`` (``row_ok`` masks them) of the sum of every rank's partial (rank p's at
    ``part_ptr + peer_offs_ptr[p]``), + bias, + residual: into ``y`` without a norm, else into ``resid``
    and its RMSNorm into ``y``."""
    dtype = y_ptr.dtype.element_ty
    sq = tl.zeros((BM,), dtype=tl.float32)
    for c0 in range(0, n, BN):
        c = c0 + tl.arange(0, BN)
        mask = row_ok[:, None] & (c < n)[None, :]
        offs = r.to(tl.int64)[:, None] * stride_p + c[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            acc += tl.load(part_ptr + tl.load(peer_offs_ptr + p) + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c < n, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + r.to(tl.int64)[:, None] * stride_res + c[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        if HAS_NORM:
            rounded = acc.to(dtype)
            tl.store(resid_ptr + r.to(tl.int64)[:, None] * stride_r + c[None, :], rounded, mask=mask)
            x = rounded.to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        else:
            tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_y + c[None, :], acc.to(dtype), mask=mask)
    if HAS_NORM:
        tl.debug_barrier()  # the sums stored above, read back below by other threads of the program
        scale = tl.math.rsqrt(sq / n + eps)
        for c0 in range(0, n, BN):
            c = c0 + tl.arange(0, BN)
            mask = row_ok[:, None] & (c < n)[None, :]
            x = tl.load(resid_ptr + r.to(tl.int64)[:, None] * stride_r + c[None, :], mask=mask, other=0.0)
            g = tl.load(norm_ptr + c, mask=c < n, other=0.0).to(tl.float32)
            normed = x.to(tl.float32) * scale[:, None] * g[None, :]
            tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_y + c[None, :], normed.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["value", "max_spin", "rank", "eps"])
def oneshot_kernel(part_ptr, peer_offs_ptr, ready_sig_ptr, ready_ptr, sync_ptr, free_sig_ptr,
                   y_ptr, resid_ptr, bias_ptr, res_ptr, norm_ptr, err_ptr, host_err_ptr,
                   value, max_spin, rank, rows, n, stride_p, stride_y, stride_r, stride_res, eps,
                   WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                   CONSTANT: tl.constexpr):
    """All ``rows`` rows of the sum of every rank's partial ``[rows, n]`` (row stride ``stride_p``) into
    ``y`` (and ``resid``), the same on every rank."""
    pid = tl.program_id(0)
    _announce(ready_sig_ptr, sync_ptr, value, rank, WORLD, CONSTANT)
    missed = _wait_ready(ready_ptr, value, err_ptr, host_err_ptr, max_spin, rank, WORLD)
    for blk in range(pid, tl.cdiv(rows, BM), P):
        r = blk * BM + tl.arange(0, BM)
        _reduce_rows(part_ptr, peer_offs_ptr, r, (r < rows) & (missed == 0), n, stride_p, bias_ptr, res_ptr,
                     stride_res, norm_ptr, eps, y_ptr, stride_y, resid_ptr, stride_r,
                     WORLD, BM, BN, HAS_BIAS, HAS_RESIDUAL, HAS_NORM)
    if CONSTANT:
        _close(ready_ptr, sync_ptr, free_sig_ptr, rank, P, WORLD)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, r, row_ok, n, stride_src, stride_dst, BN: tl.constexpr):
    for c0 in range(0, n, BN):
        c = c0 + tl.arange(0, BN)
        mask = row_ok[:, None] & (c < n)[None, :]
        tile = tl.load(src_ptr + r.to(tl.int64)[:, None] * stride_src + c[None, :], mask=mask)
        tl.store(dst_ptr + r.to(tl.int64)[:, None] * stride_dst + c[None, :], tile, mask=mask)


@triton.jit(do_not_specialize=["value", "max_spin", "rank", "eps"])
def twoshot_kernel(part_ptr, peer_offs_ptr, ready_sig_ptr, ready_ptr, sync_ptr, free_sig_ptr, done_sig_ptr,
                   done_ptr, y_ptr, resid_ptr, bias_ptr, res_ptr, norm_ptr, err_ptr, host_err_ptr,
                   value, max_spin, rank, rows, n, stride_p, resid_offset, stride_y, stride_r, stride_res, eps,
                   WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                   CONSTANT: tl.constexpr, MAX_BLOCKS: tl.constexpr):
    """As ``oneshot_kernel``, in two phases. The slot holds the partial ``[rows, n]`` and, with a norm,
    ``resid_offset`` elements further on, room for the reduced ``resid`` rows. ``done_sig_ptr[p]``: the
    int64 address of peer p's ``done`` words for this rank.

    Program i reduces blocks i, i + P, ... of this rank's rows and, after each, copies the same block of
    every peer's rows: the peer's program i makes it, so no program waits on one that runs after it."""
    pid = tl.program_id(0)
    _announce(ready_sig_ptr, sync_ptr, value, rank, WORLD, CONSTANT)
    missed = _wait_ready(ready_ptr, value, err_ptr, host_err_ptr, max_spin, rank, WORLD)
    lo = rows * rank // WORLD
    hi = rows * (rank + 1) // WORLD
    code = 0
    for j in range(pid, tl.cdiv(tl.cdiv(rows, WORLD), BM), P):
        r = lo + j * BM + tl.arange(0, BM)
        # This rank's block j, reduced in place of its own partial's rows (read by no peer).
        _reduce_rows(part_ptr, peer_offs_ptr, r, (r < hi) & (missed == 0), n, stride_p, bias_ptr, res_ptr,
                     stride_res, norm_ptr, eps, part_ptr, stride_p, part_ptr + resid_offset, stride_p,
                     WORLD, BM, BN, HAS_BIAS, HAS_RESIDUAL, HAS_NORM)
        tl.debug_barrier()  # the block's stores, before the flag that publishes them and the copy below
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            flag = tl.load(done_sig_ptr + peer).to(tl.pointer_type(tl.int32)) + j
            tl.atomic_xchg(flag, value, sem="release", scope="sys")
        for step in tl.static_range(WORLD):
            src = (rank + step) % WORLD
            late = missed
            if step > 0:
                late = tl.maximum(late, wait_epoch(done_ptr + src * MAX_BLOCKS + j, value, err_ptr,
                                                   ERR_REDUCED + src, max_spin))
                code = tl.maximum(code, late * (ERR_REDUCED + src))
                if CONSTANT:
                    tl.atomic_xchg(done_ptr + src * MAX_BLOCKS + j, 0, sem="relaxed", scope="gpu")
            src_lo = rows * src // WORLD
            src_hi = rows * (src + 1) // WORLD
            rs = src_lo + j * BM + tl.arange(0, BM)
            ok = (rs < src_hi) & (late == 0)
            base = part_ptr + tl.load(peer_offs_ptr + src)
            if HAS_NORM:
                _copy_rows(base, y_ptr, rs, ok, n, stride_p, stride_y, BN)
                _copy_rows(base + resid_offset, resid_ptr, rs, ok, n, stride_p, stride_r, BN)
            else:
                _copy_rows(base, y_ptr, rs, ok, n, stride_p, stride_y, BN)
    if code != 0:
        tl.store(host_err_ptr, code)
    if CONSTANT:
        _close(ready_ptr, sync_ptr, free_sig_ptr, rank, P, WORLD)
