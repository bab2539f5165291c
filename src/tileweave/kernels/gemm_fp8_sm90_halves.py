"""The Hopper FP8 GEMM (``gemm_fp8_sm90``) with a loader warp and two MMA warp groups in partitions of
their own, each owning half of every tile's rows (64 of 128): it waits for each K step's product and
adds it to its fp32 sum at once (one product tile per K step, so blockwise scales fit in registers).

The two warp groups take turns at the tensor cores, two K steps a turn: half 0 issues the MMAs of
steps k and k + 1 (two product tiles in flight), then half 1 issues its own of the same steps, then half
0 the next two once half 1 has issued, and so on. The MMAs run in the order they were issued, so one
half's pair runs while the other adds the pair it has just received, and the tensor cores always have
the next pair queued. (Left to themselves, both issue at once, their MMAs finish together, and both
add while the tensor cores idle; with one step a turn, half 1 waits for half 0's MMA to complete,
and the tensor cores idle at every hand-over.) Two barriers carry the turns, ``turn0`` and ``turn1``
(half 0, half 1 has issued its MMAs of the round); neither can run two phases ahead of its reader, since
each half waits for the other's previous signal before it raises its next. An odd last step of a tile
is a round of its own.

* ``fp8_gemm_sm90_halves_kernel``: exact and blockwise scaling (``SCALING`` "outer" or "block"); the
  warp groups load a round's blockwise scales from global memory after issuing its MMAs.
* ``fp8_gemm_sm90_staged_kernel``: blockwise only, each step's scales brought into shared memory by the
  loader warp with the step's tiles, counted on the same barrier: the step's ``BM`` values of
  ``scale_a`` (M-major, torch's layout, with a column pitch of a multiple of 16 bytes) and 32 weight
  scales of the tile's 128-column block (K-major) from the step's, rounded down to a multiple of 4 (a
  box's first inner coordinate must sit on 16 bytes, and a 16-byte destination faults: the box is 128
  bytes), of which the warp groups pick the step's. The weight scales are read as one row of their
  storage, so their row pitch needs no alignment (a box that runs past a row reads the next row's
  scales, which no step uses). The launcher (``ops.compute.fp8_sm90.staged_suits``) routes other
  layouts elsewhere: ``quantize``'s K-major ``scale_a`` to the first kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import (_drop_barriers, _finish, _operands, _outer, _ring_barriers,
                                             _step_scales, _tile_of, _tile_rows, _ws_loader)

SB_BOX = gl.constexpr(32)


@gluon.jit
def _take_turn(ready, turn0, turn1, steps, rounds, HALF: gl.constexpr, STAGES: gl.constexpr):
    # Before issuing round `rounds`, once its first K step (`steps`) has arrived: half 0 once half 1 has
    # issued the round before, half 1 once half 0 has issued this one.
    mbarrier.wait(ready.index(steps % STAGES), (steps // STAGES) & 1)
    if HALF == 0:
        if rounds > 0:
            mbarrier.wait(turn1, (rounds - 1) & 1)
    else:
        mbarrier.wait(turn0, rounds & 1)


@gluon.jit
def _pass_turn(turn0, turn1, HALF: gl.constexpr):
    if HALF == 0:
        mbarrier.arrive(turn0, count=1)
    else:
        mbarrier.arrive(turn1, count=1)


@gluon.jit
def _mma(a_bufs, b_bufs, ready, steps, zero, HALF: gl.constexpr, HM: gl.constexpr, STAGES: gl.constexpr,
         ARRIVED: gl.constexpr):
    # This half's product of K step `steps` into a fresh register tile, in flight on return; its data
    # waited for first unless ARRIVED (the turn's wait saw it: a second wait on the same barriers costs
    # a barrier of the warp group's threads).
    s = steps % STAGES
    if not ARRIVED:
        mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _issue_pair(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF: gl.constexpr, HM: gl.constexpr,
                STAGES: gl.constexpr):
    # A round of two K steps, `steps` and `steps + 1`: both MMAs in flight on return.
    _take_turn(ready, turn0, turn1, steps, rounds, HALF, STAGES)
    p0 = _mma(a_bufs, b_bufs, ready, steps, zero, HALF, HM, STAGES, True)
    p1 = _mma(a_bufs, b_bufs, ready, steps + 1, zero, HALF, HM, STAGES, False)
    _pass_turn(turn0, turn1, HALF)
    return p0, p1


@gluon.jit
def _issue_one(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF: gl.constexpr, HM: gl.constexpr,
               STAGES: gl.constexpr):
    # A round of one K step (a tile's odd last one), in flight on return.
    _take_turn(ready, turn0, turn1, steps, rounds, HALF, STAGES)
    p = _mma(a_bufs, b_bufs, ready, steps, zero, HALF, HM, STAGES, True)
    _pass_turn(turn0, turn1, HALF)
    return p


@gluon.jit
def _release(empty, steps, STAGES: gl.constexpr):
    mbarrier.arrive(empty.index(steps % STAGES), count=1)


@gluon.jit
def _turn_barriers():
    turn0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(turn0, count=1)
    mbarrier.init(turn1, count=1)
    return turn0, turn1


@gluon.jit
def _scaled(p, sa, sb, SCALING: gl.constexpr, BN: gl.constexpr):
    # A step's product as it is added: times its block scales (blockwise), else as it is.
    if SCALING == "block":
        return p * _outer(sa, sb, BN)
    else:
        return p


@gluon.jit
def _half_compute(c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
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
    rounds = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m, off_n, offs_m, offs_n = _tile_rows(t, num_pid_m, num_pid_n, HALF * HM, HM, BM, BN, GROUP_M,
                                                  rows_layout, cols_layout)
        acc = zero
        for ki in range(0, k_steps - 1, 2):
            p0, p1 = _issue_pair(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF, HM, STAGES)
            sa0, sb0 = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                    stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
            sa1, sb1 = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki + 1,
                                    stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
            p0, p1 = warpgroup_mma_wait(0, deps=(p0, p1))
            _release(empty, steps, STAGES)
            _release(empty, steps + 1, STAGES)
            acc += _scaled(p0, sa0, sb0, SCALING, BN)
            acc += _scaled(p1, sa1, sb1, SCALING, BN)
            steps += 2
            rounds += 1
        if k_steps % 2 == 1:
            p = _issue_one(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF, HM, STAGES)
            sa, sb = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, k_steps - 1,
                                  stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
            p = warpgroup_mma_wait(0, deps=(p, ))
            _release(empty, steps, STAGES)
            acc += _scaled(p, sa, sb, SCALING, BN)
            steps += 1
            rounds += 1
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
    turn0, turn1 = _turn_barriers()
    gl.warp_specialize([
        (_half_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_half_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(turn0)
    mbarrier.invalidate(turn1)


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
def _staged_scale(sa_bufs, sb_bufs, steps, at, pick, HALF: gl.constexpr, HM: gl.constexpr, BM: gl.constexpr,
                  STAGES: gl.constexpr, rows_layout: gl.constexpr, pick_layout: gl.constexpr):
    # Step `steps`' scale of each of this half's rows, read from the step's buffers (before their
    # release): scale_a of the rows times the weight scale at `at`, picked from the four loaded from `at`
    # rounded down.
    s = steps % STAGES
    sa = sa_bufs.index(s).reshape((BM, )).slice(HALF * HM, HM).load(rows_layout)
    four = sb_bufs.index(s).slice(0, 4, dim=1).load(pick_layout)
    sb = gl.sum(gl.sum(gl.where(pick == at % 4, four, 0.0), axis=1), axis=0)
    return (sa * sb)[:, None]


@gluon.jit
def _staged_compute(c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr, sb_ptr,
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
    rounds = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        off_m, off_n, offs_m, offs_n = _tile_rows(t, num_pid_m, num_pid_n, HALF * HM, HM, BM, BN, GROUP_M,
                                                  rows_layout, cols_layout)
        at = off_n // 128 * stride_sbn  # where the tile's weight scales start
        acc = zero
        for ki in range(0, k_steps - 1, 2):
            p0, p1 = _issue_pair(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF, HM, STAGES)
            scale0 = _staged_scale(sa_bufs, sb_bufs, steps, at + ki, pick, HALF, HM, BM, STAGES, rows_layout,
                                   pick_layout)
            scale1 = _staged_scale(sa_bufs, sb_bufs, steps + 1, at + ki + 1, pick, HALF, HM, BM, STAGES, rows_layout,
                                   pick_layout)
            p0, p1 = warpgroup_mma_wait(0, deps=(p0, p1))
            _release(empty, steps, STAGES)
            _release(empty, steps + 1, STAGES)
            acc += p0 * scale0
            acc += p1 * scale1
            steps += 2
            rounds += 1
        if k_steps % 2 == 1:
            p = _issue_one(a_bufs, b_bufs, ready, turn0, turn1, steps, rounds, zero, HALF, HM, STAGES)
            scale = _staged_scale(sa_bufs, sb_bufs, steps, at + k_steps - 1, pick, HALF, HM, BM, STAGES, rows_layout,
                                  pick_layout)
            p = warpgroup_mma_wait(0, deps=(p, ))
            _release(empty, steps, STAGES)
            acc += p * scale
            steps += 1
            rounds += 1
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
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], plain)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [1, sb_len], [gl.cdiv(sb_len, 4) * 4, 1], [1, SB_BOX], plain)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, SB_BOX], plain)
    c_desc, c_smem = _out_tiles(c_ptr, M, N, stride_cm, BM, BN)
    ready, empty = _ring_barriers(STAGES, 2)
    turn0, turn1 = _turn_barriers()
    gl.warp_specialize([
        (_staged_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr,
                           sb_ptr, bias_ptr, M, N, K, stride_sam, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                           HAS_BIAS)),
        (_staged_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr,
                           sb_ptr, bias_ptr, M, N, K, stride_sam, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                           HAS_BIAS)),
        (_staged_loader, (a_desc, b_desc, sa_desc, sb_desc, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, M, N, K,
                          stride_sbn, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(turn0)
    mbarrier.invalidate(turn1)
