"""Rotary position embedding over the heads of a fused ``q | k | v`` projection, in one pass.

``rope_heads_kernel`` reads three sources (the query, key and value heads of each token row) and writes
three destinations, each a ``[M, n * head_dim]`` matrix with its own row stride: the forward reads
``qkv``'s three column ranges and writes ``q``, ``k`` and ``v`` apart; the backward reads ``dq``, ``dk``
and ``dv`` and writes the three column ranges of ``dqkv``. Query and key heads are rotated, value heads
copied. Within a head, columns ``2j`` and ``2j + 1`` are a pair turned by the angle of ``(position, j)``:

    out[2j]     = x[2j] * cos - x[2j + 1] * SIGN * sin
    out[2j + 1] = x[2j] * SIGN * sin + x[2j + 1] * cos

with ``SIGN`` 1 in the forward and -1 in the backward (the inverse rotation). Row ``m`` is position
``m % seq`` (rows are whole sequences one after another); ``cos`` and ``sin`` are ``[seq, head_dim / 2]``.
One program owns ``BR`` rows of one head; the math is in float32, rounded once to the output's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def rope_heads_kernel(sq_ptr, sk_ptr, sv_ptr, dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr,
                      M, seq, heads, kv_heads, head_dim,
                      stride_sq, stride_sk, stride_sv, stride_dq, stride_dk, stride_dv, stride_t,
                      SIGN: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    # grid: (row blocks, heads + 2 kv_heads): the query heads, then the key heads, then the value heads
    h = tl.program_id(1)
    is_q = h < heads
    is_k = (h >= heads) & (h < heads + kv_heads)
    local = tl.where(is_q, h, tl.where(is_k, h - heads, h - heads - kv_heads))
    src = tl.where(is_q, sq_ptr, tl.where(is_k, sk_ptr, sv_ptr))
    dst = tl.where(is_q, dq_ptr, tl.where(is_k, dk_ptr, dv_ptr))
    stride_s = tl.where(is_q, stride_sq, tl.where(is_k, stride_sk, stride_sv))
    stride_d = tl.where(is_q, stride_dq, tl.where(is_k, stride_dk, stride_dv))

    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_p = tl.arange(0, 2 * BH)  # the head's columns, pairs adjacent
    half = head_dim // 2
    mask = (offs_r < M)[:, None] & (offs_p < head_dim)[None, :]
    r64 = offs_r.to(tl.int64)[:, None]  # M * width can pass 2**31 elements
    cols = local * head_dim + offs_p[None, :]
    x = tl.load(src + r64 * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    if h < heads + kv_heads:
        a, b = tl.split(x.reshape(BR, BH, 2))
        offs_j = tl.arange(0, BH)
        t_mask = (offs_r < M)[:, None] & (offs_j < half)[None, :]
        t_offs = (offs_r % seq).to(tl.int64)[:, None] * stride_t + offs_j[None, :]
        c = tl.load(cos_ptr + t_offs, mask=t_mask, other=0.0).to(tl.float32)
        s = SIGN * tl.load(sin_ptr + t_offs, mask=t_mask, other=0.0).to(tl.float32)
        x = tl.join(a * c - b * s, a * s + b * c).reshape(BR, 2 * BH)
    tl.store(dst + r64 * stride_d + cols, x.to(dst.dtype.element_ty), mask=mask)
