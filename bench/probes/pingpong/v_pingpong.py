"""Probe: the two-half FP8 kernel with the warp groups' MMAs in strict alternation. Half 1 issues step k
once half 0's MMA of step k has completed; half 0 issues step k + 1 once half 1 has issued step k. The
tensor cores then run one warp group's product while the other adds its own, instead of both products
finishing together and both warp groups adding while the tensor cores idle."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import (_drop_barriers, _finish, _operands, _outer, _ring_barriers,
                                             _step_scales, _tile_rows, _ws_loader)


@gluon.jit
def _turn_compute(c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                  stride_sam, stride_sak, stride_sbk, stride_sbn, HALF: gl.constexpr, BM: gl.constexpr,
                  BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
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
            s = steps % STAGES
            mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
            if HALF == 0:
                if steps > 0:
                    mbarrier.wait(issued1, (steps - 1) & 1)
            else:
                mbarrier.wait(done0, steps & 1)
            p = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            if HALF == 1:
                mbarrier.arrive(issued1, count=1)
            sa, sb = _step_scales(sa_ptr, sb_ptr, off_n, offs_m, offs_n, M, N, ki,
                                  stride_sam, stride_sak, stride_sbk, stride_sbn, SCALING, BN)
            p = warpgroup_mma_wait(0, deps=(p, ))
            if HALF == 0:
                mbarrier.arrive(done0, count=1)
            mbarrier.arrive(empty.index(s), count=1)
            if SCALING == "block":
                acc += p * _outer(sa, sb, BN)
            else:
                acc += p
            steps += 1
        _finish(acc, c_desc, c_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, off_m, off_n, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_sm90_pingpong_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                                  stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                                  STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    HM: gl.constexpr = BM // 2
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, BN],
                                        gl.NVMMASharedLayout.get_default_for([HM, BN], c_ptr.dtype.element_ty))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HM, BN], c_desc.layout)
    ready, empty = _ring_barriers(STAGES, 2)
    done0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    issued1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done0, count=1)
    mbarrier.init(issued1, count=1)
    gl.warp_specialize([
        (_turn_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_turn_compute, (c_desc, c_smem, ready, empty, done0, issued1, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr,
                         M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES,
                         SCALING, HAS_BIAS)),
        (_ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(done0)
    mbarrier.invalidate(issued1)
