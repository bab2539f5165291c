"""The exact and blockwise FP8 GEMM for Hopper on 128 x 192 tiles: ``gemm_fp8_sm90``'s two-half kernel
(a loader warp, two MMA warp groups each owning half of a tile's rows, each K step's product added in
fp32 as soon as it is done) with every tile 192 columns wide.

A tile's 192 columns are two MMAs, 128 and 64 wide (register tiles are powers of two), each inside one
128-column block of the weight's blockwise scales: the 128-wide part first on even tiles, second on odd
ones (tile ``j`` starts at ``192 j``, so an even tile's first 128 columns and an odd tile's last 128 are
each one scale block). A warp group holds 64 x 192 of the sum and 64 x 192 of a step's product.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from tileweave.kernels.gemm_fp8_sm90 import _drop_barriers, _finish, _ring_barriers, _tile_of

WIDE = gl.constexpr(128)
NARROW = gl.constexpr(64)


@gluon.jit
def _parts(pid_n, BN: gl.constexpr):
    # The first columns of a tile's 128-wide and 64-wide parts.
    off_n = pid_n * BN
    odd = pid_n % 2
    return off_n + NARROW * odd, off_n + WIDE * (1 - odd)


@gluon.jit
def _wide_loader(a_desc, w_desc, n_desc, ready, empty, a_bufs, w_bufs, n_bufs, M, N, K, BM: gl.constexpr,
                 BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    # One warp: every K step of the program's tiles into the ring (the rows, the two parts' weight rows).
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    loads = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
        off_w, off_x = _parts(pid_n, BN)
        for k in range(k_steps):
            s = loads % STAGES
            mbarrier.wait(empty.index(s), ((loads // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes + n_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, k * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [off_w, k * BK], bar, w_bufs.index(s))
            tma.async_copy_global_to_shared(n_desc, [off_x, k * BK], bar, n_bufs.index(s))
            loads += 1


@gluon.jit
def _sb(sb_ptr, kb, off, N, stride_sbk, stride_sbn):
    # Step kb's weight scale of the 128-column block holding column `off` (0 past the last block).
    blk = off // 128
    return gl.load(sb_ptr + kb * stride_sbk + blk * stride_sbn, mask=blk < gl.cdiv(N, 128), other=0.0)


@gluon.jit
def _wide_compute(cw_desc, cn_desc, cw_smem, cn_smem, ready, empty, a_bufs, w_bufs, n_bufs, sa_ptr, sb_ptr,
                  bias_ptr, M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, HALF: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    # One warp group: rows HALF * BM/2 ... of each tile, both parts; each K step's two products waited for
    # and added at once while the other warp group's MMAs run.
    HM: gl.constexpr = BM // 2
    w_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WIDE, 32])
    n_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NARROW, 32])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    zero_w = gl.zeros((HM, WIDE), gl.float32, w_layout)
    zero_n = gl.zeros((HM, NARROW), gl.float32, n_layout)
    steps = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM + HALF * HM
        off_w, off_x = _parts(pid_n, BN)
        rows_w = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, w_layout))
        rows_n = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, n_layout))
        acc_w = zero_w
        acc_n = zero_n
        for ki in range(k_steps):
            s = steps % STAGES
            mbarrier.wait(ready.index(s), (steps // STAGES) & 1)
            a = a_bufs.index(s).slice(HALF * HM, HM)
            pw = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), zero_w, use_acc=False, is_async=True)
            pn = warpgroup_mma(a, n_bufs.index(s).permute((1, 0)), zero_n, use_acc=False, is_async=True)
            if SCALING == "block":
                sa_w = gl.load(sa_ptr + rows_w.to(gl.int64) * stride_sam + ki * stride_sak, mask=rows_w < M,
                               other=0.0)
                sa_n = gl.load(sa_ptr + rows_n.to(gl.int64) * stride_sam + ki * stride_sak, mask=rows_n < M,
                               other=0.0)
                sb_w = _sb(sb_ptr, ki, off_w, N, stride_sbk, stride_sbn)
                sb_n = _sb(sb_ptr, ki, off_x, N, stride_sbk, stride_sbn)
            pw, pn = warpgroup_mma_wait(0, deps=(pw, pn))
            mbarrier.arrive(empty.index(s), count=1)
            if SCALING == "block":
                acc_w += pw * (sa_w * sb_w)[:, None]
                acc_n += pn * (sa_n * sb_n)[:, None]
            else:
                acc_w += pw
                acc_n += pn
            steps += 1
        cols_w = off_w + gl.arange(0, WIDE, layout=gl.SliceLayout(0, w_layout))
        cols_n = off_x + gl.arange(0, NARROW, layout=gl.SliceLayout(0, n_layout))
        _finish(acc_w, cw_desc, cw_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, rows_w, cols_w, off_m, off_w, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
        _finish(acc_n, cn_desc, cn_smem.index(HALF), sa_ptr, sb_ptr, bias_ptr, rows_n, cols_n, off_m, off_x, M, N,
                stride_sam, stride_sbn, SCALING, HAS_BIAS)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_sm90_wide_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                              stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                              STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The exact and blockwise modes (``SCALING`` "outer" or "block") on 128 x 192 tiles (``BN`` 192), a
    loader warp and two MMA warp groups each owning half of every tile's rows."""
    gl.static_assert(BN == WIDE + NARROW, "the wide kernel's tiles are 192 columns")
    HM: gl.constexpr = BM // 2
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BM, BK],
                                        gl.NVMMASharedLayout.get_default_for([BM, BK], a_ptr.dtype.element_ty))
    w_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [WIDE, BK],
                                        gl.NVMMASharedLayout.get_default_for([WIDE, BK], b_ptr.dtype.element_ty))
    n_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [NARROW, BK],
                                        gl.NVMMASharedLayout.get_default_for([NARROW, BK], b_ptr.dtype.element_ty))
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, WIDE, BK], w_desc.layout)
    n_bufs = gl.allocate_shared_memory(n_desc.dtype, [STAGES, NARROW, BK], n_desc.layout)
    cw_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, WIDE],
                                         gl.NVMMASharedLayout.get_default_for([HM, WIDE], c_ptr.dtype.element_ty))
    cn_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, NARROW],
                                         gl.NVMMASharedLayout.get_default_for([HM, NARROW], c_ptr.dtype.element_ty))
    cw_smem = gl.allocate_shared_memory(cw_desc.dtype, [2, HM, WIDE], cw_desc.layout)
    cn_smem = gl.allocate_shared_memory(cn_desc.dtype, [2, HM, NARROW], cn_desc.layout)
    ready, empty = _ring_barriers(STAGES, 2)
    gl.warp_specialize([
        (_wide_compute, (cw_desc, cn_desc, cw_smem, cn_smem, ready, empty, a_bufs, w_bufs, n_bufs, sa_ptr, sb_ptr,
                         bias_ptr, M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M,
                         STAGES, SCALING, HAS_BIAS)),
        (_wide_compute, (cw_desc, cn_desc, cw_smem, cn_smem, ready, empty, a_bufs, w_bufs, n_bufs, sa_ptr, sb_ptr,
                         bias_ptr, M, N, K, stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M,
                         STAGES, SCALING, HAS_BIAS)),
        (_wide_loader, (a_desc, w_desc, n_desc, ready, empty, a_bufs, w_bufs, n_bufs, M, N, K, BM, BN, BK, GROUP_M,
                        STAGES)),
    ], [4, 1], [232, 24])
    _drop_barriers(ready, empty, STAGES)
