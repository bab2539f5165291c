"""The persistent GEMM every tileweave op runs on, with its one communication hook.

``c = a @ b (+ bias)`` over a grid of ``BM x BN`` tiles taken by ``P`` persistent programs: program
``pid`` takes tiles ``pid, pid + P, pid + 2P, ...`` of one global order (``_grouped_tile`` within a
chunk of rows, chunk after chunk), so the load stays balanced across chunk boundaries. Each tile runs
one K loop (``_mainloop``). The variants are compile-time switches:

* ``ALL_GATHER`` (the consumer of an all-gather): ``a`` is this rank's shard ``[Mc, K]`` and the peers'
  shards arrive in the gather buffer ``gathered[W * Mc, K]``. The own chunk runs first, straight from
  ``a``; then each peer's chunk in the order the transport delivers them (``RING``: rank-1 first, else
  rank+1 first), each program waiting once for that chunk's ready flag before its first tile of it.
* ``STREAM_K``: the tiles of the last, partial wave (of the last chunk) are shared out by K steps over
  every program (``_stream_k_tail``) instead of leaving the programs without a whole tile idle.
* ``BN2 > 0`` (plain GEMM, TMA loads): a tile is ``BN + BN2`` columns wide, two accumulators fed by one
  A load (``_mainloop_wide``), so that widths like 160 give narrow grids about one tile per SM.

* ``SCALING`` (FP8 inputs, ``out = (a * scale_a) @ (b * scale_b)``, fp32 accumulation): ``"outer"``
  multiplies each finished tile by ``scale_a[row] * scale_b[col]`` in the epilogue (rowwise scales
  ``[M, 1]`` and ``[1, N]``; tensorwise scalars are the same with zero strides), each K step's product
  added to the fp32 accumulator; ``"outer_fast"`` the same with the tensor cores accumulating across
  K steps (torch's ``use_fast_accum=True``: faster, fewer bits kept over a long K); ``"block"`` scales
  every K step's product before it is accumulated, ``acc += dot(a, b) * sa[:, None] * sb[None, :]``,
  with ``sa = scale_a[row, k // 128]`` (1 x 128 blocks of A) and ``sb = scale_b[k // 128, col // 128]``
  (128 x 128 blocks of B): a K step (``BK`` dividing 128) never straddles two scale blocks. The scales
  travel as one tuple ``scales = (scale_a_ptr, scale_b_ptr, stride_sam, stride_sak, stride_sbk,
  stride_sbn)``, rows of ``scale_a`` indexed like the rows of the A source a tile reads. With
  ``ALL_GATHER`` the own chunk's rows take ``scale_a`` (this rank's shard's scales, any of the three
  forms) and the peers' rows the gathered a-scales ``gathered_scale_ptr`` (``[W * Mc, KB]``, strides
  ``stride_gsm``, ``stride_gsk``: one row per gathered row, so a tensorwise scale, which differs per
  rank, arrives as its rank's rows all holding it), which the transport moves beside the rows.

Synchronisation comes from ``tileweave.kernels.sync``; every wait is bounded and records an error
code instead of hanging (the host raises ``CollectiveTimeout``).
"""

import triton
import triton.language as tl

from tileweave.kernels.sync import wait_epoch


@triton.jit
def _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Super-grouping along M so that consecutive programs share B tiles in L2.
    width = GROUP_M * num_pid_n
    first_m = (t // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % size_m)
    pid_n = (t % width) // size_m
    return pid_m, pid_n


@triton.jit
def _first_tile(pid, step, tiles_per_chunk, P):
    # First local tile of this chunk owned by program pid when global tile g = step * T + l is owned
    # by program g % P. Written with non-negative operands only (Triton's % truncates like C).
    return (pid + P - (step * tiles_per_chunk) % P) % P


@triton.jit
def _load_block(src, ptr, r0, c0, rows, cols, stride_r, stride_c,
                BR: tl.constexpr, BC: tl.constexpr, USE_TMA: tl.constexpr):
    # The [BR, BC] block at (r0, c0) of a [rows, cols] operand: through its TMA descriptor, or by pointers
    # with masks for strides TMA cannot take (a row pitch not a multiple of 16 bytes).
    if USE_TMA:
        block = src.load([r0, c0])
    else:
        offs_r = r0 + tl.arange(0, BR)
        offs_c = c0 + tl.arange(0, BC)
        block = tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                        mask=(offs_r[:, None] < rows) & (offs_c[None, :] < cols), other=0.0)
    return block


@triton.jit
def _load_b(b_src, b_ptr, col, k0, N, K, stride_bk, stride_bn,
            BN: tl.constexpr, BK: tl.constexpr, B_NK: tl.constexpr, USE_TMA: tl.constexpr):
    # B's [BK, BN] block at (k0, col); with B_NK the descriptor reads rows of an nn.Linear weight [N, K].
    if USE_TMA and B_NK:
        block = b_src.load([col, k0]).T
    else:
        block = _load_block(b_src, b_ptr, k0, col, K, N, stride_bk, stride_bn, BK, BN, USE_TMA)
    return block


@triton.jit
def _scale_rows(scales, row, rows, kb, BM: tl.constexpr):
    # scale_a of the BM rows from `row` of the A source, K block kb (0 for "outer").
    offs = row + tl.arange(0, BM)
    return tl.load(scales[0] + offs.to(tl.int64) * scales[2] + kb * scales[3], mask=offs < rows, other=0.0)


@triton.jit
def _scale_cols(scales, col, N, kb, BN: tl.constexpr, BLOCK: tl.constexpr):
    # scale_b of the BN columns from `col`, K block kb: one per column, or per 128 columns (BLOCK).
    offs = col + tl.arange(0, BN)
    idx = offs // 128 if BLOCK else offs
    return tl.load(scales[1] + kb * scales[4] + idx * scales[5], mask=offs < N, other=0.0)


@triton.jit
def _mainloop(a_src, b_src, a_ptr, b_ptr, row_a, rows_a, col_b, N, K, k_lo, k_hi,
              stride_am, stride_ak, stride_bk, stride_bn, scales,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              B_NK: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr, SCALING: tl.constexpr):
    # K steps [k_lo, k_hi) of one tile (all of them, 0 to cdiv(K, BK), except under stream-K).
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        a = _load_block(a_src, a_ptr, row_a, ki * BK, rows_a, K, stride_am, stride_ak, BM, BK, USE_TMA)
        b = _load_b(b_src, b_ptr, col_b, ki * BK, N, K, stride_bk, stride_bn, BN, BK, B_NK, USE_TMA)
        if SCALING == "block":
            # DeepSeek-V3's promotion: each step's fp32 product scaled, then accumulated in fp32.
            kb = (ki * BK) // 128
            sa = _scale_rows(scales, row_a, rows_a, kb, BM)
            sb = _scale_cols(scales, col_b, N, kb, BN, True)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        elif SCALING == "outer":
            # Each K step's product added to the fp32 accumulator (torch's use_fast_accum=False); the
            # tensor cores' own FP8 accumulation keeps fewer bits over a long K.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:  # None, or "outer_fast": the tensor cores accumulate across K steps
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mainloop_wide(a_src, b_src, b2_src, row_a, col_b, k_lo, k_hi,
                   BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
                   B_NK: tl.constexpr, PRECISION: tl.constexpr):
    # A tile of BN + BN2 columns (TMA only): one A load feeds two dots, columns [col_b, col_b + BN) and
    # [col_b + BN, col_b + BN + BN2).
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        a = a_src.load([row_a, ki * BK])
        b = _load_b(b_src, b_src, col_b, ki * BK, 0, 0, 0, 0, BN, BK, B_NK, True)
        b2 = _load_b(b2_src, b2_src, col_b + BN, ki * BK, 0, 0, 0, 0, BN2, BK, B_NK, True)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
    return acc, acc2


@triton.jit
def _b_descriptor(b_ptr, N, K, stride_bk, stride_bn, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                  B_NK: tl.constexpr):
    # TMA descriptor of B's tiles of BLOCK_N columns: rows of an nn.Linear weight [N, K] (B_NK) or
    # columns of a row-major [K, N].
    if B_NK:
        return tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BK])
    else:
        return tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BK, BLOCK_N])


@triton.jit
def _store_tile(c_ptr, c_desc, acc, bias_ptr, row0, tile_m, tile_n, rows_valid, N, stride_cm, stride_cn,
                scales, row_a, rows_a,
                BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, C_TMA: tl.constexpr,
                SCALING: tl.constexpr):
    # The tile's epilogue: the "outer" scales (rows from row_a of the A source), bias, then the store
    # (TMA only where a tile cannot cross into the next chunk's rows: the host checks Mc % BM).
    offs_n = tile_n + tl.arange(0, BN)
    if SCALING == "outer" or SCALING == "outer_fast":
        sa = _scale_rows(scales, row_a, rows_a, 0, BM)
        sb = _scale_cols(scales, tile_n, N, 0, BN, False)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if C_TMA:
        c_desc.store([row0 + tile_m, tile_n], acc.to(c_ptr.dtype.element_ty))
    else:
        offs_m = tile_m + tl.arange(0, BM)
        mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < N)
        ptrs = c_ptr + (row0 + offs_m[:, None]).to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_loop(pid, step, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                row_a0, rows_a, row_c0, m_chunk, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, skip, tail, scales,
                BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, P: tl.constexpr, B_NK: tl.constexpr, HAS_BIAS: tl.constexpr,
                USE_TMA: tl.constexpr, C_TMA: tl.constexpr, FLATTEN: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr, SCALING: tl.constexpr):
    """The whole tiles of one chunk of ``m_chunk`` rows (A rows from ``row_a0``, C rows from
    ``row_c0``) that belong to program ``pid``, ``step`` chunks into the global order. ``skip`` (0/1)
    drops the chunk: it comes from a flag wait, so the loop bounds depend on the flag's value and no
    load can be hoisted above the wait. ``tail``: tiles at the end of the chunk left to
    ``_stream_k_tail`` (0: none)."""
    num_pid_m = tl.cdiv(m_chunk, BM)
    num_pid_n = tl.cdiv(N, BN + BN2)
    tiles = num_pid_m * num_pid_n
    start = _first_tile(pid, step, tiles, P) + skip * tiles
    for t in tl.range(start, tiles - tail, P, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        col = pid_n * (BN + BN2)
        row_a = row_a0 + pid_m * BM
        if BN2 > 0:
            tl.static_assert(SCALING != "block", "block scaling is applied in _mainloop only: no BN2")
            acc, acc2 = _mainloop_wide(a_src, b_src, b2_src, row_a, col, 0, tl.cdiv(K, BK),
                                       BM, BN, BN2, BK, B_NK, PRECISION)
            _store_tile(c_ptr, c2_desc, acc2, bias_ptr, row_c0, pid_m * BM, col + BN, m_chunk, N,
                        stride_cm, stride_cn, scales, row_a, rows_a, BM, BN2, HAS_BIAS, C_TMA, SCALING)
        else:
            acc = _mainloop(a_src, b_src, a_ptr, b_ptr, row_a, rows_a, col, N, K, 0, tl.cdiv(K, BK),
                            stride_am, stride_ak, stride_bk, stride_bn, scales, BM, BN, BK, B_NK, USE_TMA,
                            PRECISION, SCALING)
        _store_tile(c_ptr, c_desc, acc, bias_ptr, row_c0, pid_m * BM, col, m_chunk, N,
                    stride_cm, stride_cn, scales, row_a, rows_a, BM, BN, HAS_BIAS, C_TMA, SCALING)


@triton.jit
def _stream_k_tail(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                   row_a0, rows_a, row_c0, m_rows, N, K, first_tile, skip,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, scales,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   P: tl.constexpr, B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                   C_TMA: tl.constexpr, PRECISION: tl.constexpr, SCALING: tl.constexpr):
    """The K steps of tiles ``[first_tile, tiles)`` of an ``m_rows x N`` grid (A rows from ``row_a0``,
    C rows from ``row_c0``), tile ``first_tile`` step 0, step 1, ..., dealt out evenly: program ``pid``
    takes ``[pid * per, (pid + 1) * per)`` (data-parallel waves, then stream-K: Osama et al., PPoPP
    2023). A tile that one program covers is stored at once. A tile shared by several is finished by the
    last of them to arrive: each stores its fp32 partial in its slot of ``part_ptr`` (``[2 P, BM, BN]``:
    a program's first segment, then its last), counts itself in ``locks_ptr[tile]`` (acquire-release),
    and the program that brings the count to the number of sharers sums the partials in program order
    (so the result does not depend on arrival order), stores the tile and resets the count to 0 for the
    next call. No program waits for another. ``skip`` (1 after an expired flag wait) runs no K steps but
    keeps the counts, so that they return to 0.
    """
    num_pid_m = tl.cdiv(m_rows, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_pid_m * num_pid_n
    base = first_tile * k_tiles
    per = tl.maximum(tl.cdiv(tiles * k_tiles - base, P), 1)
    it = base + pid * per
    end = tl.minimum(it + per, tiles * k_tiles)
    slot_rows = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    while it < end:
        t = it // k_tiles
        k_lo = it - t * k_tiles
        k_hi = tl.minimum(k_tiles, k_lo + end - it)
        pid_m, pid_n = _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        row_a = row_a0 + pid_m * BM
        acc = _mainloop(a_src, b_src, a_ptr, b_ptr, row_a, rows_a, pid_n * BN, N, K, k_lo,
                        k_hi - skip * (k_hi - k_lo), stride_am, stride_ak, stride_bk, stride_bn, scales,
                        BM, BN, BK, B_NK, USE_TMA, PRECISION, SCALING)
        first = (t * k_tiles - base) // per
        last = ((t + 1) * k_tiles - 1 - base) // per
        if first == last:
            _store_tile(c_ptr, c_desc, acc, bias_ptr, row_c0, pid_m * BM, pid_n * BN, m_rows, N,
                        stride_cm, stride_cn, scales, row_a, rows_a, BM, BN, HAS_BIAS, C_TMA, SCALING)
        else:
            # Slot 2p holds program p's first segment, 2p + 1 its later one (only its last can be partial).
            slot = 2 * pid + (it != base + pid * per).to(tl.int32)
            tl.store(part_ptr + slot.to(tl.int64) * (BM * BN) + slot_rows, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(locks_ptr + t, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:
                tl.debug_barrier()
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for p in range(first, last + 1):
                    other = 2 * p + (base + p * per < t * k_tiles).to(tl.int32)
                    acc += tl.load(part_ptr + other.to(tl.int64) * (BM * BN) + slot_rows, cache_modifier=".cg")
                _store_tile(c_ptr, c_desc, acc, bias_ptr, row_c0, pid_m * BM, pid_n * BN, m_rows, N,
                            stride_cm, stride_cn, scales, row_a, rows_a, BM, BN, HAS_BIAS, C_TMA, SCALING)
                tl.store(locks_ptr + t, 0)
        it += k_hi - k_lo


def _metadata(grid, kernel, args):
    all_gather = args["ALL_GATHER"]
    m = args["m_chunk"] * (args["WORLD"] if all_gather else 1)
    n, k = args["N"], args["K"]
    return {"name": f"tileweave_gemm_{'ag' if all_gather else 'plain'}_{m}x{n}x{k}", "flops": 2 * m * n * k}


@triton.jit(launch_metadata=_metadata, do_not_specialize=["epoch", "max_spin", "rank"])
def fused_gemm_kernel(
        a_ptr, gathered_ptr, b_ptr, c_ptr, bias_ptr, ready_ptr, err_ptr, part_ptr, locks_ptr,
        scale_a_ptr, scale_b_ptr, gathered_scale_ptr,
        epoch, max_spin,
        m_chunk, N, K, rank,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        stride_sam, stride_sak, stride_sbk, stride_sbn, stride_gsm, stride_gsk,
        BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        P: tl.constexpr, WORLD: tl.constexpr, ALL_GATHER: tl.constexpr, RING: tl.constexpr,
        STREAM_K: tl.constexpr, B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
        C_TMA: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr,
        SCALING: tl.constexpr):
    """See the module docstring. ``m_chunk``: rows per rank (all of M for the plain GEMM).

    ``ALL_GATHER``: ``gathered_ptr`` is the gather buffer ``[W * Mc, K]`` and ``ready_ptr[src]`` the
    flag at which src's shard is complete in it once it reaches ``epoch``; an expired wait records
    ``1 + src`` in ``err_ptr``. ``STREAM_K``: ``part_ptr`` is the fp32 partial-tile workspace and
    ``locks_ptr`` the per-tile arrival counts of ``_stream_k_tail`` (zero between calls); with
    ``ALL_GATHER`` the host has checked that the partial wave's tiles all lie in the last chunk.
    ``SCALING`` (None, ``"outer"``, ``"outer_fast"``, ``"block"``): ``scale_a_ptr`` and ``scale_b_ptr`` with their
    strides (unused without it); with ``ALL_GATHER`` also ``gathered_scale_ptr``, the a-scales of the
    gathered rows (the module docstring), complete for src's rows once ``ready_ptr[src]`` is.
    """
    scales = (scale_a_ptr, scale_b_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn)
    # The peers' rows of the gather buffer take the gathered a-scales, indexed by the same rows.
    g_scales = (gathered_scale_ptr, scale_b_ptr, stride_gsm, stride_gsk, stride_sbk, stride_sbn)
    pid = tl.program_id(0)
    if USE_TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, shape=[m_chunk, K], strides=[stride_am, 1], block_shape=[BM, BK])
        b_src = _b_descriptor(b_ptr, N, K, stride_bk, stride_bn, BN, BK, B_NK)
    else:
        a_src = a_ptr
        b_src = b_ptr
    b2_src = b_src
    if USE_TMA and BN2 > 0:
        b2_src = _b_descriptor(b_ptr, N, K, stride_bk, stride_bn, BN2, BK, B_NK)
    c_rows = m_chunk * WORLD if ALL_GATHER else m_chunk
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[c_rows, N], strides=[stride_cm, 1], block_shape=[BM, BN])
    else:
        c_desc = c_ptr
    c2_desc = c_desc
    if C_TMA and BN2 > 0:
        c2_desc = tl.make_tensor_descriptor(c_ptr, shape=[c_rows, N], strides=[stride_cm, 1], block_shape=[BM, BN2])
    # With STREAM_K the last chunk leaves its last `rem` tiles (the partial wave) to the tail.
    tiles_per_chunk = tl.cdiv(m_chunk, BM) * tl.cdiv(N, BN + BN2)
    rem = 0
    if STREAM_K:
        rem = (WORLD * tiles_per_chunk) % P if ALL_GATHER else tiles_per_chunk % P

    # The own rows (all rows of a plain GEMM), straight from the caller's tensor: nothing to wait for.
    own_row = rank * m_chunk if ALL_GATHER else 0
    _chunk_loop(pid, 0, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                0, m_chunk, own_row, m_chunk, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                0, 0 if ALL_GATHER else rem, scales, BM, BN, BN2, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA,
                C_TMA, FLATTEN, WARP_SPECIALIZE, PRECISION, SCALING)
    if ALL_GATHER:
        gathered_rows = m_chunk * WORLD
        if USE_TMA:
            g_src = tl.make_tensor_descriptor(gathered_ptr, shape=[gathered_rows, K], strides=[K, 1],
                                              block_shape=[BM, BK])
        else:
            g_src = gathered_ptr
        skip = 0
        src = rank
        for step in range(1, WORLD):
            # Chunks in arrival order: a full-mesh push delivers rank+1's first, a ring (each rank
            # forwarding to rank+1) delivers rank-1's first.
            src = (rank + WORLD - step) % WORLD if RING else (rank + step) % WORLD
            skip = wait_epoch(ready_ptr + src, epoch, err_ptr, 1 + src, max_spin)
            _chunk_loop(pid, step, g_src, b_src, b2_src, c_desc, c2_desc, gathered_ptr, b_ptr, c_ptr, bias_ptr,
                        src * m_chunk, gathered_rows, src * m_chunk, m_chunk, N, K,
                        K, 1, stride_bk, stride_bn, stride_cm, stride_cn,
                        skip, tl.where(step == WORLD - 1, rem, 0), g_scales, BM, BN, BN2, BK, GROUP_M, P, B_NK,
                        HAS_BIAS, USE_TMA, C_TMA, FLATTEN, WARP_SPECIALIZE, PRECISION, SCALING)
        if STREAM_K:
            # The last chunk's `rem` tiles, by K steps over every program (after its flag: `skip`).
            _stream_k_tail(pid, g_src, b_src, c_desc, gathered_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                           src * m_chunk, gathered_rows, src * m_chunk, m_chunk, N, K, tiles_per_chunk - rem, skip,
                           K, 1, stride_bk, stride_bn, stride_cm, stride_cn, g_scales,
                           BM, BN, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA, C_TMA, PRECISION, SCALING)
    elif STREAM_K:
        _stream_k_tail(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                       0, m_chunk, 0, m_chunk, N, K, tiles_per_chunk - rem, 0,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, scales,
                       BM, BN, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA, C_TMA, PRECISION, SCALING)
