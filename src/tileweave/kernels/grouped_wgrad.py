"""The weight gradient of a grouped GEMM over a routing plan, without permuted copies:

    out[e] = sum over the rows p of expert e of (lhs[l(p)] * scale[p]).T @ rhs[r(p)]      [N, K]

``l(p)`` / ``r(p)`` read a row index (``L_GATHER`` / ``R_GATHER``) or are p itself. Expert e's rows are
the groups ``s * E + e`` of every source s (``sources`` of them; one at world size 1), each the plan rows
``[offsets[g], offsets[g + 1])``; they are visited in source order and within a group in row order,
``BR`` rows per step, so the sum's order is fixed (deterministic). One program per output tile
``(e, n tile, k tile)``, the tiles of one expert consecutive (they share its rows in L2). An expert
with no rows gets zeros.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_wgrad_kernel(lhs_ptr, l_rows_ptr, rhs_ptr, r_rows_ptr, scale_ptr, offsets_ptr, out_ptr,
                         E, sources, N, K,
                         stride_lm, stride_rm, stride_oe, stride_on,
                         BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, S_BLOCK: tl.constexpr,
                         L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    expert = pid // (num_n * num_k)
    within = pid % (num_n * num_k)
    pid_n = within // num_k
    pid_k = within % num_k
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_n = offs_n < N
    mask_k = offs_k < K
    # The expert's segments (one per source) in registers, so that a single loop walks all of its rows:
    # the software pipeliner does not pipeline an inner loop nested in a loop over the segments.
    lane = tl.arange(0, S_BLOCK)
    seg_lo = tl.load(offsets_ptr + lane * E + expert, mask=lane < sources, other=0)
    seg_hi = tl.load(offsets_ptr + lane * E + expert + 1, mask=lane < sources, other=0)
    seg_steps = tl.cdiv(seg_hi - seg_lo, BR)
    seg_ends = tl.cumsum(seg_steps, 0)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i in tl.range(0, tl.sum(seg_steps)):
        seg = tl.sum((seg_ends <= i).to(tl.int32))
        first = tl.sum(tl.where(lane < seg, seg_steps, 0))
        hi = tl.sum(tl.where(lane == seg, seg_hi, 0))
        offs_r = tl.sum(tl.where(lane == seg, seg_lo, 0)) + (i - first) * BR + tl.arange(0, BR)
        mask_r = offs_r < hi
        if L_GATHER:
            l_src = tl.load(l_rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        else:
            l_src = offs_r.to(tl.int64)
        if R_GATHER:
            r_src = tl.load(r_rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        else:
            r_src = offs_r.to(tl.int64)
        a = tl.load(lhs_ptr + l_src[:, None] * stride_lm + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if HAS_SCALE:
            sc = tl.load(scale_ptr + offs_r, mask=mask_r, other=0.0)
            a = (a.to(tl.float32) * sc[:, None]).to(lhs_ptr.dtype.element_ty)
        b = tl.load(rhs_ptr + r_src[:, None] * stride_rm + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])
