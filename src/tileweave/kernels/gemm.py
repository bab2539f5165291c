"""The persistent GEMM every tileweave op runs on, with its communication hooks.

One kernel, three modes (``MODE``, a compile-time switch):

* ``PLAIN``: ``c[M, N] = a[M, K] @ b[K, N] (+ bias)``; with ``STREAM_K`` the last, partial wave of tiles
  is shared out by K steps (``_stream_k``). With ``BN2`` > 0 a tile is ``BN + BN2`` columns wide, two
  accumulators fed by one A load (``_mainloop_wide``), so that widths like 160 give narrow grids about
  one tile per SM.
* ``AG`` (all-gather consumer): ``a`` is this rank's shard ``[Mc, K]``; the peers' shards arrive in the
  symmetric buffer ``a_peer[W * Mc, K]``. Tiles run chunk by chunk, own chunk first, then rank+1,
  rank+2, ... (the order in which the producer delivers them). Before a chunk's first tile, the program
  waits for that chunk's ready flag (one wait per program and chunk, outside the tile loop, so the
  loop stays a plain pipelined loop). With ``STREAM_K`` the last chunk's share of the last, partial
  wave is dealt out by K steps over every program (``_stream_k_tail``).
* ``RS`` (reduce-scatter producer and reducer): ``a`` is ``[W * Mc, K]``. Chunks owned by rank+1,
  rank+2, ... come first: each finished tile is stored straight into its owner's receive buffer over
  NVLink and counted in the owner's counter for this source (one release per program and chunk). The
  own chunk comes last: once every peer's tiles of it are in, each tile sums the W partials in fp32 in
  rank order (so the result is deterministic) and writes the output.
  With the copy-engine transport the peer tiles go to a local send buffer instead, counted per row
  group; a copy stream moves each finished row group to its owner and writes an arrival flag, and the
  own tiles wait for those flags. NVLink traffic then uses the copy engines, not the SMs.

Programs are persistent: program ``pid`` takes global tiles ``pid, pid + P, pid + 2P, ...`` where the
global order is the chunk order above, so the load stays balanced across chunk boundaries.
"""

import triton
import triton.language as tl

from tileweave.kernels.sync import release_add, wait_epoch

PLAIN = tl.constexpr(0)
AG = tl.constexpr(1)
RS = tl.constexpr(2)


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
def _mainloop(a_src, b_src, a_ptr, b_ptr, row_a, rows_a, col_b, N, K, k_lo, k_hi,
              stride_am, stride_ak, stride_bk, stride_bn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              B_NK: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr):
    # K steps [k_lo, k_hi) of one tile (all of them, 0 to cdiv(K, BK), except under stream-K).
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        for ki in range(k_lo, k_hi):
            a = a_src.load([row_a, ki * BK])
            if B_NK:
                b = b_src.load([col_b, ki * BK])
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            else:
                b = b_src.load([ki * BK, col_b])
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        # Pointer path for strides TMA cannot take (row pitch not a multiple of 16 bytes).
        offs_m = row_a + tl.arange(0, BM)
        offs_n = col_b + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        mask_m = offs_m < rows_a
        mask_n = offs_n < N
        for ki in range(k_lo, k_hi):
            kk = ki * BK + offs_k
            mask_k = kk < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
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
        if B_NK:
            b = b_src.load([col_b, ki * BK])
            b2 = b2_src.load([col_b + BN, ki * BK])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            acc2 = tl.dot(a, b2.T, acc2, input_precision=PRECISION)
        else:
            b = b_src.load([ki * BK, col_b])
            b2 = b2_src.load([ki * BK, col_b + BN])
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
def _store_tile(c_ptr, c_desc, acc, row0, tile_m, tile_n, rows_valid, N, stride_cm, stride_cn,
                BM: tl.constexpr, BN: tl.constexpr, C_TMA: tl.constexpr):
    # TMA stores only where a tile cannot cross into the next chunk's rows (host checks Mc % BM).
    if C_TMA:
        c_desc.store([row0 + tile_m, tile_n], acc.to(c_ptr.dtype.element_ty))
    else:
        offs_m = tile_m + tl.arange(0, BM)
        offs_n = tile_n + tl.arange(0, BN)
        mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < N)
        ptrs = c_ptr + (row0 + offs_m[:, None]).to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _chunk_loop(pid, step, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                row_a0, rows_a, row_c0, m_chunk, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                skip, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin, rank, tail,
                BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, P: tl.constexpr, EPILOGUE: tl.constexpr, WORLD: tl.constexpr,
                B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, C_TMA: tl.constexpr,
                FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr,
                LAZY_WAIT: tl.constexpr, CE_RELEASE: tl.constexpr):
    """All tiles of one chunk of ``m_chunk`` rows that belong to program ``pid``.

    ``EPILOGUE``: 0 stores to ``c``; 1 stores a partial into the owner's receive buffer and counts the
    tiles there (``row_c0`` is then the owner); 2 reduces the W partials of the own chunk. With the
    copy-engine transport: 3 stores a partial into the local send slot and counts it per row group;
    4 reduces the own chunk from the partials the copy engines delivered. ``skip``
    (0/1) drops the chunk: it comes from a flag wait, so the loop bounds depend on the flag's value and
    no load can be hoisted above the wait. ``tail``: tiles at the end of the chunk left out, for
    ``_stream_k_tail`` to share by K steps (0: none). ``CE_RELEASE`` (epilogue 3): 0 counts each tile with a
    system-scope release, 1 with a GPU-scope release, 2 counts a program's tiles per row group once,
    after its last tile of the chunk. ``BN2`` > 0 (epilogue 0, TMA loads): tiles are ``BN + BN2``
    columns wide, the second part in its own accumulator (``b2_src``, ``c2_desc``).
    """
    num_pid_m = tl.cdiv(m_chunk, BM)
    num_pid_n = tl.cdiv(N, BN + BN2)
    tiles = num_pid_m * num_pid_n
    start = _first_tile(pid, step, tiles, P) + skip * tiles
    if EPILOGUE == 1:
        # The owner's receive buffer lies `offset` elements from ours. Addressing it from our own
        # (aligned) pointer keeps the stores 16-byte vectors; a pointer loaded from memory would not.
        offset = tl.multiple_of(tl.load(peer_offs_ptr + row_c0), 16)
    missed_war = 0
    if EPILOGUE == 3:
        # The copy stream must have moved every region of this step's send slot for the previous call
        # before we overwrite it (it raises the step's "sent" epoch after its last copy). On expiry the
        # tiles are still counted (the copy stream waits for the counts) but not stored.
        missed_war = wait_epoch(flags_ptr + 2 * WORLD * CE_GROUPS + step, epoch - 1, err_ptr, 200 + step,
                                max_spin)
    if EPILOGUE == 2:
        if not LAZY_WAIT:
            skip = _wait_peers(flags_ptr, epoch, err_ptr, max_spin, rank, WORLD)
            start += skip * tiles
    for t in tl.range(start, tiles - tail, P, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        col = pid_n * (BN + BN2)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = col + tl.arange(0, BN)
        if BN2 > 0:
            acc, acc2 = _mainloop_wide(a_src, b_src, b2_src, row_a0 + pid_m * BM, col, 0, tl.cdiv(K, BK),
                                       BM, BN, BN2, BK, B_NK, PRECISION)
        else:
            acc = _mainloop(a_src, b_src, a_ptr, b_ptr, row_a0 + pid_m * BM, rows_a, col, N, K, 0, tl.cdiv(K, BK),
                            stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, B_NK, USE_TMA, PRECISION)
        if EPILOGUE == 0:
            acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
            _store_tile(c_ptr, c_desc, acc, row_c0, pid_m * BM, col, m_chunk, N,
                        stride_cm, stride_cn, BM, BN, C_TMA)
            if BN2 > 0:
                acc2 = _add_bias(acc2, bias_ptr, col + BN + tl.arange(0, BN2), N, HAS_BIAS)
                _store_tile(c_ptr, c2_desc, acc2, row_c0, pid_m * BM, col + BN, m_chunk, N,
                            stride_cm, stride_cn, BM, BN2, C_TMA)
        elif EPILOGUE == 1:
            mask = (offs_m[:, None] < m_chunk) & (offs_n[None, :] < N)
            rows = (rank * m_chunk + offs_m[:, None]).to(tl.int64) * N
            tl.store(buf_ptr + offset + rows + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
        elif EPILOGUE == 3:
            _partial_to_send_slot(acc, t // (GROUP_M * num_pid_n), step, offs_m, offs_n, m_chunk, N,
                                  buf_ptr, c_ptr, flags_ptr, missed_war, WORLD, CE_RELEASE)
        elif EPILOGUE == 4:
            total = _sum_arrived_partials(acc, t // (GROUP_M * num_pid_n), offs_m, offs_n, m_chunk, N,
                                          buf_ptr, flags_ptr, err_ptr, epoch, max_spin, rank, WORLD)
            total = _add_bias(total, bias_ptr, offs_n, N, HAS_BIAS)
            _store_tile(c_ptr, c_desc, total, 0, pid_m * BM, pid_n * BN, m_chunk, N,
                        stride_cm, stride_cn, BM, BN, False)
        else:
            # Own chunk: sum every rank's partial in rank order, the own accumulator at its own place.
            missed = 0
            if LAZY_WAIT:
                # Waiting here, after a main loop, rather than before the chunk lets a program that
                # finished its peer tiles early start computing while the peers finish theirs.
                missed = _wait_peers(flags_ptr, epoch, err_ptr, max_spin, rank, WORLD)
            mask = (offs_m[:, None] < m_chunk) & (offs_n[None, :] < N) & (missed == 0)
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for src in tl.static_range(WORLD):
                if src == rank:
                    total += acc
                else:
                    rows = (src * m_chunk + offs_m[:, None]).to(tl.int64) * N
                    total += tl.load(buf_ptr + rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            total = _add_bias(total, bias_ptr, offs_n, N, HAS_BIAS)
            _store_tile(c_ptr, c_desc, total, 0, pid_m * BM, pid_n * BN, m_chunk, N,
                        stride_cm, stride_cn, BM, BN, False)
    if EPILOGUE == 3:
        if CE_RELEASE == 2:
            _count_groups_once(flags_ptr + step * CE_GROUPS, start, tiles, P, GROUP_M * num_pid_n)
    if EPILOGUE == 1:
        # One release per program and chunk: the fence behind it waits for this program's remote
        # stores once, not once per tile. (Per-tile flags, tried on 2x H200, were slower and raced;
        # see NOTES.md.)
        done = tl.maximum(tiles - start + P - 1, 0) // P
        if done > 0:
            counters = tl.load(peer_flags_ptr + row_c0).to(tl.pointer_type(tl.int32))
            release_add(counters + rank, done, "sys")


@triton.jit
def _wait_peers(counters_ptr, target, err_ptr, max_spin, rank, WORLD: tl.constexpr):
    """Wait until every peer's tile count for the own chunk reaches ``target``; 1 if any wait expired."""
    missed = 0
    for src in tl.static_range(WORLD):
        if src != rank:
            missed = tl.maximum(missed, wait_epoch(counters_ptr + src, target, err_ptr, 100 + src, max_spin))
    return missed


# Copy-engine reduce-scatter. Flags, int32, per rank: [0, W*S) tiles done per (step, row group) (this
# rank's kernel counts, its copy stream waits); [W*S, 2W*S) arrival epoch per (source, row group)
# (peers' copy streams write); [2W*S, 2W*S + W) sent epoch per step (this rank's copy stream writes it
# after the step's last copy, so the next call may overwrite the send slot). S = CE_GROUPS row groups
# at most. "sent" is per step, not per row group: a call whose shape has more row groups than the last
# one would otherwise wait for a group flag that the last call never raised.
CE_GROUPS = tl.constexpr(256)


@triton.jit
def _partial_to_send_slot(acc, group, step, offs_m, offs_n, m_chunk, N, buf_ptr, c_ptr, flags_ptr, missed_war,
                          WORLD: tl.constexpr, CE_RELEASE: tl.constexpr):
    # Send slots follow the W - 1 receive slots; step s feeds owner rank + 1 + s.
    mask = (offs_m[:, None] < m_chunk) & (offs_n[None, :] < N) & (missed_war == 0)
    rows = ((WORLD - 1 + step) * m_chunk + offs_m[:, None]).to(tl.int64) * N
    tl.store(buf_ptr + rows + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    if CE_RELEASE == 0:
        release_add(flags_ptr + step * CE_GROUPS + group, 1, "sys")
    elif CE_RELEASE == 1:
        release_add(flags_ptr + step * CE_GROUPS + group, 1, "gpu")


@triton.jit
def _count_groups_once(counters_ptr, start, tiles, P, group_tiles):
    # Program tiles are start, start + P, ...: add each row group's share with one release per group,
    # after the program's last tile of the chunk, instead of one fence per tile inside the loop.
    tl.debug_barrier()
    for g in range(start // group_tiles, tl.cdiv(tiles, group_tiles)):
        lo = tl.maximum(g * group_tiles, start)
        hi = tl.minimum((g + 1) * group_tiles, tiles)
        count = (hi - start + P - 1) // P - (lo - start + P - 1) // P
        if count > 0:
            tl.atomic_add(counters_ptr + g, count, sem="release", scope="sys")


@triton.jit
def _sum_arrived_partials(acc, group, offs_m, offs_n, m_chunk, N, buf_ptr, flags_ptr, err_ptr, epoch,
                          max_spin, rank, WORLD: tl.constexpr):
    # Receive slot of source src is (src - rank - 1) mod W; sum in rank order for determinism.
    total = tl.zeros(acc.shape, dtype=tl.float32)
    bounds = (offs_m[:, None] < m_chunk) & (offs_n[None, :] < N)
    for src in tl.static_range(WORLD):
        if src == rank:
            total += acc
        else:
            missed = wait_epoch(flags_ptr + WORLD * CE_GROUPS + src * CE_GROUPS + group, epoch, err_ptr,
                                100 + src, max_spin)
            rows = (((src - rank - 1 + WORLD) % WORLD) * m_chunk + offs_m[:, None]).to(tl.int64) * N
            part = tl.load(buf_ptr + rows + offs_n[None, :], mask=bounds & (missed == 0), other=0.0)
            total += part.to(tl.float32)
    return total


@triton.jit
def _now():
    # The GPU's global nanosecond timer (for TIMELINE probes only).
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _stamp(timeline_ptr, pid, slot, TIMELINE: tl.constexpr):
    # With TIMELINE, program pid records the time at ``slot`` of its row of TIMELINE_SLOTS int64 words.
    if TIMELINE:
        tl.store(timeline_ptr + pid * TIMELINE_SLOTS + slot, _now())


TIMELINE_SLOTS = tl.constexpr(16)
"""Words per program of a TIMELINE probe's record: 0 start, 1 whole-tile waves done, then per stream-K
segment (at most 4): its start, its main loop done, its end (store or partial and fix-up); 14 end."""


@triton.jit
def _stream_k(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr, M, N, K,
              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
              P: tl.constexpr, B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
              C_TMA: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr, timeline_ptr,
              TIMELINE: tl.constexpr):
    """Plain GEMM whose last, partial wave of tiles is shared out by K steps (data-parallel waves, then
    stream-K: Osama et al., PPoPP 2023), so that a grid of, say, 1.2 waves takes about 1.2 tile times
    instead of 2.

    The full waves run as in ``_chunk_loop``, whole tiles in grouped order, where programs running
    together share their A and B tiles in L2; then ``_stream_k_tail`` shares out the rest. (Dealing
    out every tile by K steps was 1.4-2.4x slower on an H200: programs at different K offsets of many
    tiles share nothing in L2. NOTES.md, entry 23.) With ``TIMELINE`` (probes only) each program records
    when it reaches each phase (``TIMELINE_SLOTS``).
    """
    _stamp(timeline_ptr, pid, 0, TIMELINE)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_pid_m * num_pid_n
    dp_tiles = (tiles // P) * P
    for t in tl.range(pid, dp_tiles, P, flatten=FLATTEN):
        pid_m, pid_n = _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        acc = _mainloop(a_src, b_src, a_ptr, b_ptr, pid_m * BM, M, pid_n * BN, N, K, 0, k_tiles,
                        stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, B_NK, USE_TMA, PRECISION)
        acc = _add_bias(acc, bias_ptr, pid_n * BN + tl.arange(0, BN), N, HAS_BIAS)
        _store_tile(c_ptr, c_desc, acc, 0, pid_m * BM, pid_n * BN, M, N, stride_cm, stride_cn, BM, BN, C_TMA)
    _stamp(timeline_ptr, pid, 1, TIMELINE)
    _stream_k_tail(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                   0, M, 0, M, N, K, dp_tiles, 0, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BM, BN, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA, C_TMA, PRECISION, timeline_ptr, TIMELINE)
    _stamp(timeline_ptr, pid, 14, TIMELINE)


@triton.jit
def _stream_k_tail(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                   row_a0, rows_a, row_c0, m_rows, N, K, first_tile, skip,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   P: tl.constexpr, B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                   C_TMA: tl.constexpr, PRECISION: tl.constexpr, timeline_ptr, TIMELINE: tl.constexpr):
    """The K steps of tiles ``[first_tile, tiles)`` of an ``m_rows x N`` grid (A rows from ``row_a0``,
    C rows from ``row_c0``), tile ``first_tile`` step 0, step 1, ..., dealt out evenly: program ``pid``
    takes ``[pid * per, (pid + 1) * per)``. A tile that one program covers is stored at once. A tile
    shared by several is finished by the last of them to arrive: each stores its fp32 partial in its
    slot of ``part_ptr`` (``[2 P, BM, BN]``: a program's first segment, then its last), counts itself in
    ``locks_ptr[tile]`` (acquire-release), and the program that brings the count to the number of
    sharers sums the partials in program order (so the result does not depend on arrival order), stores
    the tile and resets the count to 0 for the next call. No program waits for another. ``skip`` (1
    after an expired flag wait) runs no K steps but keeps the counts, so that they return to 0.
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
    first_t = (base + pid * per) // k_tiles
    while it < end:
        t = it // k_tiles
        _stamp(timeline_ptr, pid, 2 + 3 * tl.minimum(t - first_t, 3), TIMELINE)
        k_lo = it - t * k_tiles
        k_hi = tl.minimum(k_tiles, k_lo + end - it)
        pid_m, pid_n = _grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc = _mainloop(a_src, b_src, a_ptr, b_ptr, row_a0 + pid_m * BM, rows_a, pid_n * BN, N, K, k_lo,
                        k_hi - skip * (k_hi - k_lo), stride_am, stride_ak, stride_bk, stride_bn,
                        BM, BN, BK, B_NK, USE_TMA, PRECISION)
        _stamp(timeline_ptr, pid, 3 + 3 * tl.minimum(t - first_t, 3), TIMELINE)
        first = (t * k_tiles - base) // per
        last = ((t + 1) * k_tiles - 1 - base) // per
        if first == last:
            acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
            _store_tile(c_ptr, c_desc, acc, row_c0, pid_m * BM, pid_n * BN, m_rows, N, stride_cm, stride_cn,
                        BM, BN, C_TMA)
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
                acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
                _store_tile(c_ptr, c_desc, acc, row_c0, pid_m * BM, pid_n * BN, m_rows, N, stride_cm, stride_cn,
                            BM, BN, C_TMA)
                tl.store(locks_ptr + t, 0)
        _stamp(timeline_ptr, pid, 4 + 3 * tl.minimum(t - first_t, 3), TIMELINE)
        it += k_hi - k_lo


def _metadata(grid, kernel, args):
    mode = ("plain", "ag", "rs")[args["MODE"]]
    world = args["WORLD"]
    m = args["m_chunk"] * (world if args["MODE"] != 0 else 1)
    n, k = args["N"], args["K"]
    return {"name": f"tileweave_gemm_{mode}_{m}x{n}x{k}", "flops": 2 * m * n * k}


@triton.jit(launch_metadata=_metadata, do_not_specialize=["epoch", "max_spin", "rank"])
def fused_gemm_kernel(
        a_ptr, buf_ptr, b_ptr, c_ptr, bias_ptr,
        peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, part_ptr, locks_ptr,
        epoch, max_spin,
        m_chunk, N, K, rank,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        P: tl.constexpr, MODE: tl.constexpr, WORLD: tl.constexpr,
        B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, C_TMA: tl.constexpr,
        FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr,
        LAZY_WAIT: tl.constexpr, COPY_ENGINE: tl.constexpr, RING: tl.constexpr, CE_RELEASE: tl.constexpr,
        STREAM_K: tl.constexpr, TIMELINE: tl.constexpr = False):
    """See the module docstring. Shapes: ``m_chunk`` rows per rank (all of M in PLAIN mode).

    AG: ``buf_ptr`` is the gather buffer ``[W * Mc, K]``; ``flags_ptr[src]`` is the epoch at which
    src's shard is complete in it; ``RING`` orders peer chunks for a ring producer.
    RS: ``buf_ptr`` is the own receive buffer ``[W, Mc, N]``; ``peer_offs_ptr[p]`` is rank p's receive
    buffer as an int64 element offset from it and ``peer_flags_ptr[p]`` the int64 address of rank p's
    tile counters; ``flags_ptr[src]`` (own counters) counts src's tiles of the own chunk, cumulative
    and wrapping, and ``epoch`` is the count at which this call's tiles are all in.
    RS with ``COPY_ENGINE``: ``buf_ptr`` holds W - 1 receive slots then W - 1 send slots of
    ``[Mc, N]``; ``flags_ptr`` is the flag block described at ``CE_GROUPS``; ``epoch`` is the epoch.
    ``STREAM_K`` (PLAIN and AG): ``part_ptr`` is the fp32 partial-tile workspace and ``locks_ptr`` the
    per-tile arrival counts of ``_stream_k_tail`` (zero between calls). PLAIN shares out the tiles of
    the last, partial wave by K steps (``_stream_k``); AG the same tiles, which the host has checked
    all lie in the last chunk (``ag_stream_k_tail``), after that chunk's whole tiles. ``TIMELINE``
    (probes only, PLAIN with ``STREAM_K``): ``err_ptr`` is an int64 ``[P, TIMELINE_SLOTS]`` record of
    when each program reached each phase (``scripts/gemm_probe.py --timeline``).
    """
    pid = tl.program_id(0)
    a_rows = m_chunk * WORLD if MODE == RS else m_chunk
    if USE_TMA:
        b_src = _b_descriptor(b_ptr, N, K, stride_bk, stride_bn, BN, BK, B_NK)
        a_src = tl.make_tensor_descriptor(a_ptr, shape=[a_rows, K], strides=[stride_am, 1],
                                          block_shape=[BM, BK])
    else:
        a_src = a_ptr
        b_src = b_ptr
    b2_src = b_src
    if USE_TMA and BN2 > 0:
        b2_src = _b_descriptor(b_ptr, N, K, stride_bk, stride_bn, BN2, BK, B_NK)
    c_rows = m_chunk * WORLD if MODE == AG else m_chunk
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[c_rows, N], strides=[stride_cm, 1],
                                           block_shape=[BM, BN])
    else:
        c_desc = c_ptr
    c2_desc = c_desc
    if C_TMA and BN2 > 0:
        c2_desc = tl.make_tensor_descriptor(c_ptr, shape=[c_rows, N], strides=[stride_cm, 1],
                                            block_shape=[BM, BN2])

    if MODE == PLAIN and STREAM_K:
        _stream_k(pid, a_src, b_src, c_desc, a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr, m_chunk, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BM, BN, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA, C_TMA, FLATTEN, PRECISION, err_ptr, TIMELINE)
    elif MODE == PLAIN:
        _chunk_loop(pid, 0, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                    0, a_rows, 0, m_chunk, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                    0, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin, rank, 0,
                    BM, BN, BN2, BK, GROUP_M, P, 0, WORLD, B_NK, HAS_BIAS, USE_TMA, C_TMA,
                    FLATTEN, WARP_SPECIALIZE, PRECISION, LAZY_WAIT, CE_RELEASE)
    elif MODE == AG:
        # Own shard first, straight from the caller's tensor: nothing to wait for.
        _chunk_loop(pid, 0, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                    0, a_rows, rank * m_chunk, m_chunk, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                    0, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin, rank, 0,
                    BM, BN, BN2, BK, GROUP_M, P, 0, WORLD, B_NK, HAS_BIAS, USE_TMA, C_TMA,
                    FLATTEN, WARP_SPECIALIZE, PRECISION, LAZY_WAIT, CE_RELEASE)
        gathered_rows = m_chunk * WORLD
        if USE_TMA:
            g_src = tl.make_tensor_descriptor(buf_ptr, shape=[gathered_rows, K], strides=[K, 1],
                                              block_shape=[BM, BK])
        else:
            g_src = buf_ptr
        # With STREAM_K the last chunk leaves its last `rem` tiles (the partial wave) to the tail.
        rem = 0
        if STREAM_K:
            rem = (WORLD * tl.cdiv(m_chunk, BM) * tl.cdiv(N, BN)) % P
        skip = 0
        src = rank
        for step in range(1, WORLD):
            # Chunks in arrival order: a full-mesh push delivers rank+1's first, a ring (each rank
            # forwarding to rank+1) delivers rank-1's first.
            src = (rank + WORLD - step) % WORLD if RING else (rank + step) % WORLD
            skip = wait_epoch(flags_ptr + src, epoch, err_ptr, 1 + src, max_spin)
            tail = tl.where(step == WORLD - 1, rem, 0)
            _chunk_loop(pid, step, g_src, b_src, b2_src, c_desc, c2_desc, buf_ptr, b_ptr, c_ptr, bias_ptr,
                        src * m_chunk, gathered_rows, src * m_chunk, m_chunk, N, K,
                        K, 1, stride_bk, stride_bn, stride_cm, stride_cn,
                        skip, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin,
                        rank, tail, BM, BN, BN2, BK, GROUP_M, P, 0, WORLD, B_NK, HAS_BIAS, USE_TMA, C_TMA,
                        FLATTEN, WARP_SPECIALIZE, PRECISION, LAZY_WAIT, CE_RELEASE)
        if STREAM_K:
            # The last chunk's `rem` tiles, by K steps over every program (after its flag: `skip`).
            _stream_k_tail(pid, g_src, b_src, c_desc, buf_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                           src * m_chunk, gathered_rows, src * m_chunk, m_chunk, N, K,
                           tl.cdiv(m_chunk, BM) * tl.cdiv(N, BN) - rem, skip,
                           K, 1, stride_bk, stride_bn, stride_cm, stride_cn,
                           BM, BN, BK, GROUP_M, P, B_NK, HAS_BIAS, USE_TMA, C_TMA, PRECISION, err_ptr, False)
    else:
        # Epilogues 1 and 2 for the store transport, 3 and 4 for the copy engines.
        for step in range(0, WORLD - 1):
            owner = (rank + 1 + step) % WORLD
            _chunk_loop(pid, step, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                        owner * m_chunk, a_rows, owner, m_chunk, N, K,
                        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                        0, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin,
                        rank, 0, BM, BN, BN2, BK, GROUP_M, P, 1 + 2 * COPY_ENGINE, WORLD, B_NK, False, USE_TMA, False,
                        FLATTEN, WARP_SPECIALIZE, PRECISION, LAZY_WAIT, CE_RELEASE)
        _chunk_loop(pid, WORLD - 1, a_src, b_src, b2_src, c_desc, c2_desc, a_ptr, b_ptr, c_ptr, bias_ptr,
                    rank * m_chunk, a_rows, 0, m_chunk, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                    0, buf_ptr, peer_offs_ptr, peer_flags_ptr, flags_ptr, err_ptr, epoch, max_spin, rank, 0,
                    BM, BN, BN2, BK, GROUP_M, P, 2 + 2 * COPY_ENGINE, WORLD, B_NK, HAS_BIAS, USE_TMA, False,
                    FLATTEN, WARP_SPECIALIZE, PRECISION, LAZY_WAIT, CE_RELEASE)
