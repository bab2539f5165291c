"""The weight gradient of a grouped GEMM over a routing plan, without permuted copies:

    out[e] = sum over the rows p of expert e of (lhs[l(p)] * scale[p]).T @ rhs[r(p)]      [N, K]

``l(p)`` / ``r(p)`` read a row index (``L_GATHER`` / ``R_GATHER``) or are p itself. Expert e's rows are
the groups ``s * E + e`` of every source s (``sources`` of them; one at world size 1), each the plan rows
``[offsets[g], offsets[g + 1])``; they are visited in source order and within a group in row order,
``BR`` rows per step, so the sum's order is fixed (deterministic). One program per output tile
``(e, n tile, k tile)``, the tiles of one expert consecutive (they share its rows in L2). An expert
with no rows gets zeros.

Each operand is read through a stride per row and one per column, so it may be stored either way; a
float8 operand is best stored K-major, ``[N, P]`` with the plan rows contiguous (its transpose view
here), the layout Hopper's FP8 tensor cores read. ``ALIGNED``: every offset is a multiple of 16 (groups
padded with zero rows), which lets the compiler load such an operand in 16-byte vectors straight into
shared memory, pipelined (unaligned group ends keep its byte loads in registers, unpipelined).

``SCALING`` (float8 operands; the scales vary along the rows, the sum's contraction, in groups that a
step never straddles, so each step's product or the finished tile can be scaled):

* ``"outer"`` / ``"outer_fast"`` (tensorwise and rowwise, torchao's): the finished tile times
  ``scale_l[e, n] * scale_r[e, k]`` (zero strides where a scaling does not vary: one scale per tensor
  or per expert, or one per expert and feature); ``"outer"`` adds each step's product to the fp32
  accumulator (``max_num_imprecise_acc=BR``; torch's ``use_fast_accum=False``), ``"outer_fast"`` lets
  the tensor cores accumulate across steps;
* ``"block"`` (DeepSeek-V3's 128 x 1 tiles along the tokens): the rows of group g are cut into blocks
  of 128 from the group's first row, block j of group g being scale row ``offsets[g] // 128 + g + j``
  (the next group's first block comes after the last of g, so a block never straddles two groups, and
  a table of ``P // 128 + G`` rows holds every block); each step's product (``BR`` divides 128, so a step
  lies in one block) is scaled by ``scale_l[block, n] * scale_r[block, k]`` before it is added.

The scales travel as one tuple ``(scale_l_ptr, scale_r_ptr, stride_slg, stride_sln, stride_srg,
stride_srk)``: per row of a table (expert or block) and per column, for each operand.
"""

import triton
import triton.language as tl


@triton.jit
def _lr_scales(scales, row, offs_n, offs_k, mask_n, mask_k):
    # scale_l[row, n] * scale_r[row, k] of the tile's columns (row: an expert, or a block of 128 rows).
    sl = tl.load(scales[0] + row * scales[2] + offs_n * scales[3], mask=mask_n, other=0.0)
    sr = tl.load(scales[1] + row * scales[4] + offs_k * scales[5], mask=mask_k, other=0.0)
    return sl[:, None] * sr[None, :]


@triton.jit
def grouped_wgrad_kernel(lhs_ptr, l_rows_ptr, rhs_ptr, r_rows_ptr, scale_ptr, offsets_ptr, out_ptr,
                         scale_l_ptr, scale_r_ptr,
                         E, sources, N, K,
                         stride_lm, stride_ln, stride_rm, stride_rk, stride_oe, stride_on,
                         stride_slg, stride_sln, stride_srg, stride_srk,
                         BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, S_BLOCK: tl.constexpr,
                         L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
                         PRECISION: tl.constexpr, SCALING: tl.constexpr = None, ALIGNED: tl.constexpr = False):
    """See the module docstring; ``scale_l_ptr``, ``scale_r_ptr`` and their strides are read only under
    ``SCALING``."""
    scales = (scale_l_ptr, scale_r_ptr, stride_slg, stride_sln, stride_srg, stride_srk)
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
    steps = tl.sum(seg_steps)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i in tl.range(0, steps):
        seg = tl.sum((seg_ends <= i).to(tl.int32))
        first = tl.sum(tl.where(lane < seg, seg_steps, 0))
        lo = tl.sum(tl.where(lane == seg, seg_lo, 0))
        hi = tl.sum(tl.where(lane == seg, seg_hi, 0))
        if ALIGNED:
            # Groups of whole 16-row pieces: rounding changes nothing and tells the compiler so, which
            # lets it load a K-major operand in 16-byte vectors under masks constant over them, straight
            # into shared memory (a mask it cannot prove constant keeps the loads out of the pipeline).
            lo = lo // 16 * 16
            hi = hi // 16 * 16
        start = lo + (i - first) * BR
        offs_r = start + tl.arange(0, BR)
        mask_r = offs_r < hi
        if L_GATHER:
            l_src = tl.load(l_rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        else:
            l_src = offs_r.to(tl.int64)
        if R_GATHER:
            r_src = tl.load(r_rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        else:
            r_src = offs_r.to(tl.int64)
        # Both tiles with the rows last ([BN, BR] and [BK, BR]), the product a @ b.T: K-major operands
        # in the form Hopper's float8 MMA takes, loaded straight into shared memory by the pipeline.
        a = tl.load(lhs_ptr + offs_n[:, None] * stride_ln + l_src[None, :] * stride_lm,
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        if HAS_SCALE:
            sc = tl.load(scale_ptr + offs_r, mask=mask_r, other=0.0)
            a = (a.to(tl.float32) * sc[None, :]).to(lhs_ptr.dtype.element_ty)
        b = tl.load(rhs_ptr + offs_k[:, None] * stride_rk + r_src[None, :] * stride_rm,
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if SCALING == "block":
            block = lo // 128 + seg * E + expert + (start - lo) // 128
            acc += tl.dot(a, tl.trans(b)) * _lr_scales(scales, block, offs_n, offs_k, mask_n, mask_k)
        elif SCALING == "outer":  # each step's product added in fp32 (torch's use_fast_accum=False)
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BR)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if SCALING == "outer" or SCALING == "outer_fast":
        # An expert without rows reads no scale: its zeros stay zeros whatever its table holds.
        acc = acc * _lr_scales(scales, expert, offs_n, offs_k, mask_n & (steps > 0), mask_k)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])
