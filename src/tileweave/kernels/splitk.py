"""The decode-shaped GEMM: few rows, a weight read once, its K dimension split over the programs.

``c = a @ b (+ bias)`` for ``a [M, K]`` of a few rows (a decode step's tokens) and ``b [K, N]`` (a
weight, usually the transpose of an ``nn.Linear`` weight ``[N, K]``, read in place). Such a GEMM's time
is the weight's read: every byte of ``b`` is needed once, and a grid of whole ``BM x BN`` tiles has only
``N / BN`` programs, too few to keep the memory busy, each reading all of K. Here each tile's K range is
cut into ``splits`` equal spans of ``k_split`` (a multiple of ``BK``), one program each, so that
``tiles x splits`` programs stream the weight side by side.

A tile of one span is stored at once. A tile of several spans is finished by the last of its programs to
arrive: each stores its fp32 partial (its real rows only) in its slot of ``part_ptr`` (``[tiles, splits,
BM, BN]``), counts itself in ``locks_ptr[tile]`` (acquire-release), and the program that brings the count
to ``splits`` sums the partials in span order (so the result does not depend on arrival order), adds the
bias, stores the tile and resets the count to 0 for the next call. No program waits for another.

Program ``pid`` of the one-dimensional grid takes column tile ``pid % tiles_n`` of span ``pid // tiles_n
% splits`` of row tile ``pid // (tiles_n * splits)``: consecutive programs read neighbouring rows of the
weight.
"""

import triton
import triton.language as tl


def _metadata(grid, kernel, args):
    m, n, k = args["M"], args["N"], args["K"]
    return {"name": f"tileweave_splitk_{m}x{n}x{k}", "flops": 2 * m * n * k}


@triton.jit(launch_metadata=_metadata)
def splitk_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, locks_ptr,
                       M, N, K, k_split, splits,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """``c[M, N] = a[M, K] @ b[K, N] (+ bias[N])`` with fp32 accumulation (module docstring); ``splits``
    spans of ``k_split`` elements of K per tile; ``part_ptr`` and ``locks_ptr`` as there (unused when
    ``splits`` is 1); ``PRECISION``: ``tl.dot``'s input precision for float32 inputs, else None.
    ``USE_TMA``: ``a`` and ``b`` read through tensor descriptors (``b`` the transpose of a row-major
    ``[N, K]`` weight, ``stride_bk`` 1; both 16-byte aligned), else by pointers."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    pid_n = pid % tiles_n
    pid_s = (pid // tiles_n) % splits
    pid_m = pid // (tiles_n * splits)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < M
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    k_lo = pid_s * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BN, BK])
    for k0 in range(k_lo, k_hi, BK):
        if USE_TMA:
            # Out of bounds (rows past M, columns past N, K past its end) reads as zeros.
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([pid_n * BN, k0]).T
        else:
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_cols + kk[:, None].to(tl.int64) * stride_bk, mask=k_ok[:, None] & (rn < N)[None, :],
                        other=0.0)
        if PRECISION is None:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c_mask = row_ok[:, None] & (rn < N)[None, :]
    if splits > 1:
        tile = pid_m * tiles_n + pid_n
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (tile * splits + pid_s).to(tl.int64) * (BM * BN) + offs, acc, mask=c_mask)
        tl.debug_barrier()  # every thread's partial stored before the count that publishes it
        arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for s in range(0, splits):
                acc += tl.load(part_ptr + (tile * splits + s).to(tl.int64) * (BM * BN) + offs, mask=c_mask,
                               other=0.0, cache_modifier=".cg")
            _store(c_ptr, bias_ptr, acc, rm, rn, N, c_mask, stride_cm, stride_cn, HAS_BIAS)
            tl.atomic_xchg(locks_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _store(c_ptr, bias_ptr, acc, rm, rn, N, c_mask, stride_cm, stride_cn, HAS_BIAS)


@triton.jit
def _store(c_ptr, bias_ptr, acc, rm, rn, N, c_mask, stride_cm, stride_cn, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=c_mask)
