"""The MoE routing plan on the device in two kernels: a stable counting sort of the (token, slot) pairs
by group ``g = source * E + expert``.

``plan_count_kernel``: program b counts the pairs ``[b*BLOCK, (b+1)*BLOCK)`` per group (a one-hot sum
over the block) into ``counts[b, :G]``, and its ids outside ``[0, E)`` (clamped into range) into
``counts[b, G]``. The host code then takes the inclusive prefix sum of ``counts`` over the blocks.
``plan_place_kernel``: program b places its pairs: plan row = the group's start (exclusive prefix sum of
the group totals, the last row of the prefix sums) + the group's pairs in earlier blocks (the previous
row) + the pair's rank among the block's pairs of its group (a cumulative sum of the one-hot matrix down
the block). Ranks follow pair order, so each group keeps (token, slot) order: the sort is stable and the
plan the same on every call. Program 0 also writes the offsets, the per-expert splits and the count
of ids out of range.
"""

import triton
import triton.language as tl


@triton.jit
def _keys(ids_ptr, pair, P, E, pairs_per_source):
    mask = pair < P
    raw = tl.load(ids_ptr + pair, mask=mask, other=0).to(tl.int64)
    bad = mask & ((raw < 0) | (raw >= E))
    expert = tl.minimum(tl.maximum(raw, 0), E - 1).to(tl.int32)
    key = (pair // pairs_per_source) * E + expert
    return mask, bad, expert, key


@triton.jit
def plan_count_kernel(ids_ptr, counts_ptr, P, E, G, pairs_per_source,
                      BLOCK: tl.constexpr, G_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    pair = b * BLOCK + tl.arange(0, BLOCK)
    mask, bad, expert, key = _keys(ids_ptr, pair, P, E, pairs_per_source)
    lanes = tl.arange(0, G_BLOCK)
    onehot = ((key[:, None] == lanes[None, :]) & mask[:, None]).to(tl.int32)
    row = counts_ptr + b.to(tl.int64) * (G + 1)
    tl.store(row + lanes, tl.sum(onehot, axis=0), mask=lanes < G)
    tl.store(row + G, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def plan_place_kernel(ids_ptr, cum_ptr, offsets_ptr, row_token_ptr, row_expert_ptr, pair_row_ptr, splits_ptr,
                      invalid_ptr, P, E, G, NB, pairs_per_source, topk, sources,
                      BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, G_BLOCK)
    # NB, like any integer argument, arrives as a plain int when it is 1 (Triton specializes it).
    last = cum_ptr + (b * 0 + NB - 1).to(tl.int64) * (G + 1)
    totals = tl.load(last + lanes, mask=lanes < G, other=0)
    starts = tl.cumsum(totals, 0) - totals
    earlier = tl.load(cum_ptr + (b - 1).to(tl.int64) * (G + 1) + lanes, mask=(lanes < G) & (b > 0), other=0)
    pair = b * BLOCK + tl.arange(0, BLOCK)
    mask, bad, expert, key = _keys(ids_ptr, pair, P, E, pairs_per_source)
    onehot = ((key[:, None] == lanes[None, :]) & mask[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, axis=1) - 1
    row = tl.sum(onehot * (starts + earlier)[None, :], axis=1) + rank
    tl.store(pair_row_ptr + pair, row, mask=mask)
    tl.store(row_token_ptr + row, (pair // topk).to(tl.int32), mask=mask)
    tl.store(row_expert_ptr + row, expert, mask=mask)
    if b == 0:
        tl.store(offsets_ptr + lanes, starts, mask=lanes < G)
        tl.store(offsets_ptr + G, tl.sum(totals, 0))
        tl.store(invalid_ptr, tl.load(last + G))
        e_lanes = tl.arange(0, E_BLOCK)
        splits = tl.zeros((E_BLOCK,), dtype=tl.int32)
        for s in range(0, sources):
            splits += tl.load(last + s * E + e_lanes, mask=e_lanes < E, other=0)
        tl.store(splits_ptr + e_lanes, splits, mask=e_lanes < E)
