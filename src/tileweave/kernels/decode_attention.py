"""Attention of one new token per sequence over the filled part of a KV cache (a decode step).

A decode step's query attends to the keys of its sequence up to and including its own slot. The cache
is preallocated for ``max_seq`` slots; a step replayed from a CUDA graph cannot take the filled length
from the host, so this kernel reads it on the device (the query's slot, ``slot_ptr``) and walks only the
key blocks before it: a step at context ``c`` costs what ``c`` costs, whatever ``max_seq``.

Program ``pid`` takes sequence ``b``, key/value head ``h`` and span ``s`` of the filled keys
(``pid = (b * KVH + h) * splits + s``): the ``G`` query heads that share head ``h`` (grouped-query
attention, never repeating ``k`` and ``v``) as the rows of one ``[GP, HD]`` tile against ``BLOCK`` keys
at a time, with the online softmax of flash attention. The filled keys are cut into ``splits`` equal
spans of whole blocks (flash-decoding), so a single sequence still spreads over the SMs. A program of
one span writes its output; with several, each stores its fp32 partial (running max, sum and weighted
values) and counts itself in ``locks_ptr[b * KVH + h]``, and the last to arrive merges the spans in span
order (the result does not depend on arrival order), stores, and sets the count back to 0.

Masking follows ``KVCache.allowed``: key ``j`` is attended to if it is a valid slot (``valid_ptr``) at or
before the query's, or the query's own.
"""

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, out_ptr, part_ptr, locks_ptr,
                            scale, limit, splits,
                            stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                            stride_valid, stride_ob, stride_oh,
                            KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                            HDP: tl.constexpr, BLOCK: tl.constexpr):
    """``out[b, h * G + g] = softmax(q[b, h * G + g] . k[b, h, :end] * scale) @ v[b, h, :end]`` with
    ``end = min(slot + 1, limit)``; ``q [B, KVH * G, HD]``, ``k, v [B, KVH, max_seq, HD]`` (any strides
    but a unit last one), ``valid [B, max_seq]`` (bool as int8), ``slot_ptr``: the query's slot (int64
    scalar); ``part_ptr`` ``[B * KVH, splits, GP, HDP + 2]`` fp32 and ``locks_ptr`` ``[B * KVH]`` int32
    (zero between calls) when ``splits`` > 1."""
    pid = tl.program_id(0)
    s = pid % splits
    bh = pid // splits
    b = bh // KVH
    h = bh % KVH
    slot = tl.load(slot_ptr).to(tl.int32)
    end = tl.minimum(slot + 1, limit)
    per = tl.cdiv(tl.cdiv(end, BLOCK), splits) * BLOCK
    lo = s * per
    hi = tl.minimum(end, lo + per)
    rows = tl.arange(0, GP)
    cols = tl.arange(0, HDP)
    row_ok = rows < G
    col_ok = cols < HD
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + rows)[:, None] * stride_qh + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    m = tl.full((GP,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, HDP), dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        in_span = keys < hi
        valid = tl.load(valid_ptr + b.to(tl.int64) * stride_valid + keys, mask=in_span, other=0) != 0
        ok = in_span & (valid | (keys == slot))
        kv_mask = in_span[:, None] & col_ok[None, :]
        k = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_ks + cols[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vs + cols[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A row with no allowed key so far keeps m = -inf: shift by 0 there, so no -inf - -inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(m - shift)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out_rows = out_ptr + b.to(tl.int64) * stride_ob + (h * G + rows)[:, None] * stride_oh + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if splits == 1:
        tl.store(out_rows, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        width = HDP + 2
        slab = part_ptr + (bh * splits).to(tl.int64) * (GP * width)
        mine = slab + s * (GP * width) + rows[:, None] * width
        tl.store(mine + cols[None, :], acc)
        tl.store(mine + HDP + tl.zeros((GP, 1), dtype=tl.int32), m[:, None])
        tl.store(mine + HDP + 1 + tl.zeros((GP, 1), dtype=tl.int32), l[:, None])
        tl.debug_barrier()  # every thread's partial stored before the count that publishes it
        arrived = tl.atomic_add(locks_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            top = tl.full((GP,), float("-inf"), dtype=tl.float32)
            for t in range(0, splits):
                part = slab + t * (GP * width) + rows * width + HDP
                top = tl.maximum(top, tl.load(part, cache_modifier=".cg"))
            total = tl.zeros((GP,), dtype=tl.float32)
            merged = tl.zeros((GP, HDP), dtype=tl.float32)
            for t in range(0, splits):
                part = slab + t * (GP * width) + rows[:, None] * width
                m_t = tl.load(part + HDP + tl.zeros((GP, 1), dtype=tl.int32), cache_modifier=".cg")
                # A span with no allowed key (m = -inf) weighs 0; top is finite (the own key is in a span).
                w = tl.where(m_t == float("-inf"), 0.0, tl.exp(m_t - top[:, None]))
                total += tl.sum(w * tl.load(part + HDP + 1 + tl.zeros((GP, 1), dtype=tl.int32),
                                            cache_modifier=".cg"), axis=1)
                merged += w * tl.load(part + cols[None, :], cache_modifier=".cg")
            tl.store(out_rows, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(locks_ptr + bh, 0, sem="relaxed", scope="gpu")
