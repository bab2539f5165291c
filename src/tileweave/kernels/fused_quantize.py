"""Float8 quantization fused into the two kernels that produce a TP block's GEMM inputs: the RMSNorm
before the column-parallel linears and the SwiGLU before the down projection. The float8 data and
its scales are written straight from the values in registers; the values themselves are written only
when asked (``VALUES``).

The values, in float32, by a fixed formula:

* RMSNorm of a row ``x [H]``: ``rstd = 1 / sqrt(float32(sum(x * x) / H) + eps)``, the sum of squares
  accumulated in float64 (each square of a float32 is exact there), then ``y = (x * rstd) * w``;
* SwiGLU: ``h = (g * sigmoid(g)) * u`` with ``sigmoid(g) = 1 / (1 + e)`` and ``e = exp(-g)`` by a fixed
  float32 sequence (``_sigmoid``: Cody and Waite's reduction ``-g = n ln 2 + r`` and a degree-6
  polynomial for ``exp(r)``, Cephes' ``expf``), about 2 units of the last place from the exact sigmoid.

Every other step is a correctly rounded float32 operation, and the float64 sum is rounded once to
float32; the SwiGLU's kernel is compiled without contracting a product and a sum into one FMA (the
norm's float32 steps have no such pair). So the values do not depend on the tile sizes, the order of the
reduction or the GPU, and match the interpreter's bit for bit (a library ``exp`` or a float32 reduction
would not). The cast is ``quantize``'s
(``tileweave.kernels.quantize``): the same scale and the same rounding to the float8 grid, so a fused
result equals ``quantize`` of the same values bit for bit.

``GROUP`` as ``quantize``'s: ``"row"`` (a program owns ``BR`` rows and walks them: amax, then cast),
``"1x128"`` (``BC`` a multiple of 128), ``"tensor"`` (two launches: ``CAST=False`` finds the amax with an
atomic max into ``amax_ptr``, then ``CAST=True`` casts with its scale and writes it), and for the norm
``"none"`` (the values and ``rstd`` only, no cast).
"""

import triton
import triton.language as tl

from tileweave.kernels.quantize import _cast_scaled, _cast_store, _reciprocal, _scale_of


@triton.jit
def _cast_blocks(q_ptr, scale_ptr, y, offs_r, c0, R, C, stride_qr, stride_sr, stride_sc,
                 BR: tl.constexpr, BC: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                 MIN_EXP: tl.constexpr, POW2: tl.constexpr):
    """Cast the tile ``y [BR, BC]`` of columns ``c0 ..`` (``c0`` a multiple of 128) with a scale per
    1 x 128 block, and store the scales of each row's blocks that hold a column of ``[0, C)`` (the last
    one partly, when 128 does not divide ``C``: ``y`` is zero past ``C``, which changes no amax)."""
    NB: tl.constexpr = BC // 128
    offs_c = c0 + tl.arange(0, BC)
    amax = tl.max(tl.reshape(tl.abs(y), (BR, NB, 128)), axis=2)
    scale = _scale_of(amax, FP8_MAX, POW2)
    each = tl.reshape(tl.broadcast_to(scale[:, :, None], (BR, NB, 128)), (BR, BC))
    recip = tl.reshape(tl.broadcast_to(_reciprocal(scale)[:, :, None], (BR, NB, 128)), (BR, BC))
    _cast_scaled(q_ptr, y, each, recip, offs_r, offs_c, R, C, stride_qr, 1, FP8_MAX, MANT, MIN_EXP)
    blocks = c0 // 128 + tl.arange(0, NB)
    mask = (offs_r < R)[:, None] & (blocks < tl.cdiv(C, 128))[None, :]
    tl.store(scale_ptr + offs_r.to(tl.int64)[:, None] * stride_sr + blocks[None, :] * stride_sc, scale, mask=mask)


@triton.jit
def _store_values(v_ptr, y, offs_r, offs_c, R, C, stride_vr):
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    tl.store(v_ptr + offs_r.to(tl.int64)[:, None] * stride_vr + offs_c[None, :], y.to(v_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _normed(x_ptr, w_ptr, rstd, offs_r, offs_c, M, H, stride_xm, HAS_WEIGHT: tl.constexpr):
    """``(x * rstd) * w`` of the tile at ``offs_r, offs_c`` in float32 (zeros outside ``[M, H]``)."""
    mask = (offs_r < M)[:, None] & (offs_c < H)[None, :]
    x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs_c, mask=offs_c < H, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def rms_norm_quantize_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, rstd_ptr, amax_ptr, v_ptr, M, H, eps,
                             stride_xm, stride_qm, stride_sm, stride_sc, stride_vm,
                             GROUP: tl.constexpr, CAST: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                             FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, POW2: tl.constexpr,
                             HAS_WEIGHT: tl.constexpr, VALUES: tl.constexpr):
    """RMSNorm of ``BR`` rows of ``x [M, H]`` (unit column stride) by ``w [H]``, cast to ``q [M, H]`` with
    the scales of ``GROUP`` (module docstring); ``rstd [M]`` (float32) written for the backward, read back
    by the tensorwise cast (``CAST``); ``v [M, H]``: the values, with ``VALUES``."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    if CAST:  # the tensorwise cast: the rows' rstd from the amax launch
        rstd = tl.load(rstd_ptr + offs_r, mask=offs_r < M, other=0.0)
    else:
        sum_sq = tl.zeros((BR,), dtype=tl.float64)
        for c in range(0, H, BC):
            offs_c = c + tl.arange(0, BC)
            mask = (offs_r < M)[:, None] & (offs_c < H)[None, :]
            x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0)
            x = x.to(tl.float64)
            sum_sq += tl.sum(x * x, axis=1)
        mean_sq = (sum_sq / H).to(tl.float32)
        rstd = tl.math.div_rn(tl.full((BR,), 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
        tl.store(rstd_ptr + offs_r, rstd, mask=offs_r < M)
    if GROUP == "row":
        amax = tl.zeros((BR,), dtype=tl.float32)
        for c in range(0, H, BC):
            y = _normed(x_ptr, w_ptr, rstd, offs_r, c + tl.arange(0, BC), M, H, stride_xm, HAS_WEIGHT)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        scale = _scale_of(amax, FP8_MAX, POW2)
        tl.store(scale_ptr + offs_r * stride_sm, scale, mask=offs_r < M)
    elif GROUP == "tensor":
        if CAST:
            scale = _scale_of(tl.load(amax_ptr), FP8_MAX, POW2)
            if tl.program_id(0) == 0:
                tl.store(scale_ptr, scale)
        else:
            amax = tl.zeros((BR,), dtype=tl.float32)
            for c in range(0, H, BC):
                y = _normed(x_ptr, w_ptr, rstd, offs_r, c + tl.arange(0, BC), M, H, stride_xm, HAS_WEIGHT)
                amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
            tl.atomic_max(amax_ptr, tl.max(amax, axis=0))
    if (GROUP != "tensor") | CAST:
        for c in range(0, H, BC):
            offs_c = c + tl.arange(0, BC)
            y = _normed(x_ptr, w_ptr, rstd, offs_r, offs_c, M, H, stride_xm, HAS_WEIGHT)
            if GROUP == "1x128":
                _cast_blocks(q_ptr, scale_ptr, y, offs_r, c, M, H, stride_qm, stride_sm, stride_sc,
                             BR, BC, FP8_MAX, MANT, MIN_EXP, POW2)
            elif GROUP == "row":
                _cast_store(q_ptr, y, scale[:, None], offs_r, offs_c, M, H, stride_qm, 1, FP8_MAX, MANT, MIN_EXP)
            elif GROUP == "tensor":
                _cast_store(q_ptr, y, scale, offs_r, offs_c, M, H, stride_qm, 1, FP8_MAX, MANT, MIN_EXP)
            if VALUES:
                _store_values(v_ptr, y, offs_r, offs_c, M, H, stride_vm)


@triton.jit
def _sigmoid(g):
    """``1 / (1 + exp(-g))`` of float32 ``g`` by correctly rounded float32 steps in a fixed order (module
    docstring). ``t = -g`` is held to [-87, 87], where ``2**n`` and the result stay normal numbers; below
    ``g = -87`` the result is 0 (the exact one is under 1.7e-38), and a NaN ``g`` gives some number (its
    product with ``g`` is NaN)."""
    t = tl.minimum(tl.maximum(-g, -87.0), 87.0)
    t = tl.where(t == t, t, 0.0)
    n = tl.floor(t * 1.44269502 + 0.5)  # nearest to t / ln 2, |n| <= 126
    # ln 2 = 0.693359375 - 2.12194440e-4: the first has 9 significant bits, so n times it is exact.
    r = (t - n * 0.693359375) + n * 2.12194440e-4
    p = 1.9875691500e-4 * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    p = (p * (r * r) + r) + 1.0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + p * two_n)
    return tl.where(g < -87.0, 0.0, sig)


@triton.jit
def _swiglu(g_ptr, u_ptr, offs_r, offs_c, M, F, stride_gm, stride_um):
    """``(g * sigmoid(g)) * u`` of the tile at ``offs_r, offs_c`` in float32 (``_sigmoid``; zeros outside
    ``[M, F]``)."""
    mask = (offs_r < M)[:, None] & (offs_c < F)[None, :]
    r64 = offs_r.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_gm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_um + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    return (g * _sigmoid(g)) * u


@triton.jit
def swiglu_quantize_kernel(g_ptr, u_ptr, q_ptr, scale_ptr, amax_ptr, v_ptr, M, F,
                           stride_gm, stride_um, stride_qm, stride_sm, stride_sc, stride_vm,
                           GROUP: tl.constexpr, CAST: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                           FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, POW2: tl.constexpr,
                           VALUES: tl.constexpr):
    """``h = silu(g) * u`` of ``g, u [M, F]`` (unit column strides) cast to ``q [M, F]`` with the scales of
    ``GROUP`` (module docstring); ``v [M, F]``: the values, with ``VALUES``. The grid: row blocks of
    ``BR`` by column blocks of ``BC`` (one column block for ``"row"``, which walks all)."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    if GROUP == "row":
        amax = tl.zeros((BR,), dtype=tl.float32)
        for c in range(0, F, BC):
            h = _swiglu(g_ptr, u_ptr, offs_r, c + tl.arange(0, BC), M, F, stride_gm, stride_um)
            amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
        scale = _scale_of(amax, FP8_MAX, POW2)
        for c in range(0, F, BC):
            offs_c = c + tl.arange(0, BC)
            h = _swiglu(g_ptr, u_ptr, offs_r, offs_c, M, F, stride_gm, stride_um)
            _cast_store(q_ptr, h, scale[:, None], offs_r, offs_c, M, F, stride_qm, 1, FP8_MAX, MANT, MIN_EXP)
            if VALUES:
                _store_values(v_ptr, h, offs_r, offs_c, M, F, stride_vm)
        tl.store(scale_ptr + offs_r * stride_sm, scale, mask=offs_r < M)
    else:
        c0 = tl.program_id(1) * BC
        offs_c = c0 + tl.arange(0, BC)
        h = _swiglu(g_ptr, u_ptr, offs_r, offs_c, M, F, stride_gm, stride_um)
        if GROUP == "1x128":
            _cast_blocks(q_ptr, scale_ptr, h, offs_r, c0, M, F, stride_qm, stride_sm, stride_sc,
                         BR, BC, FP8_MAX, MANT, MIN_EXP, POW2)
        elif CAST:  # "tensor", the second launch
            scale = _scale_of(tl.load(amax_ptr), FP8_MAX, POW2)
            _cast_store(q_ptr, h, scale, offs_r, offs_c, M, F, stride_qm, 1, FP8_MAX, MANT, MIN_EXP)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(scale_ptr, scale)
        else:  # "tensor", the amax launch
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
        if VALUES & ((GROUP != "tensor") | CAST):
            _store_values(v_ptr, h, offs_r, offs_c, M, F, stride_vm)
