"""Variants of the two-half FP8 kernel (``tileweave.kernels.gemm_fp8_sm90_halves``) for
``fp8_narrow_tiles.py``: how the two MMA warp groups hand the tensor cores to each other.

``TURN``: ``"done"`` is the library's order up to 639ab22 (half 1 issues step k once half 0's MMA of
step k has completed); ``"issued"`` lets half 1 issue step k as soon as half 0 has issued it (the MMAs
queue in that order). ``PAIR``: each warp group issues two K steps (two product tiles in flight) per
turn, so the turns hand over half as often; ``K`` must be a whole number of pairs of steps. The library
took ``"issued"`` with pairs in f817753 (NOTES.md, entry 147); ``"done"`` without pairs stays here for
comparison.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import (_drop_barriers, _finish, _operands, _outer, _ring_barriers,
                                             _step_scales, _tile_rows, _ws_loader)
from tileweave.kernels.gemm_fp8_sm90_halves import _out_tiles


@gluon.jit
def _wait_turn(turn0, turn1, rounds, HALF: gl.constexpr):
    if HALF == 0:
        if rounds > 0:
            mbarrier.wait(turn1, (rounds - 1) & 1)
    else:
        mbarrier.wait(turn0, rounds & 1)


@gluon.jit
def _pass_turn(turn0, turn1, HALF: gl.constexpr, TURN: gl.constexpr):
    # After issuing: half 1 always says so; half 0 too where its issue (not completion) passes the turn.
    if HALF == 1:
        mbarrier.arrive(turn1, count=1)
    elif TURN == "issued":
        mbarrier.arrive(turn0, count=1)


@gluon.jit
def _mma(a_bufs, b_bufs, ready, steps, zero, HALF: gl.constexpr, HM: gl.constexpr, STAGES: gl.constexpr):
    s = steps % STAGES
    mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _variant_compute(c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                     stride_sam, stride_sak, stride_sbk, stride_sbn, HALF: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                     SCALING: gl.constexpr, HAS_BIAS: gl.constexpr, TURN: gl.constexpr, PAIR: gl.constexpr):
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
        if PAIR:
            for ki in range(0, k_steps, 2):
                # the first step's buffer arrival is awaited before the turn, as in the library's kernel
                mbarrier.wait(ready.index(steps % STAGES), (steps // STAGES) & 1)
                _wait_turn(turn0, turn1, rounds, HALF)
                p0 = _mma(a_bufs, b_bufs, ready, steps, zero, HALF, HM, STAGES)
                p1 = _mma(a_bufs, b_bufs, ready, steps + 1, zero, HALF, HM, STAGES)
                _pass_turn(turn0, turn1, HALF, TURN)
                sa0, sb0 = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                        stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
                sa1, sb1 = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki + 1,
                                        stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
                p0, p1 = warpgroup_mma_wait(0, deps=(p0, p1))
                if TURN == "done" and HALF == 0:
                    mbarrier.arrive(turn0, count=1)
                mbarrier.arrive(empty.index(steps % STAGES), count=1)
                mbarrier.arrive(empty.index((steps + 1) % STAGES), count=1)
                if SCALING == "block":
                    acc += p0 * _outer(sa0, sb0, BN)
                    acc += p1 * _outer(sa1, sb1, BN)
                else:
                    acc += p0 + p1
                steps += 2
                rounds += 1
        else:
            for ki in range(k_steps):
                mbarrier.wait(ready.index(steps % STAGES), (steps // STAGES) & 1)
                _wait_turn(turn0, turn1, rounds, HALF)
                p = _mma(a_bufs, b_bufs, ready, steps, zero, HALF, HM, STAGES)
                _pass_turn(turn0, turn1, HALF, TURN)
                sa, sb = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                      stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
                p = warpgroup_mma_wait(0, deps=(p, ))
                if TURN == "done" and HALF == 0:
                    mbarrier.arrive(turn0, count=1)
                mbarrier.arrive(empty.index(steps % STAGES), count=1)
                if SCALING == "block":
                    acc += p * _outer(sa, sb, BN)
                else:
                    acc += p
                steps += 1
                rounds += 1
        _finish(acc, c_desc, c_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def halves_variant_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                          stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                          BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                          STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr,
                          TURN: gl.constexpr, PAIR: gl.constexpr):
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc, c_smem = _out_tiles(c_ptr, M, N, stride_cm, BM, BN)
    ready, empty = _ring_barriers(STAGES, 2)
    turn0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(turn0, count=1)
    mbarrier.init(turn1, count=1)
    gl.warp_specialize([
        (_variant_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                            M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                            SCALING, HAS_BIAS, TURN, PAIR)),
        (_variant_compute, (c_desc, c_smem, ready, empty, turn0, turn1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                            M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                            SCALING, HAS_BIAS, TURN, PAIR)),
        (_ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(turn0)
    mbarrier.invalidate(turn1)
