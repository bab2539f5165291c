"""The FP8 GEMM for Hopper (sm_90) written against the warp-group MMA directly, in Gluon.

``c = (a * scale_a) @ (b * scale_b) (+ bias)`` with float8 ``a [M, K]`` row-major and ``b`` read as rows
of an ``[N, K]`` weight (both K-major, as Hopper's FP8 MMA wants them), fp32 accumulation. Persistent:
program ``pid`` takes tiles ``pid, pid + P, ...`` in GROUP_M super-rows; each tile streams its K steps
through ``STAGES`` shared-memory buffers filled by TMA, the loads running on into the program's next
tile while the current one finishes.

Why not ``tl.dot``: Hopper's FP8 MMA keeps fewer bits than fp32 while it accumulates, so an exact
(``use_fast_accum=False``) or blockwise GEMM adds each K step's product to an fp32 accumulator itself.
Written with ``tl.dot`` that add waits for the step's MMA to finish, and the tensor cores idle while it
runs. Here each K step's product goes to a fresh register tile (``use_acc=False``) and the step before
it is added only once the next MMA has been issued (``warpgroup_mma_wait(1)``), so one MMA is always in
flight while the previous product is scaled and summed:

===========  ===========================================================================================
``SCALING``  per K step ``ki``
===========  ===========================================================================================
``"outer"``  ``acc += p[ki]``; the tile is multiplied by ``scale_a[row] * scale_b[col]`` at the end
             (tensorwise scalars read with zero strides, rowwise vectors).
``"block"``  ``acc += p[ki] * scale_a[row, ki] * scale_b[ki, col // 128]`` (``BK`` = 128: a step is one
             scale block of K); the scales of step ``ki`` are loaded one step ahead of their use.
``"fast"``   ``acc = mma(a, b, acc)``: the tensor cores accumulate across K steps (torch's
             ``use_fast_accum=True``), the outer scales at the end.
===========  ===========================================================================================

Out-of-range rows, columns and K are zero-filled by TMA on load and clipped on store.

``fp8_gemm_sm90_ws_kernel`` is the same exact and blockwise loop with the loads in a warp of their own
(``gl.warp_specialize``): the loader waits for a buffer to be released and refills it, the MMA warps
wait only for a buffer's arrival and release it once its MMA is done, with no refill in their loop.
The kernels of two MMA warp groups, each owning half of a tile's rows, are in ``gemm_fp8_sm90_halves``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _tile_of(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    # Super-grouping along M so that consecutive programs share B tiles in L2.
    width = GROUP_M * num_pid_n
    first_m = (t // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (t % size_m), (t % width) // size_m


@gluon.jit
def _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach, cur_m, cur_n, nxt_m, nxt_n,
            k_steps, BK: gl.constexpr, STAGES: gl.constexpr):
    """The next load of the program's stream of K steps, if a buffer is free (fewer than STAGES - 1 loads
    ahead of the ``steps`` consumed) and the stream has not passed tile ``reach``: K step ``lk`` of
    tile ``lt`` (``t``, at ``cur_m, cur_n``, or the program's next tile, at ``nxt_m, nxt_n``), into
    buffer ``loads % STAGES``. Returns the new ``(loads, lt, lk)``."""
    if (loads < steps + STAGES - 1) & (lt < reach):
        # The buffer's last reader, an MMA every warp group has waited for, is done in every warp group.
        gl.thread_barrier()
        ahead = (lt != t).to(gl.int32)
        s = loads % STAGES
        bar = bars.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [cur_m + (nxt_m - cur_m) * ahead, lk * BK], bar, a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [cur_n + (nxt_n - cur_n) * ahead, lk * BK], bar, b_bufs.index(s))
        loads += 1
        lk += 1
        if lk == k_steps:
            lk = 0
            lt += gl.num_programs(0)
    return loads, lt, lk


@gluon.jit
def _outer(sa, sb, BN: gl.constexpr):
    # The scale of each element of the tile: a column of row scales when sb is the tile's one scalar.
    if 128 % BN == 0:
        return (sa * sb)[:, None]
    else:
        return sa[:, None] * sb[None, :]


@gluon.jit
def _issue_mma(a_bufs, b_bufs, bars, steps, zero, STAGES: gl.constexpr):
    # The product of the next loaded K step into a fresh register tile, in flight on return.
    s = steps % STAGES
    mbarrier.wait(bars.index(s), (steps // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _retire(acc, pending, in_flight: gl.constexpr, sa, sb, SCALING: gl.constexpr, BN: gl.constexpr):
    # Wait until at most `in_flight` MMAs are outstanding (`pending` is then complete) and add its product.
    done = warpgroup_mma_wait(in_flight, deps=(pending, ))
    if SCALING == "block":
        acc += done * _outer(sa, sb, BN)
    else:
        acc += done
    return acc


@gluon.jit
def _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, kb, stride_sam, stride_sak, stride_sbk, stride_sbn,
                 SCALING: gl.constexpr, BN: gl.constexpr):
    # Step kb's block scales, or ones where the scales apply to the finished tile.
    if SCALING == "block":
        sa, sb = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, kb,
                               stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
    else:
        sa = 1.0
        sb = 1.0
    return sa, sb


@gluon.jit
def _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, kb, stride_sam, stride_sak, stride_sbk, stride_sbn,
                  BN: gl.constexpr):
    # Step kb's scales: scale_a of the tile's rows (1 x 128 blocks), scale_b of its columns' 128-blocks.
    sa = gl.load(sa_ptr + offs_m.to(gl.int64) * stride_sam + kb * stride_sak, mask=offs_m < M, other=0.0)
    if 128 % BN == 0:  # the tile lies in one 128-column block of the weight (its first column a multiple of BN)
        sb = gl.load(sb_ptr + kb * stride_sbk + (off_n // 128) * stride_sbn)
    else:
        sb = gl.load(sb_ptr + kb * stride_sbk + (offs_n // 128) * stride_sbn, mask=offs_n < N, other=0.0)
    return sa, sb


@gluon.jit
def _finish(acc, c_desc, out, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N, stride_sam, stride_sbn,
            SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    # A tile's epilogue: the outer scales (blockwise scaled each step), the bias, and the store through
    # `out` once the previous tile's store has left it.
    if SCALING != "block":
        sa = gl.load(sa_ptr + offs_m.to(gl.int64) * stride_sam, mask=offs_m < M, other=0.0)
        sb = gl.load(sb_ptr + offs_n * stride_sbn, mask=offs_n < N, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
    tma.store_wait(0)
    out.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], out)


@gluon.jit
def _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr):
    # TMA descriptors of a [M, K] and of the weight [N, K] (both K-major), and the ring of their buffers.
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BM, BK],
                                        gl.NVMMASharedLayout.get_default_for([BM, BK], a_ptr.dtype.element_ty))
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BN, BK],
                                        gl.NVMMASharedLayout.get_default_for([BN, BK], b_ptr.dtype.element_ty))
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    return a_desc, b_desc, a_bufs, b_bufs


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, READERS: gl.constexpr):
    # Per buffer: `ready` (the loader's TMA arrives) and `empty` (each of READERS partitions releases it).
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=READERS)
    return ready, empty


@gluon.jit
def _drop_barriers(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _tile_rows(t, num_pid_m, num_pid_n, ROW0: gl.constexpr, ROWS: gl.constexpr, BM: gl.constexpr,
               BN: gl.constexpr, GROUP_M: gl.constexpr, rows_layout: gl.constexpr, cols_layout: gl.constexpr):
    # Tile t's first row (of this partition's ROWS rows from ROW0) and column, and their index vectors.
    pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BM + ROW0
    off_n = pid_n * BN
    return off_m, off_n, off_m + gl.arange(0, ROWS, layout=rows_layout), off_n + gl.arange(0, BN, layout=cols_layout)


@gluon.jit
def fp8_gemm_sm90_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                         stride_sam, stride_sak, stride_sbk, stride_sbn,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                         STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    """See the module docstring. ``a [M, K]`` (row pitch ``stride_am``), the weight ``[N, K]`` (row pitch
    ``stride_bn``) and ``c [M, N]`` (``stride_cm``) are read and written through TMA descriptors built
    here. Scale strides are in elements (``stride_sak``/``stride_sbk`` per 128-block of K,
    ``stride_sbn`` per column, or per 128 columns with ``"block"``)."""
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BM, BN],
                                        gl.NVMMASharedLayout.get_default_for([BM, BN], c_ptr.dtype.element_ty))
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros((BM, BN), gl.float32, mma_layout)
    # K steps loaded and consumed by this program over all its tiles (the buffer and barrier phase), and
    # the tile and K step of its next load: the loads run on into the program's next tile while the
    # current one finishes.
    loads = 0
    steps = 0
    lt = gl.program_id(0)
    lk = 0
    pid_m, pid_n = _tile_of(lt, num_pid_m, num_pid_n, GROUP_M)
    nxt_m = pid_m * BM
    nxt_n = pid_n * BN
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m = nxt_m
        off_n = nxt_n
        pid_m, pid_n = _tile_of(t + gl.num_programs(0), num_pid_m, num_pid_n, GROUP_M)
        nxt_m = pid_m * BM
        nxt_n = pid_n * BN
        reach = t + 1 + gl.num_programs(0) * (t + gl.num_programs(0) < num_pid_m * num_pid_n).to(gl.int32)
        offs_m = off_m + gl.arange(0, BM, layout=rows_layout)
        offs_n = off_n + gl.arange(0, BN, layout=cols_layout)
        for i in gl.static_range(STAGES - 1):  # no MMA in flight: fill the free buffers
            loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                    off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
        acc = zero
        if SCALING == "fast":
            for ki in range(k_steps):
                s = steps % STAGES
                mbarrier.wait(bars.index(s), (steps // STAGES) & 1)
                steps += 1
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # Step ki - 1's MMA is done: its buffer may be refilled.
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                        off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        else:
            # Two register tiles take turns (p0: even steps, p1: odd), so that no product in flight is
            # ever copied: ptxas serialises every MMA of a kernel that reads the registers of one in flight.
            p0 = _issue_mma(a_bufs, b_bufs, bars, steps, zero, STAGES)
            steps += 1
            if SCALING == "block":
                sa0, sb0 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, 0,
                                         stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
            else:
                sa0 = 1.0
                sb0 = 1.0
            sa1 = sa0
            sb1 = sb0
            loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                        off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
            ki = 1
            for _ in range((k_steps - 1) // 2):
                # Step ki's MMA runs while step ki - 1's product is added, then step ki + 1's while ki's is.
                p1 = _issue_mma(a_bufs, b_bufs, bars, steps, zero, STAGES)
                steps += 1
                if SCALING == "block":
                    sa1, sb1 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                             stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
                acc = _retire(acc, p0, 1, sa0, sb0, SCALING, BN)
                loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                        off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
                p0 = _issue_mma(a_bufs, b_bufs, bars, steps, zero, STAGES)
                steps += 1
                if SCALING == "block":
                    sa0, sb0 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki + 1,
                                             stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
                acc = _retire(acc, p1, 1, sa1, sb1, SCALING, BN)
                loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                        off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
                ki += 2
            if ki < k_steps:  # an even number of steps: the last one is odd
                p1 = _issue_mma(a_bufs, b_bufs, bars, steps, zero, STAGES)
                steps += 1
                if SCALING == "block":
                    sa1, sb1 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                             stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
                acc = _retire(acc, p0, 1, sa0, sb0, SCALING, BN)
                acc = _retire(acc, p1, 0, sa1, sb1, SCALING, BN)
                # Refilled only now: a branch while p1 is in flight would make ptxas serialise the MMAs.
                loads, lt, lk = _stream(a_desc, b_desc, bars, a_bufs, b_bufs, loads, steps, lt, lk, t, reach,
                                        off_m, off_n, nxt_m, nxt_n, k_steps, BK, STAGES)
            else:
                acc = _retire(acc, p0, 0, sa0, sb0, SCALING, BN)
        _finish(acc, c_desc, c_smem, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# -- the warp-specialised form: a loader warp, the MMA and the adds in the other warps ----------------


@gluon.jit
def _ws_loader(a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    # One warp: every K step of the program's tiles into the ring of buffers, each once its last
    # reader has released it (``empty``), announced on ``ready`` with the bytes to expect.
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    loads = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
        for k in range(k_steps):
            s = loads % STAGES
            mbarrier.wait(empty.index(s), ((loads // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, k * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BN, k * BK], bar, b_bufs.index(s))
            loads += 1


@gluon.jit
def _ws_take(a_bufs, b_bufs, ready, steps, zero, STAGES: gl.constexpr):
    s = steps % STAGES
    mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _ws_compute(c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                stride_sam, stride_sak, stride_sbk, stride_sbn, BM: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALING: gl.constexpr,
                HAS_BIAS: gl.constexpr):
    # The MMA warps: each K step's product into a fresh register tile (two taking turns), the previous
    # one added while it runs, its buffer released to the loader once its MMA is done.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros((BM, BN), gl.float32, mma_layout)
    steps = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m, off_n, offs_m, offs_n = _tile_rows(t, num_pid_m, num_pid_n, 0, BM, BM, BN, GROUP_M, rows_layout,
                                                  cols_layout)
        acc = zero
        p0 = _ws_take(a_bufs, b_bufs, ready, steps, zero, STAGES)
        steps += 1
        if SCALING == "block":
            sa0, sb0 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, 0,
                                     stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
        else:
            sa0 = 1.0
            sb0 = 1.0
        sa1 = sa0
        sb1 = sb0
        ki = 1
        for _ in range((k_steps - 1) // 2):
            p1 = _ws_take(a_bufs, b_bufs, ready, steps, zero, STAGES)
            steps += 1
            if SCALING == "block":
                sa1, sb1 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                         stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
            acc = _retire(acc, p0, 1, sa0, sb0, SCALING, BN)
            mbarrier.arrive(empty.index((steps - 2) % STAGES), count=1)
            p0 = _ws_take(a_bufs, b_bufs, ready, steps, zero, STAGES)
            steps += 1
            if SCALING == "block":
                sa0, sb0 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki + 1,
                                         stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
            acc = _retire(acc, p1, 1, sa1, sb1, SCALING, BN)
            mbarrier.arrive(empty.index((steps - 2) % STAGES), count=1)
            ki += 2
        if ki < k_steps:
            p1 = _ws_take(a_bufs, b_bufs, ready, steps, zero, STAGES)
            steps += 1
            if SCALING == "block":
                sa1, sb1 = _block_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                         stride_sam, stride_sak, stride_sbk, stride_sbn, BN)
            acc = _retire(acc, p0, 1, sa0, sb0, SCALING, BN)
            mbarrier.arrive(empty.index((steps - 2) % STAGES), count=1)
            acc = _retire(acc, p1, 0, sa1, sb1, SCALING, BN)
            mbarrier.arrive(empty.index((steps - 1) % STAGES), count=1)
        else:
            acc = _retire(acc, p0, 0, sa0, sb0, SCALING, BN)
            mbarrier.arrive(empty.index((steps - 1) % STAGES), count=1)
        _finish(acc, c_desc, c_smem, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_sm90_ws_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                            stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    """``fp8_gemm_sm90_kernel``'s exact and blockwise modes (``SCALING`` "outer" or "block") with the
    loads in a warp of their own: the MMA warps wait on a buffer's arrival only, never on a refill."""
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BM, BN],
                                        gl.NVMMASharedLayout.get_default_for([BM, BN], c_ptr.dtype.element_ty))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    ready, empty = _ring_barriers(STAGES, 1)
    gl.warp_specialize([
        (_ws_compute, (c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                       stride_sam, stride_sak, stride_sbk, stride_sbn, BM, BN, BK, GROUP_M, STAGES, SCALING,
                       HAS_BIAS)),
        (_ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [1], [24])
    _drop_barriers(ready, empty, STAGES)
