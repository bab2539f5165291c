"""Dynamic float8 quantization: the amax of each group of elements, its scale, and the cast.

A matrix ``X [R, C]`` is read through its strides, so a transposed view is quantized in place: the
K-major copy of an operand that a backward GEMM needs comes out of the same pass that casts it, with
no separate transpose. Each group of elements shares one float32 scale

    scale = max(amax, EPS) / FP8_MAX        (rounded up to a power of two with POW2)
    q     = round_to_nearest_even(clamp(x / scale, -FP8_MAX, FP8_MAX))

torch's and torchao's convention (``x ~ q * scale``). ``GROUP`` names the groups:

* ``"tensor"``: one group; its amax comes from ``amax_kernel`` (an atomic max over tiles into one
  float32), so the cast is a second launch and nothing waits on the host; with ``SCALE_GIVEN`` the
  scale itself is given (one already computed for the same tensor in another orientation);
* ``"row"``: each row; a program owns ``BR`` rows and walks their columns twice (amax, then cast);
* ``"row_amax"``: each row, its amax already found by ``amax_kernel`` with ``PER_ROW`` (an atomic max
  per row over tiles): for an input read transposed, whose rows are strided columns in memory, two
  passes over tiles read faster than one program walking each row;
* ``"1x128"``: 128 consecutive columns of a row (DeepSeek-V3's activation blocks);
* ``"128x128"``: 128 x 128 blocks (its weight blocks), a program per block.

A stack of matrices ``X [B, R, C]`` (an MoE layer's experts' weights, or their per-expert transposes)
is one launch: the grid's third dimension walks the matrices, each program offsets its pointers by its
matrix's strides (``stride_xb``, ``stride_qb``, ``stride_sb``; zero for one matrix), and no group spans
two matrices except ``"tensor"``'s, whose one amax covers the stack.

The output ``Q [R, C_out]`` may have more columns than ``X`` (``C_out >= C``, padded with zeros to a
multiple of 128 for a blockwise operand whose contraction dimension, the tokens, is not). A float8
``X`` may come with scales of its own (``DEQUANT``): ``x = X[r, c] * in_scale[r // IN_GR, c // IN_GC]``
is quantized again in the new groups (a gathered float8 operand requantized for another GEMM).

The cast rounds to nearest even, subnormals included: on a GPU by the hardware's conversion; in Triton's
interpreter, whose own float8 conversion rounds differently, in float32 arithmetic to the float8 grid
first, so that the conversion itself is exact and gives the GPU's bits.
"""

import os

import triton
import triton.language as tl

EPS = tl.constexpr(1e-12)
"""The floor of an amax (torchao's), so that an all-zero group gets a finite scale."""
ROUND_IN_ARITHMETIC = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
"""Round to the float8 grid in float32 arithmetic before converting (in the interpreter: Triton fixes
its mode at import, as this does)."""


@triton.jit
def _to_fp8_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``y`` (float32, within the format's range) rounded to the nearest float8 value with ``MANT``
    mantissa bits and smallest normal exponent ``MIN_EXP``, ties to even; as float32."""
    bits = y.to(tl.int32, bitcast=True)
    # The grid's step at y: 2**(exponent of y - MANT), not below the smallest subnormal 2**(MIN_EXP - MANT).
    step = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True) * (2.0 ** -MANT), 2.0 ** (MIN_EXP - MANT))
    # 1 / step from its exponent bits (254 - e): exact, as the division by a power of two must be.
    inv = ((254 << 23) - step.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    t = y * inv  # |t| < 2**(MANT + 1): adding and removing 1.5 * 2**23 rounds it to an integer, ties to even
    t = (t + 12582912.0) - 12582912.0
    # y's sign back onto a zero result (-0.0 stays -0.0, as torch's cast keeps it)
    r = (t * step).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.math.div_rn(tl.maximum(amax, EPS), FP8_MAX)
    if POW2:  # the next power of two up (x / scale then stays within FP8_MAX), exactly from the bits
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _load(x_ptr, in_scale_ptr, offs_r, offs_c, r0, c0, R, C, stride_xr, stride_xc, stride_ir, stride_ic,
          DEQUANT: tl.constexpr, IN_GR: tl.constexpr, IN_GC: tl.constexpr, IN_ALONG: tl.constexpr = "each"):
    """The tile ``X[offs_r, offs_c]`` (its first row and column ``r0``, ``c0``) as float32 (zeros outside
    ``[R, C]``), times its scales if ``DEQUANT``. ``IN_ALONG``: how the input's scales vary over the tile
    (the launcher knows from their groups and the tile): ``"one"`` a single scale, ``"row"`` one per row
    (the tile's columns within one group), ``"col"`` one per column (its rows within one group),
    ``"each"`` any (one load per element)."""
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    r64 = offs_r.to(tl.int64)
    if DEQUANT and IN_ALONG != "each":
        x = tl.load(x_ptr + r64[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc, mask=mask,
                    other=0.0).to(tl.float32)
        if IN_ALONG == "one":
            return x * tl.load(in_scale_ptr)
        elif IN_ALONG == "row":  # the group of the tile's first column holds them all
            s = tl.load(in_scale_ptr + (r64 // IN_GR) * stride_ir + (c0 // IN_GC) * stride_ic, mask=offs_r < R,
                        other=0.0)
            return x * s[:, None]
        else:
            s = tl.load(in_scale_ptr + (r0 // IN_GR).to(tl.int64) * stride_ir + (offs_c // IN_GC) * stride_ic,
                        mask=offs_c < C, other=0.0)
            return x * s[None, :]
    return _load_rows(x_ptr, in_scale_ptr, r64, offs_c, mask, stride_xr, stride_xc, stride_ir, stride_ic,
                      DEQUANT, IN_GR, IN_GC)


@triton.jit
def _load_rows(x_ptr, in_scale_ptr, rows, offs_c, mask, stride_xr, stride_xc, stride_ir, stride_ic,
               DEQUANT: tl.constexpr, IN_GR: tl.constexpr, IN_GC: tl.constexpr):
    """The tile ``X[rows, offs_c]`` (int64 row indices) as float32, zeros outside ``mask``, times its scales if
    ``DEQUANT`` (one load per element)."""
    r64 = rows[:, None]
    c64 = offs_c.to(tl.int64)[None, :]
    x = tl.load(x_ptr + r64 * stride_xr + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if DEQUANT:
        s = tl.load(in_scale_ptr + (r64 // IN_GR) * stride_ir + (c64 // IN_GC) * stride_ic, mask=mask, other=0.0)
        x = x * s
    return x


_QUOTIENT = tl.constexpr("""{
    .reg .f32 y, e;
    mul.rn.f32 y, $1, $3;
    fma.rn.f32 e, y, $2, $1;
    fma.rn.f32 y, e, $3, y;
    fma.rn.f32 e, y, $2, $1;
    fma.rn.f32 y, e, $3, y;
    copysign.f32 $0, $1, y;
}""")
"""PTX of ``x / s`` from ``$1 = x``, ``$2 = -s`` and ``$3 = 1 / s``: ``y = x * (1 / s)``, corrected twice by
the exact remainder ``x - y * s`` (``_to_fp8``), then given ``x``'s sign (a correction turns the
quotient of -0 into +0; elsewhere the sign is already ``x``'s, as ``s > 0``)."""


@triton.jit
def _reciprocal(scale):
    """``1 / scale``, correctly rounded: what ``_to_fp8`` divides by on a GPU (computed once per scale,
    on its own shape, before it is broadcast over the tile)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _cast_store(q_ptr, x, scale, offs_r, offs_c, R, C_out, stride_qr, stride_qc,
                FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Store ``x / scale`` cast to float8 (``scale``: one, ``[BR, 1]`` or ``[1, BC]``)."""
    _cast_scaled(q_ptr, x, scale, _reciprocal(scale), offs_r, offs_c, R, C_out, stride_qr, stride_qc, FP8_MAX, MANT,
                 MIN_EXP)


@triton.jit
def _cast_scaled(q_ptr, x, scale, recip, offs_r, offs_c, R, C_out, stride_qr, stride_qc,
                 FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Store ``x / scale`` (``recip``: ``_reciprocal(scale)``) cast to float8 (``_to_fp8``)."""
    q = _to_fp8(q_ptr, x, scale, recip, FP8_MAX, MANT, MIN_EXP)
    mask = (offs_r < R)[:, None] & (offs_c < C_out)[None, :]
    tl.store(q_ptr + offs_r.to(tl.int64)[:, None] * stride_qr + offs_c.to(tl.int64)[None, :] * stride_qc, q,
             mask=mask)


@triton.jit
def _to_fp8(q_ptr, x, scale, recip, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x / scale`` (``recip``: ``_reciprocal(scale)``) in ``q_ptr``'s float8 type, rounded to nearest even.
    On a GPU the quotient comes from the reciprocal and two FMA corrections, each exact in its remainder,
    which give the correctly rounded quotient (Markstein's theorem; the form of CUDA's own ``div.rn``
    fast path, here without its per-element reciprocal and range check: ``|x| <= amax``, so the
    quotient stays within the format's range and its remainder far from float32's underflow wherever
    it could round to a nonzero float8); the conversion saturates at the format's largest finite
    value, as the clamp does. The quotient is written in PTX (``_QUOTIENT``), so that no product that
    made ``x`` is fused into the remainder's FMA, and takes ``x``'s sign (-0 stays -0, as torch's
    division keeps it)."""
    if ROUND_IN_ARITHMETIC:
        y = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        q = _to_fp8_grid(y, MANT, MIN_EXP).to(q_ptr.dtype.element_ty)
    else:
        y = tl.inline_asm_elementwise(_QUOTIENT, "=f,f,f,f", [x, -scale, recip], dtype=tl.float32, is_pure=True,
                                      pack=1)
        q = y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return q


@triton.jit
def amax_kernel(x_ptr, in_scale_ptr, amax_ptr, R, C, stride_xb, stride_xr, stride_xc, stride_ir, stride_ic,
                BR: tl.constexpr, BC: tl.constexpr, DEQUANT: tl.constexpr, IN_GR: tl.constexpr,
                IN_GC: tl.constexpr, PER_ROW: tl.constexpr = False, IN_ALONG: tl.constexpr = "each"):
    """``amax_ptr[0] = max(amax_ptr[0], max |X|)`` over this program's ``BR x BC`` tile, or with
    ``PER_ROW`` ``amax_ptr[b * R + r] = max(amax_ptr[b * R + r], max |X[b, r, :]|)`` for each of its rows
    (``amax_ptr`` starts at zero; ``b``: the matrix, the grid's third dimension)."""
    pid_b = tl.program_id(2).to(tl.int64)
    x_ptr += pid_b * stride_xb
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    x = _load(x_ptr, in_scale_ptr, offs_r, offs_c, tl.program_id(0) * BR, tl.program_id(1) * BC, R, C,
              stride_xr, stride_xc, stride_ir, stride_ic, DEQUANT, IN_GR, IN_GC, IN_ALONG)
    if PER_ROW:
        tl.atomic_max(amax_ptr + pid_b * R + offs_r, tl.max(tl.abs(x), axis=1), mask=offs_r < R)
    else:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def quantize_kernel(x_ptr, in_scale_ptr, q_ptr, scale_ptr, tensor_ptr, twin_ptr, twin_scale_ptr, R, C, C_out,
                    stride_xb, stride_qb, stride_sb, stride_xr, stride_xc, stride_ir, stride_ic, stride_qr, stride_qc,
                    stride_sr, stride_sc, GROUP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, POW2: tl.constexpr,
                    DEQUANT: tl.constexpr, IN_GR: tl.constexpr, IN_GC: tl.constexpr, SCALE_GIVEN: tl.constexpr,
                    IN_ALONG: tl.constexpr = "each", TWIN: tl.constexpr = False):
    """``Q [R, C_out]`` and the scales of ``X [R, C]``'s groups (module docstring). The grid: row
    blocks of ``BR`` by column blocks of ``BC`` (one column block for ``"row"``, which walks all) by
    matrices. ``tensor_ptr``: ``"tensor"``'s amax, or its scale with ``SCALE_GIVEN`` (then no scale is
    written); ``"row_amax"``'s amax per row (``[B * R]``). ``TWIN`` (one matrix, ``C_out == C``): also the
    cast of ``X.T`` from the same tile, into ``twin_ptr`` (contiguous) with its scales in
    ``twin_scale_ptr`` (contiguous): ``"128x128"``, ``[C, R]`` and ``[C / 128, R / 128]``, the same
    blocks, so the same values and scales transposed; ``"1x128"`` (``BR`` = 128), its own 1 x 128
    blocks along X's columns, ``[C, R_pad]`` and ``[C, R_pad / 128]``, ``R_pad`` the rows of the grid's
    tiles (zeros past ``R``)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    x_ptr += pid_b * stride_xb
    q_ptr += pid_b * stride_qb
    scale_ptr += pid_b * stride_sb
    offs_r = pid_r * BR + tl.arange(0, BR)
    if GROUP == "row":
        amax = tl.zeros((BR,), dtype=tl.float32)
        for c in range(0, C, BC):
            x = _load(x_ptr, in_scale_ptr, offs_r, c + tl.arange(0, BC), pid_r * BR, c, R, C, stride_xr, stride_xc,
                      stride_ir, stride_ic, DEQUANT, IN_GR, IN_GC, IN_ALONG)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = _scale_of(amax, FP8_MAX, POW2)
        for c in range(0, C_out, BC):
            offs_c = c + tl.arange(0, BC)
            x = _load(x_ptr, in_scale_ptr, offs_r, offs_c, pid_r * BR, c, R, C, stride_xr, stride_xc, stride_ir,
                      stride_ic, DEQUANT, IN_GR, IN_GC, IN_ALONG)
            _cast_store(q_ptr, x, scale[:, None], offs_r, offs_c, R, C_out, stride_qr, stride_qc,
                        FP8_MAX, MANT, MIN_EXP)
        tl.store(scale_ptr + offs_r * stride_sr, scale, mask=offs_r < R)
    else:
        offs_c = pid_c * BC + tl.arange(0, BC)
        x = _load(x_ptr, in_scale_ptr, offs_r, offs_c, pid_r * BR, pid_c * BC, R, C, stride_xr, stride_xc,
                  stride_ir, stride_ic, DEQUANT, IN_GR, IN_GC, IN_ALONG)
        if GROUP == "tensor":
            if SCALE_GIVEN:
                scale = tl.load(tensor_ptr)
            else:
                scale = _scale_of(tl.load(tensor_ptr), FP8_MAX, POW2)
            _cast_store(q_ptr, x, scale, offs_r, offs_c, R, C_out, stride_qr, stride_qc, FP8_MAX, MANT, MIN_EXP)
            if not SCALE_GIVEN:
                if (pid_r == 0) & (pid_c == 0) & (pid_b == 0):
                    tl.store(scale_ptr, scale)
        elif GROUP == "row_amax":
            amax = tl.load(tensor_ptr + pid_b * R + offs_r, mask=offs_r < R, other=0.0)
            scale = _scale_of(amax, FP8_MAX, POW2)
            _cast_store(q_ptr, x, scale[:, None], offs_r, offs_c, R, C_out, stride_qr, stride_qc,
                        FP8_MAX, MANT, MIN_EXP)
            if pid_c == 0:
                tl.store(scale_ptr + offs_r * stride_sr, scale, mask=offs_r < R)
        elif GROUP == "1x128":  # BC == 128: a block per row of the tile
            scale = _scale_of(tl.max(tl.abs(x), axis=1), FP8_MAX, POW2)
            _cast_store(q_ptr, x, scale[:, None], offs_r, offs_c, R, C_out, stride_qr, stride_qc,
                        FP8_MAX, MANT, MIN_EXP)
            tl.store(scale_ptr + offs_r * stride_sr + pid_c * stride_sc, scale, mask=offs_r < R)
            if TWIN:  # BR == 128 too: each column of the tile is a 1 x 128 block of X.T (zeros past R)
                col_scale = _scale_of(tl.max(tl.abs(x), axis=0), FP8_MAX, POW2)
                qt = _to_fp8(q_ptr, x, col_scale[None, :], _reciprocal(col_scale)[None, :], FP8_MAX, MANT, MIN_EXP)
                rows_out = tl.num_programs(0) * BR
                tl.store(twin_ptr + offs_c.to(tl.int64)[None, :] * rows_out + offs_r[:, None], qt,
                         mask=(offs_c < C)[None, :] & (offs_r < rows_out)[:, None])
                tl.store(twin_scale_ptr + offs_c * tl.num_programs(0) + pid_r, col_scale, mask=offs_c < C)
        else:  # "128x128": BR == BC == 128, one block
            scale = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FP8_MAX, POW2)
            _cast_store(q_ptr, x, scale, offs_r, offs_c, R, C_out, stride_qr, stride_qc, FP8_MAX, MANT, MIN_EXP)
            if TWIN:  # the block read back (from cache) and stored transposed: cast again in the layout of
                # the second store, as the compiler would do with the values in registers, the quotient
                # would cost twice
                mask = (offs_r < R)[:, None] & (offs_c < C_out)[None, :]
                r64 = offs_r.to(tl.int64)[:, None]
                c64 = offs_c.to(tl.int64)[None, :]
                tl.debug_barrier()
                back = tl.load(q_ptr + r64 * stride_qr + c64 * stride_qc, mask=mask)
                tl.store(twin_ptr + c64 * R + r64, back, mask=mask)
                tl.store(twin_scale_ptr + pid_c * tl.num_programs(0) + pid_r, scale)
            tl.store(scale_ptr + pid_r * stride_sr + pid_c * stride_sc, scale)


@triton.jit
def _group_of_block(padded_ptr, G, b):
    """The group g whose blocks hold block b: the last g with ``padded[g] // 128 + g <= b`` (the first
    block of each group), by bisection over ``[0, G)``."""
    lo = 0
    hi = G
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at_or_before = tl.load(padded_ptr + mid) // 128 + mid <= b
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid)
    return lo


@triton.jit
def _segment_block(x_ptr, rows_ptr, in_scale_ptr, offsets_ptr, q_ptr, scale_ptr, amax_ptr, g, b, lo, end, first,
                   offs_c, mask_c, E, C, stride_xr, stride_xc, stride_ir, stride_ic, stride_qc, stride_sg, stride_sc,
                   GROUP: tl.constexpr, AMAX: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                   MIN_EXP: tl.constexpr, POW2: tl.constexpr, DEQUANT: tl.constexpr, IN_GR: tl.constexpr,
                   IN_GC: tl.constexpr, GATHER: tl.constexpr, SCALE_GIVEN: tl.constexpr):
    """Block b of ``quantize_segments_kernel``: padded rows ``[lo, end)`` of group g (its first at ``first``)."""
    offs_p = lo + tl.arange(0, 128)
    plan = tl.load(offsets_ptr + g) + offs_p - first  # the plan row of each padded row
    mask_p = plan < tl.load(offsets_ptr + g + 1)
    if GATHER:
        src = tl.load(rows_ptr + plan, mask=mask_p, other=0).to(tl.int64)
    else:
        src = plan.to(tl.int64)
    x = _load_rows(x_ptr, in_scale_ptr, src, offs_c, mask_p[:, None] & mask_c[None, :], stride_xr, stride_xc,
                   stride_ir, stride_ic, DEQUANT, IN_GR, IN_GC)
    expert = g % E
    if AMAX:
        if GROUP == "tensor":
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        else:
            tl.atomic_max(amax_ptr + expert * C + offs_c, tl.max(tl.abs(x), axis=0), mask=mask_c)
    else:
        if GROUP == "block":
            scale = _scale_of(tl.max(tl.abs(x), axis=0), FP8_MAX, POW2)
            tl.store(scale_ptr + b * stride_sg + offs_c * stride_sc, scale, mask=mask_c)
            scale = scale[None, :]
        elif GROUP == "expert":
            amax = tl.load(amax_ptr + expert * C + offs_c, mask=mask_c, other=0.0)
            scale = _scale_of(amax, FP8_MAX, POW2)[None, :]
        elif SCALE_GIVEN:
            scale = tl.load(amax_ptr)
        else:
            scale = _scale_of(tl.load(amax_ptr), FP8_MAX, POW2)
        # Q is [C, rows]: the tile's rows are Q's columns (unit stride), its columns Q's rows.
        _cast_store(q_ptr, x, scale, offs_p, offs_c, end, C, 1, stride_qc, FP8_MAX, MANT, MIN_EXP)


@triton.jit(do_not_specialize=["G", "E", "NB"])
def quantize_segments_kernel(x_ptr, rows_ptr, in_scale_ptr, offsets_ptr, padded_ptr, q_ptr, scale_ptr, amax_ptr,
                             G, E, NB, C, stride_xr, stride_xc, stride_ir, stride_ic, stride_qc, stride_sg, stride_sc,
                             GROUP: tl.constexpr, AMAX: tl.constexpr, BC: tl.constexpr, FP8_MAX: tl.constexpr,
                             MANT: tl.constexpr, MIN_EXP: tl.constexpr, POW2: tl.constexpr, DEQUANT: tl.constexpr,
                             IN_GR: tl.constexpr, IN_GC: tl.constexpr, GATHER: tl.constexpr,
                             SCALE_GIVEN: tl.constexpr):
    """The operand of a grouped weight gradient: the plan rows of group g (``offsets[g] + i``, reading
    ``X[rows[offsets[g] + i]]`` with ``GATHER``) quantized and written K-major, ``Q[c, padded[g] + i]``,
    zeros up to ``padded[g + 1]``. Program ``(b, c block)`` with ``b < NB`` takes block b of 128 padded
    rows, block j of group g being ``b = padded[g] // 128 + g + j`` (``tileweave.kernels.grouped_wgrad``;
    a b past its group's rows has none). ``GROUP``: ``"tensor"`` (one scale), ``"expert"`` (per expert
    ``g % E`` and column), ``"block"`` (per block and column: 128 x 1 tiles, stored at row b of the
    table). ``AMAX``: the first pass of ``"tensor"`` and ``"expert"``, an atomic max into ``amax_ptr``
    (one float32, or ``[E, C]``, zero at first); the cast pass then reads it, and its programs past NB
    write the scales (expert ``b - NB``'s row, or the tensor's: an expert without rows gets the scale of
    zeros). With ``SCALE_GIVEN``, ``amax_ptr`` holds the tensor's scale."""
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    if b < NB:
        g = _group_of_block(padded_ptr, G, b)
        first = tl.load(padded_ptr + g)
        lo = first + (b - first // 128 - g) * 128
        end = tl.minimum(lo + 128, tl.load(padded_ptr + g + 1))  # padded rows of the block: [lo, end)
        if lo < end:
            _segment_block(x_ptr, rows_ptr, in_scale_ptr, offsets_ptr, q_ptr, scale_ptr, amax_ptr, g, b, lo, end,
                           first, offs_c, mask_c, E, C, stride_xr, stride_xc, stride_ir, stride_ic, stride_qc,
                           stride_sg, stride_sc, GROUP, AMAX, FP8_MAX, MANT, MIN_EXP, POW2, DEQUANT, IN_GR, IN_GC,
                           GATHER, SCALE_GIVEN)
        elif GROUP == "block" and not AMAX:  # a block past its group's rows: the scale of zeros
            tl.store(scale_ptr + b * stride_sg + offs_c * stride_sc, _scale_of(tl.zeros((BC,), tl.float32), FP8_MAX,
                     POW2), mask=mask_c)
    elif GROUP == "expert":
        e = b - NB
        amax = tl.load(amax_ptr + e * C + offs_c, mask=mask_c, other=0.0)
        tl.store(scale_ptr + e * stride_sg + offs_c * stride_sc, _scale_of(amax, FP8_MAX, POW2), mask=mask_c)
    elif GROUP == "tensor":
        if tl.program_id(1) == 0:
            tl.store(scale_ptr, _scale_of(tl.load(amax_ptr), FP8_MAX, POW2))
