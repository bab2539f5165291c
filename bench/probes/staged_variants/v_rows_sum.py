"""The blockwise FP8 GEMM for Hopper with each K step's scales brought into shared memory by the loader
warp: ``gemm_fp8_sm90``'s two-half kernel (a loader warp, two MMA warp groups each owning half of a
tile's rows), where the MMA warps read a step's ``scale_a`` rows and weight scale from shared memory
after the barrier wait they already make for the step's tiles, instead of loading them from global
memory between the MMA and the multiply that needs them.

TMA brings, with each step's ``a`` and ``b`` tiles and counted on the same barrier: the step's ``BM``
values of ``scale_a`` (M-major: ``scale_a[:, k]`` contiguous), and 32 weight scales from step ``k``'s of
the tile's 128-column block on (K-major: ``scale_b[k, n]`` at ``n * stride + k``; a box of 128 bytes, as a
16-byte destination faults with a misaligned address), of which the MMA warps read the first alone. Each
scale tensor is read as one row of its storage, so its pitches need no alignment: a box that runs past
a column of ``scale_a`` gives rows past M their neighbours' scales (their ``a`` rows are zeros and their
outputs are not stored), one past the storage gives zeros. The launcher routes other layouts to the
two-half kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import _drop_barriers, _finish, _operands, _ring_barriers, _tile_of, _tile_rows

SB_BOX = gl.constexpr(32)


@gluon.jit
def _staged_loader(a_desc, b_desc, sa_desc, sb_desc, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, M, N, K,
                   stride_sak, stride_sbn, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr):
    # One warp: every K step's tiles and scales into the ring, each buffer once both readers released it.
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
            tma.async_copy_global_to_shared(sa_desc, [0, k * stride_sak + pid_m * BM], bar, sa_bufs.index(s))
            tma.async_copy_global_to_shared(sb_desc, [0, ((pid_n * BN) // 128) * stride_sbn + k], bar,
                                            sb_bufs.index(s))
            loads += 1


@gluon.jit
def _staged_compute(c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr, sb_ptr, bias_ptr,
                    M, N, K, stride_sam, stride_sbn, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
    # One warp group: rows HALF * BM/2 ... of each tile; each K step's product waited for and added with
    # the step's scales read from shared memory.
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
            p = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            sa = sa_bufs.index(s).reshape((BM, )).slice(HALF * HM, HM).load(rows_layout)
            box = sb_bufs.index(s).load(gl.BlockedLayout([1, SB_BOX], [32, 1], [4, 1], [1, 0]))
            scale = (sa * gl.sum(gl.sum(box * (gl.arange(0, SB_BOX, layout=gl.SliceLayout(0, gl.BlockedLayout([1, SB_BOX], [32, 1], [4, 1], [1, 0])))[None, :] == 0).to(gl.float32), axis=1), axis=0))[:, None]
            p = warpgroup_mma_wait(0, deps=(p, ))
            mbarrier.arrive(empty.index(s), count=1)
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
    """Blockwise scaling (``SCALING`` "block", ``BN`` and ``BK`` 128) on the two-half kernel with each
    step's scales in shared memory, brought there by the loader warp with the step's tiles."""
    gl.static_assert(SCALING == "block", "the staged kernel is for blockwise scaling")
    gl.static_assert(BN == 128 and BK == 128, "a tile is one 128 x 128 block of the weight's scales")
    HM: gl.constexpr = BM // 2
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    plain: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    # Each scale tensor as the one row of its storage (the row pitch given is never stepped over).
    sa_len = (gl.cdiv(K, BK) - 1) * stride_sak + M
    sb_len = (gl.cdiv(N, 128) - 1) * stride_sbn + gl.cdiv(K, BK)
    sa_desc = tma.make_tensor_descriptor(sa_ptr, [1, sa_len], [gl.cdiv(sa_len, 4) * 4, 1], [1, BM], plain)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [1, sb_len], [gl.cdiv(sb_len, 4) * 4, 1], [1, SB_BOX], plain)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], plain)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, SB_BOX], plain)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, BN],
                                        gl.NVMMASharedLayout.get_default_for([HM, BN], c_ptr.dtype.element_ty))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HM, BN], c_desc.layout)
    ready, empty = _ring_barriers(STAGES, 2)
    gl.warp_specialize([
        (_staged_compute, (c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr, sb_ptr, bias_ptr,
                           M, N, K, stride_sam, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES, HAS_BIAS)),
        (_staged_compute, (c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, sa_ptr, sb_ptr, bias_ptr,
                           M, N, K, stride_sam, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES, HAS_BIAS)),
        (_staged_loader, (a_desc, b_desc, sa_desc, sb_desc, ready, empty, a_bufs, b_bufs, sa_bufs, sb_bufs, M, N, K,
                          stride_sak, stride_sbn, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
