"""The backward of the RMSNorm ``y = x * rstd * w`` (``rstd [M]`` kept by the forward's fused norm, in
``fused_quantize.py``) in one pass over the rows plus a small reduction.

With ``g = dy * w`` and ``xhat = x * rstd``, all in float32:

* ``dx = rstd * (g - xhat * c)``, ``c = mean_j(g_j * xhat_j)`` per row;
* ``dw = sum_rows(dy * xhat)``.

``rms_norm_grad_kernel``: a program owns ``BR`` rows and walks their columns ``BC`` at a time twice: the
first walk finds each row's ``c``, the second writes ``dx`` and this program's partial ``dw``, the sum
over its rows, into row ``program_id`` of a float32 ``[programs, H]`` buffer; it reads ``dy`` and ``x``
twice, for rows of any width.

``rms_norm_grad_rows_kernel``: for rows that fit in registers. A program holds ``BR`` whole rows (``BH``
columns, a power of two at least ``H``), so it reads ``dy`` and ``x`` once; it is persistent, taking row
blocks ``p, p + P, p + 2P, ...`` of the ``P`` programs launched, and adds the partial ``dw`` of each in
that order into one float32 row of its own, written once at the end into row ``p`` of the same
``[programs, H]`` buffer.

``rms_norm_dweight_kernel`` then sums that buffer's rows for ``BC`` columns per program, in the same
order on every call.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(dy_ptr, x_ptr, w_ptr, rstd, offs_r, offs_c, M, H, stride_dym, stride_xm, HAS_WEIGHT: tl.constexpr):
    """``(dy, g, xhat)`` of the tile at ``offs_r, offs_c`` in float32 (zeros outside ``[M, H]``)."""
    mask = (offs_r < M)[:, None] & (offs_c < H)[None, :]
    r64 = offs_r.to(tl.int64)[:, None]
    dy = tl.load(dy_ptr + r64 * stride_dym + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r64 * stride_xm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    xhat = x * rstd[:, None]
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(w_ptr + offs_c, mask=offs_c < H, other=0.0).to(tl.float32)[None, :]
    return dy, g, xhat


@triton.jit
def rms_norm_grad_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, H,
                         stride_dym, stride_xm, stride_dxm,
                         BR: tl.constexpr, BC: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """``dx [M, H]`` (in ``dx_ptr``'s dtype) of ``BR`` rows of ``dy, x [M, H]`` (unit column strides), the
    weight ``w [H]`` (with ``HAS_WEIGHT``) and ``rstd [M]`` (float32); with ``HAS_WEIGHT`` also this
    program's row of the partial weight gradients ``part [programs, H]`` (float32, contiguous)."""
    pid = tl.program_id(0)
    offs_r = pid * BR + tl.arange(0, BR)
    rstd = tl.load(rstd_ptr + offs_r, mask=offs_r < M, other=0.0)
    dot = tl.zeros((BR,), dtype=tl.float32)
    for c0 in range(0, H, BC):
        _, g, xhat = _tile(dy_ptr, x_ptr, w_ptr, rstd, offs_r, c0 + tl.arange(0, BC), M, H, stride_dym, stride_xm,
                           HAS_WEIGHT)
        dot += tl.sum(g * xhat, axis=1)
    c = (dot / H)[:, None]
    for c0 in range(0, H, BC):
        offs_c = c0 + tl.arange(0, BC)
        dy, g, xhat = _tile(dy_ptr, x_ptr, w_ptr, rstd, offs_r, offs_c, M, H, stride_dym, stride_xm, HAS_WEIGHT)
        dx = rstd[:, None] * (g - xhat * c)
        mask = (offs_r < M)[:, None] & (offs_c < H)[None, :]
        tl.store(dx_ptr + offs_r.to(tl.int64)[:, None] * stride_dxm + offs_c[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:  # rows past M hold zeros: they add nothing
            tl.store(part_ptr + pid.to(tl.int64) * H + offs_c, tl.sum(dy * xhat, axis=0), mask=offs_c < H)


@triton.jit
def rms_norm_grad_rows_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, H,
                              stride_dym, stride_xm, stride_dxm,
                              BR: tl.constexpr, BH: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """As ``rms_norm_grad_kernel``, with whole rows (``H <= BH``) read once: ``dx [M, H]`` of the row blocks
    ``program_id, program_id + P, ...`` (``P`` programs, ``BR`` rows each) and, with ``HAS_WEIGHT``, the
    sum of their partial weight gradients, added in that order, in row ``program_id`` of ``part [P, H]``."""
    pid = tl.program_id(0)
    offs_c = tl.arange(0, BH)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for r0 in range(pid * BR, M, tl.num_programs(0) * BR):
        offs_r = r0 + tl.arange(0, BR)
        rstd = tl.load(rstd_ptr + offs_r, mask=offs_r < M, other=0.0)
        dy, g, xhat = _tile(dy_ptr, x_ptr, w_ptr, rstd, offs_r, offs_c, M, H, stride_dym, stride_xm, HAS_WEIGHT)
        # before the row sums, so that dy is not live across them; rows past M hold zeros: they add nothing
        if HAS_WEIGHT:
            acc += tl.sum(dy * xhat, axis=0)
        c = (tl.sum(g * xhat, axis=1) / H)[:, None]
        dx = rstd[:, None] * (g - xhat * c)
        mask = (offs_r < M)[:, None] & (offs_c < H)[None, :]
        tl.store(dx_ptr + offs_r.to(tl.int64)[:, None] * stride_dxm + offs_c[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(part_ptr + pid.to(tl.int64) * H + offs_c, acc, mask=offs_c < H)


@triton.jit
def rms_norm_dweight_kernel(part_ptr, dw_ptr, P, H, BP: tl.constexpr, BC: tl.constexpr):
    """``dw [H]`` (in ``dw_ptr``'s dtype): the sum over the ``P`` rows of ``part [P, H]`` (float32,
    contiguous) for ``BC`` columns, ``BP`` rows at a time, each column's partial sums added in one
    fixed order."""
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    acc = tl.zeros((BP, BC), dtype=tl.float32)
    for p0 in range(0, P, BP):
        offs_p = p0 + tl.arange(0, BP)
        mask = (offs_p < P)[:, None] & (offs_c < H)[None, :]
        acc += tl.load(part_ptr + offs_p.to(tl.int64)[:, None] * H + offs_c[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + offs_c, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=offs_c < H)
