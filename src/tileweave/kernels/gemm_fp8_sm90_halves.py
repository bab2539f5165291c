"""The Hopper FP8 GEMM (``gemm_fp8_sm90``) with a loader warp and two MMA warp groups in partitions of
their own, each owning half of every tile's rows (64 of 128): it waits for each K step's product and
adds it to its fp32 sum at once (one product tile per warp group, so blockwise scales fit in registers).

The two warp groups take turns at the tensor cores: half 1 issues step k once half 0's MMA of step k has
completed, and half 0 issues step k + 1 once half 1 has issued step k. So one half's product runs while
the other adds its own. (Left to themselves, both issue at once, their MMAs finish together, and both
add while the tensor cores idle.) Two barriers carry the turns, ``done0`` (half 0's MMA of the step has
completed) and ``issued1`` (half 1 has issued the step); neither can run two phases ahead of its reader,
since each half waits for the other's previous signal before it raises its next.

* ``fp8_gemm_sm90_halves_kernel``: exact and blockwise scaling (``SCALING`` "outer" or "block"); the
  warp groups load a step's blockwise scales from global memory after issuing its MMA.
* ``fp8_gemm_sm90_staged_kernel``: blockwise only, each step's scales brought into shared memory by the
  loader warp with the step's tiles, counted on the same barrier: the step's ``BM`` values of
  ``scale_a`` (M-major, a column pitch of a multiple of 16 bytes) and 32 weight scales of the tile's
  128-column block (K-major) from the step's, rounded down to a multiple of 4 (a box's first inner
  coordinate must sit on 16 bytes, and a 16-byte destination faults: the box is 128 bytes), of which the
  warp groups pick the step's. The weight scales are read as one row of their storage, so their row
  pitch needs no alignment (a box that runs past a row reads the next row's scales, which no step uses).
  The launcher (``ops.compute.fp8_sm90.staged_suits``) routes other layouts elsewhere.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import (_drop_barriers, _finish, _operands, _outer, _ring_barriers,
                                             _step_scales, _tile_of, _tile_rows, _ws_loader)

SB_BOX = gl.constexpr(32)


@gluon.jit
def _await_turn(done0, issued1, steps, HALF: gl.constexpr):
    # Before issuing step `steps`: half 0 after half 1 issued the step before, half 1 after half 0's MMA
    # of this step completed.
    if HALF == 0:
        if steps > 0:
            mbarrier.wait(issued1, (steps - 1) & 1)
    else:
        mbarrier.wait(done0, steps & 1)


@gluon.jit
def _issue(a_bufs, b_bufs, ready, done0, issued1, steps, zero, HALF: gl.constexpr, HM: gl.constexpr,
           STAGES: gl.constexpr):
    # This half's product of the next loaded K step into a fresh register tile, in flight on return.
    s = steps % STAGES
    mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
    _await_turn(done0, issued1, steps, HALF)
    p = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                      use_acc=False, is_async=True)
    if HALF == 1:
        mbarrier.arrive(issued1, count=1)
    return p


@gluon.jit
def _complete(p, empty, done0, steps, HALF: gl.constexpr, STAGES: gl.constexpr):
    # Wait for this half's MMA of step `steps`, pass the turn and release the step's buffer.
    p = warpgroup_mma_wait(0, deps=(p, ))
    if HALF == 0:
        mbarrier.arrive(done0, count=1)
    mbarrier.arrive(empty.index(steps % STAGES), count=1)
    return p


@gluon.jit
def _turn_barriers():
    done0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    issued1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done0, count=1)
    mbarrier.init(issued1, count=1)
    return done0, issued1


@gluon.jit
def _half_compute(c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                  stride_sam, stride_sak, stride_sbk, stride_sbn, HALF: gl.constexpr, BM: gl.constexpr,
                  BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    # One warp group: rows HALF * BM/2 ... of each tile, each K step's product added once it is done.
    HM: gl.constexpr = BM // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros((HM, BN), gl.float32, mma_layout)
    steps = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m, off_n, offs_m, offs_n = _tile_rows(t, num_pid_m, num_pid_n, HALF * HM, HM, BM, BN, GROUP_M,
                                                  rows_layout, cols_layout)
        acc = zero
        for ki in range(k_steps):
            p = _issue(a_bufs, b_bufs, ready, done0, issued1, steps, zero, HALF, HM, STAGES)
            sa, sb = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                  stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
            p = _complete(p, empty, done0, steps, HALF, STAGES)
            if SCALING == "block":
                acc += p * _outer(sa, sb, BN)
            else:
                acc += p
            steps += 1
        _finish(acc, c_desc, c_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def _out_tiles(c_ptr, M, N, stride_cm, BM: gl.constexpr, BN: gl.constexpr):
    # The output's descriptor (a half tile's box) and one store buffer per half.
    HM: gl.constexpr = BM // 2
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, BN],
                                        gl.NVMMASharedLayout.get_default_for([HM, BN], c_ptr.dtype.element_ty))
    return c_desc, gl.allocate_shared_memory(c_desc.dtype, [2, HM, BN], c_desc.layout)


@gluon.jit
def fp8_gemm_sm90_halves_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                                stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                                STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The exact and blockwise modes on two MMA warp groups taking turns (module docstring); a buffer is
    released when both have read it."""
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc, c_smem = _out_tiles(c_ptr, M, N, stride_cm, BM, BN)
    ready, empty = _ring_barriers(STAGES, 2)
    done0, issued1 = _turn_barriers()
    gl.warp_specialize([
        (_half_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_half_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(done0)
    mbarrier.invalidate(issued1)


# -- blockwise with the scales staged in shared memory ----------------------------------------------------


@gluon.jit
def _staged_loader(a_desc, b_desc, sa_desc, sb_desc, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, M, N, K,
                   stride_sbn, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr):
    # One warp: every K step's tiles and scales into the ring, each buffer once both halves released it.
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    loads = 0
    nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes
                            + sb_desc.block_type.nbytes)
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
        for k in range(k_steps):
            s = loads % STAGES
            mbarrier.wait(empty.index(s), ((loads // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, k * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BN, k * BK], bar, b_bufs.index(s))
            tma.async_copy_global_to_shared(sa_desc, [k, pid_m * BM], bar, sa_bufs.index(s))
            at = ((pid_n * BN) // 128) * stride_sbn + k
            tma.async_copy_global_to_shared(sb_desc, [0, at - at % 4], bar, sb_bufs.index(s))
            loads += 1


@gluon.jit
def _staged_compute(c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr, sb_ptr,
                    bias_ptr, M, N, K, stride_sam, stride_sbn, HALF: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    HAS_BIAS: gl.constexpr):
    # One warp group: rows HALF * BM/2 ... of each tile; each step's scales read from shared memory.
    HM: gl.constexpr = BM // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    pick_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])  # each thread all four
    pick = gl.arange(0, 4, layout=gl.SliceLayout(0, pick_layout))[None, :]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros((HM, BN), gl.float32, mma_layout)
    steps = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m, off_n, offs_m, offs_n = _tile_rows(t, num_pid_m, num_pid_n, HALF * HM, HM, BM, BN, GROUP_M,
                                                  rows_layout, cols_layout)
        acc = zero
        for ki in range(k_steps):
            s = steps % STAGES
            p = _issue(a_bufs, b_bufs, ready, done0, issued1, steps, zero, HALF, HM, STAGES)
            sa = sa_bufs.index(s).reshape((BM, )).slice(HALF * HM, HM).load(rows_layout)
            at = off_n // 128 * stride_sbn + ki
            four = sb_bufs.index(s).slice(0, 4, dim=1).load(pick_layout)
            sb = gl.sum(gl.sum(gl.where(pick == at % 4, four, 0.0), axis=1), axis=0)
            scale = (sa * sb)[:, None]  # in registers before the buffer is released
            p = _complete(p, empty, done0, steps, HALF, STAGES)
            acc += p * scale
            steps += 1
        _finish(acc, c_desc, c_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, "block", HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_sm90_staged_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                                stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                                STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Blockwise scaling (``SCALING`` "block", ``BN`` and ``BK`` 128) on two MMA warp groups taking turns,
    each step's scales in shared memory (module docstring)."""
    gl.static_assert(SCALING == "block", "the staged kernel is for blockwise scaling")
    gl.static_assert(BN == 128 and BK == 128, "a tile is one 128 x 128 block of the weight's scales")
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    plain: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sb_len = (gl.cdiv(N, 128) - 1) * stride_sbn + gl.cdiv(K, BK)  # the weight scales as one row
    sa_desc = tma.make_tensor_descriptor(sa_ptr, [gl.cdiv(K, BK), M], [stride_sak, 1], [1, BM], plain)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [1, sb_len], [gl.cdiv(sb_len, 4) * 4, 1], [1, SB_BOX], plain)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], plain)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, SB_BOX], plain)
    c_desc, c_smem = _out_tiles(c_ptr, M, N, stride_cm, BM, BN)
    ready, empty = _ring_barriers(STAGES, 2)
    done0, issued1 = _turn_barriers()
    gl.warp_specialize([
        (_staged_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr,
                           sb_ptr, bias_ptr, M, N, K, stride_sam, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                           HAS_BIAS)),
        (_staged_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr,
                           sb_ptr, bias_ptr, M, N, K, stride_sam, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                           HAS_BIAS)),
        (_staged_loader, (a_desc, b_desc, sa_desc, sb_desc, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, M, N, K,
                          stride_sbn, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(done0)
    mbarrier.invalidate(issued1)
