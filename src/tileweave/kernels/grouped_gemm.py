"""Persistent grouped GEMM: ``out[p] = a[row(p)] @ b[g % E] (* row_scale[p])`` for the rows p of group g.

Group g is the output rows ``[offsets[g], offsets[g + 1])``; the kernel reads the offsets on the device,
so the host never learns the row counts (the launch can be captured in a CUDA graph). Tiles are
(group, row tile, column tile); the groups' tiles are numbered one after another in visiting order and
program ``pid`` of ``P`` takes tiles ``pid, pid + P, ...``, so the load stays balanced whatever the
split of rows between groups. Within a group, row tiles are super-grouped (``GROUP_M``) so that
consecutive programs share the expert's B tiles in L2.

Two ways to find a tile's group (a compile-time switch):

* ``G_BLOCK`` > 0: the visited groups' offsets are loaded once per program into a vector of ``G_BLOCK``
  lanes; their tile counts, prefix-summed, tell each tile its group without touching memory again.
* ``G_BLOCK`` == 0 (many groups): each program walks the groups in order, two offset loads per group.

Rows are gathered in the main loop (``GATHER``: row p reads ``a[a_rows[p]]``) with pointer loads; B is
read through one three-dimensional TMA descriptor over ``[E, K, N]`` (or ``[E, N, K]`` for the
transpose of a stacked ``nn.Linear`` weight, ``B_NK``) where its strides allow, by pointers otherwise.

``GATE`` (fused all-gather): groups are visited from group ``rank * E`` on (own source rank first, then
rank + 1, ...); a tile whose group comes from source ``s = g // E`` other than ``rank`` first waits for
``ready_ptr[s]`` to reach ``epoch``. An expired wait records ``1 + s`` in ``err_ptr`` and the tile
neither loads nor stores. ``SIGNAL``: each finished tile of group g adds 1 to ``counters_ptr[g // E]``
with a system-scope release, after its stores.

``SWIGLU`` (an expert MLP's up projection; ``N`` is the width of the activation, the columns a tile
covers): B holds gate columns ``[0, N)`` and up columns ``[N, 2N)``; a tile of BN
  output columns multiplies by the 2 BN columns of B they need, loaded side by side (gate j next to up
  j: a four-dimensional TMA box over the ``nn.Linear`` weight, or pointer loads), so one MMA chain
  feeds both and the epilogue stores ``silu(gate) * up``; ``SAVE_PRE`` also stores the pre-activations
  into ``pre_ptr`` ``[P, 2N]``, interleaved (gate j at column 2j, up j at 2j + 1): what the backward
  needs.

``CAST`` (under ``SWIGLU``): the epilogue also casts ``h`` to float8 for the next GEMM, from the float32
values it computed (not rounded to the output's dtype first), with ``quantize``'s scale and rounding
(``tileweave.kernels.quantize``), so the result equals ``quantize`` of those values bit for bit. The
cast travels as ``(q_ptr, q_scale_ptr, amax_ptr, stride_qm, stride_qsm, stride_qsc)``:

* ``"1x128"`` (``BN`` a multiple of 128, so each 1 x 128 group of a row lies in one tile): the tile's
  groups are cast and their scales stored; ``h`` is not written (``c_ptr`` is not read or written);
* ``"row"``: the tile stores its float32 values into ``c_ptr`` and raises each row's amax in
  ``amax_ptr[row]`` (an atomic max); the cast is a second launch (``quantize_kernel``, over tiles, with
  those amaxes) once every tile is done;
* ``"tensor"``: the same with one amax, ``amax_ptr[0]``.

``amax_ptr`` starts at zero; ``q_ptr`` and ``q_scale_ptr`` are written by ``"1x128"`` only.

``SCALING`` (FP8 inputs, as in ``tileweave.kernels.gemm``): ``"outer"`` and ``"outer_fast"`` multiply the
finished tile by ``scale_a[src] * scale_b[expert, col]`` before its epilogue (tensorwise: zero strides;
``"outer"`` adds each K step's product to the fp32 accumulator, ``"outer_fast"`` lets the tensor cores
accumulate across K steps), ``"block"``
scales each K step's product by ``scale_a[src, k // 128] * scale_b[expert, k // 128, col // 128]``
before accumulating it. ``src`` is the row of ``a`` a row reads (``a_rows[p]`` when gathering), so
the a-scales travel with the rows; ``col`` is the column of B (under ``SWIGLU``, the gate's or the
up's), so the scales apply before the SwiGLU. The scales travel as one tuple ``(scale_a_ptr,
scale_b_ptr, stride_sam, stride_sak, stride_sbe, stride_sbk, stride_sbn)``.
"""

import triton
import triton.language as tl

from tileweave.kernels.fused_quantize import _cast_blocks
from tileweave.kernels.gemm import _grouped_tile
from tileweave.kernels.sync import release_add, wait_epoch


@triton.jit
def _b_descriptor(b_ptr, E, N, K, stride_be, stride_bk, stride_bn,
                  BN: tl.constexpr, BK: tl.constexpr, B_NK: tl.constexpr):
    if B_NK:
        return tl.make_tensor_descriptor(b_ptr, shape=[E, N, K], strides=[stride_be, stride_bn, 1],
                                         block_shape=[1, BN, BK])
    else:
        return tl.make_tensor_descriptor(b_ptr, shape=[E, K, N], strides=[stride_be, stride_bk, 1],
                                         block_shape=[1, BK, BN])


@triton.jit
def _ab_scales(scales, src, mask_m, expert, b_cols, mask_b, kb, BLOCK: tl.constexpr):
    # scale_a of the tile's source rows and scale_b of its B columns (per 128 columns with BLOCK), K block kb.
    sa = tl.load(scales[0] + src * scales[2] + kb * scales[3], mask=mask_m, other=0.0)
    col = b_cols // 128 if BLOCK else b_cols
    sb = tl.load(scales[1] + expert.to(tl.int64) * scales[4] + kb * scales[5] + col * scales[6], mask=mask_b,
                 other=0.0)
    return sa[:, None] * sb[None, :]


@triton.jit
def _tile(a_ptr, a_rows_ptr, b_ptr, b_src, c_ptr, scale_ptr, counters_ptr, pre_ptr,
          row_lo, row_hi, row_end, local, expert, source, N, K,
          stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, scales, cast,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          B_NK: tl.constexpr, B_TMA: tl.constexpr, GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
          SIGNAL: tl.constexpr, PRECISION: tl.constexpr, SWIGLU: tl.constexpr, SAVE_PRE: tl.constexpr,
          SCALING: tl.constexpr, CAST: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
          MIN_EXP: tl.constexpr, POW2: tl.constexpr):
    """Tile ``local`` of the group of output rows ``[row_lo, row_hi)``, times ``b[expert]``. Rows from
    ``row_end`` on are neither loaded nor stored (``row_end == row_lo`` after an expired gate: the
    masks then depend on the flag's value, so no load can be issued before the wait)."""
    num_m = tl.cdiv(row_hi - row_lo, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = _grouped_tile(local, num_m, num_n, GROUP_M)
    offs_m = row_lo + pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    if GATHER:
        src = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        src = offs_m.to(tl.int64)
    a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak
    # A SwiGLU tile multiplies by 2 * BN columns of B, gate j and up j side by side (2j, 2j + 1), so
    # that one accumulator (one MMA chain) holds both and the epilogue splits them in registers.
    BNB: tl.constexpr = BN * (1 + SWIGLU)
    offs_b = tl.arange(0, BNB)
    if SWIGLU:
        b_cols = (offs_b % 2) * N + pid_n * BN + offs_b // 2
        mask_b = pid_n * BN + offs_b // 2 < N
    else:
        b_cols = pid_n * BN + offs_b
        mask_b = b_cols < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_k[:, None] * stride_bk + b_cols[None, :] * stride_bn
    acc = tl.zeros((BM, BNB), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BK)):
        kk = ki * BK + offs_k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
        if B_TMA:
            if SWIGLU:  # B_NK: the descriptor is [E, N, 2, K], gate and up of one column adjacent
                b = b_src.load([expert, pid_n * BN, 0, ki * BK]).reshape(BNB, BK).T
            elif B_NK:
                b = b_src.load([expert, pid_n * BN, ki * BK]).reshape(BN, BK).T
            else:
                b = b_src.load([expert, ki * BK, pid_n * BN]).reshape(BK, BN)
        else:
            b = tl.load(b_ptrs, mask=(kk < K)[:, None] & mask_b[None, :], other=0.0)
            b_ptrs += BK * stride_bk
        if SCALING == "block":
            acc += tl.dot(a, b) * _ab_scales(scales, src, mask_m, expert, b_cols, mask_b, (ki * BK) // 128, True)
        elif SCALING == "outer":  # each K step's product added in fp32 (torch's use_fast_accum=False)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * stride_ak
    if SCALING == "outer" or SCALING == "outer_fast":
        acc = acc * _ab_scales(scales, src, mask_m, expert, b_cols, mask_b, 0, False)
    mask = mask_m[:, None] & mask_n[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    if SWIGLU:
        if SAVE_PRE:  # interleaved like the tile: one contiguous store
            offs_pre = pid_n * 2 * BN + tl.arange(0, 2 * BN)
            tl.store(pre_ptr + rows64 * stride_pm + offs_pre[None, :], acc.to(pre_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & (offs_pre < 2 * N)[None, :])
        gate, up = tl.split(acc.reshape(BM, BN, 2))
        acc = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0)
        acc = acc * scale[:, None]
    if CAST == "1x128":
        _cast_blocks(cast[0], cast[1], acc, offs_m, pid_n * BN, row_end, N, cast[3], cast[4], cast[5],
                     BM, BN, FP8_MAX, MANT, MIN_EXP, POW2)
    else:
        c_ptrs = c_ptr + rows64 * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    if CAST == "row":
        tl.atomic_max(cast[2] + offs_m, tl.max(tl.where(mask, tl.abs(acc), 0.0), axis=1), mask=offs_m < row_end)
    elif CAST == "tensor":
        tl.atomic_max(cast[2], tl.max(tl.max(tl.where(mask, tl.abs(acc), 0.0), axis=1), axis=0))
    if SIGNAL:
        release_add(counters_ptr + source, 1, "sys")


@triton.jit
def _gate(ready_ptr, err_ptr, epoch, max_spin, rank, source, waited, missed):
    """``(waited, missed)`` after making sure the flag of ``source`` was reached (or its wait expired):
    a program visits sources in order, so it waits once per source, at its first tile of it."""
    if source != waited:
        if source != rank:
            missed = wait_epoch(ready_ptr + source, epoch, err_ptr, 1 + source, max_spin)
        else:
            missed = 0
        waited = source
    return waited, missed


@triton.jit(do_not_specialize=["epoch", "max_spin", "rank", "g_lo", "n_groups", "rotate"])
def grouped_gemm_kernel(
        a_ptr, a_rows_ptr, b_ptr, c_ptr, offsets_ptr, scale_ptr, ready_ptr, err_ptr, counters_ptr,
        pre_ptr, scale_a_ptr, scale_b_ptr, q_ptr, q_scale_ptr, amax_ptr,
        epoch, max_spin, rank, g_lo, n_groups, rotate, E, N, K,
        stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm,
        stride_sam, stride_sak, stride_sbe, stride_sbk, stride_sbn, stride_qm, stride_qsm, stride_qsc,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, P: tl.constexpr,
        G_BLOCK: tl.constexpr, B_NK: tl.constexpr, B_TMA: tl.constexpr, GATHER: tl.constexpr,
        HAS_SCALE: tl.constexpr, GATE: tl.constexpr, SIGNAL: tl.constexpr, PRECISION: tl.constexpr,
        FLATTEN: tl.constexpr = False, SWIGLU: tl.constexpr = False, SAVE_PRE: tl.constexpr = False,
        SCALING: tl.constexpr = None, CAST: tl.constexpr = None, FP8_MAX: tl.constexpr = 448.0,
        MANT: tl.constexpr = 3, MIN_EXP: tl.constexpr = -6, POW2: tl.constexpr = False):
    """See the module docstring. Groups ``g_lo + (i + rotate) % n_groups`` for ``i`` in ``[0, n_groups)``
    are visited in order of ``i``; group g multiplies by expert ``g % E``, its source rank (``GATE``,
    ``SIGNAL``) is ``g // E``. ``ready_ptr``, ``err_ptr`` and ``counters_ptr`` are read only under
    ``GATE`` / ``SIGNAL``; ``epoch`` and ``max_spin`` belong to ``GATE``. ``FLATTEN`` (``G_BLOCK`` > 0,
    no ``GATE``): the tile and K loops are pipelined as one, so that a tile's epilogue overlaps the next
    tile's first loads. ``SCALING``: see the module docstring (``scale_a_ptr``, ``scale_b_ptr`` and
    their strides are read only under it). ``CAST`` (under ``SWIGLU``): see the module docstring; the
    float8 format's ``FP8_MAX``, ``MANT``, ``MIN_EXP`` and ``POW2`` are ``quantize_kernel``'s."""
    scales = (scale_a_ptr, scale_b_ptr, stride_sam, stride_sak, stride_sbe, stride_sbk, stride_sbn)
    cast = (q_ptr, q_scale_ptr, amax_ptr, stride_qm, stride_qsm, stride_qsc)
    pid = tl.program_id(0)
    if B_TMA:
        if SWIGLU:
            b_src = tl.make_tensor_descriptor(b_ptr, shape=[E, N, 2, K], block_shape=[1, BN, 2, BK],
                                              strides=[stride_be, stride_bn, N * stride_bn, 1])
        else:
            b_src = _b_descriptor(b_ptr, E, N, K, stride_be, stride_bk, stride_bn, BN, BK, B_NK)
    else:
        b_src = b_ptr
    num_n = tl.cdiv(N, BN)
    waited = rank
    missed = 0
    if G_BLOCK > 0:
        lane = tl.arange(0, G_BLOCK)
        visited = lane < n_groups
        g_of = g_lo + (lane + rotate) % n_groups
        lo = tl.load(offsets_ptr + g_of, mask=visited, other=0)
        hi = tl.load(offsets_ptr + g_of + 1, mask=visited, other=0)
        tiles = tl.cdiv(hi - lo, BM) * num_n
        ends = tl.cumsum(tiles, 0)
        total = tl.sum(tiles)
        for t in tl.range(pid, total, P, flatten=FLATTEN):
            i = tl.sum((ends <= t).to(tl.int32))
            first = tl.sum(tl.where(lane < i, tiles, 0))
            row_lo = tl.sum(tl.where(lane == i, lo, 0))
            row_hi = tl.sum(tl.where(lane == i, hi, 0))
            g = g_lo + (i + rotate) % n_groups
            source = g // E
            row_end = row_hi
            if GATE:
                waited, missed = _gate(ready_ptr, err_ptr, epoch, max_spin, rank, source, waited, missed)
                row_end = row_hi - missed * (row_hi - row_lo)
            _tile(a_ptr, a_rows_ptr, b_ptr, b_src, c_ptr, scale_ptr, counters_ptr, pre_ptr,
                  row_lo, row_hi, row_end, t - first, g - source * E, source, N, K,
                  stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, scales,
                  cast, BM, BN, BK, GROUP_M, B_NK, B_TMA, GATHER, HAS_SCALE, SIGNAL, PRECISION, SWIGLU, SAVE_PRE,
                  SCALING, CAST, FP8_MAX, MANT, MIN_EXP, POW2)
    else:
        base = 0
        for i in range(0, n_groups):
            g = g_lo + (i + rotate) % n_groups
            row_lo = tl.load(offsets_ptr + g)
            row_hi = tl.load(offsets_ptr + g + 1)
            tiles = tl.cdiv(row_hi - row_lo, BM) * num_n
            source = g // E
            # This program's first tile of the group: global tile base + l belongs to (base + l) % P.
            for local in range((pid + P - base % P) % P, tiles, P):
                row_end = row_hi
                if GATE:
                    waited, missed = _gate(ready_ptr, err_ptr, epoch, max_spin, rank, source, waited, missed)
                    row_end = row_hi - missed * (row_hi - row_lo)
                _tile(a_ptr, a_rows_ptr, b_ptr, b_src, c_ptr, scale_ptr, counters_ptr, pre_ptr,
                      row_lo, row_hi, row_end, local, g - source * E, source, N, K,
                      stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm,
                      scales, cast, BM, BN, BK, GROUP_M, B_NK, B_TMA, GATHER, HAS_SCALE, SIGNAL, PRECISION, SWIGLU,
                      SAVE_PRE, SCALING, CAST, FP8_MAX, MANT, MIN_EXP, POW2)
            base += tiles
