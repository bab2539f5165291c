"""The RMSNorm's backward (``tileweave.kernels.rms_norm``): the gradients of the input and the weight of
``y = x * rstd * weight`` from the forward's per-row ``rstd``, in one pass over the rows and a small
reduction over programs."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.rms_norm import rms_norm_dweight_kernel, rms_norm_grad_kernel
from tileweave.ops import common

PROGRAMS = 256
"""The fewest programs a launch aims for on GPUs: about two per SM of a 132-SM H100 or H200, so that
enough loads are in flight to keep the memory busy."""
MAX_ROWS = 16
"""The most rows a program owns. The partial weight gradient (``H`` float32 per program, written once and
read once) is ``2 / BR`` the size of one 16-bit input, an eighth at 16 rows; more rows would shrink it
little and narrow each row's contiguous load below ``TILE / 16 = 128`` columns."""
TILE = 2048
"""Elements of a program's ``[BR, BC]`` tile on GPUs: 16 float32 per thread per tensor at four warps, so
that ``dy``, ``g``, ``xhat`` and ``dx`` of a tile stay in registers with room for several programs on an
SM (the 512 programs of 8192 rows, about four per SM, run at once)."""
REDUCE_TILES = (32, 64, 4)
"""``(BP, BC, num_warps)`` of the reduction over programs on GPUs: 64 columns per program (256 programs
at ``H = 16384``), 32 partial rows per step."""
INTERPRETER_TILES = ((16, 64, 4), (16, 64, 4))
"""The norm's ``(BR, BC, num_warps)`` and the reduction's ``(BP, BC, num_warps)`` in Triton's interpreter
(the CPU tests), whose cost is per program: not many, yet small enough that the tests' small inputs
span several programs and column blocks."""


def choose_tiles(rows: int, cols: int) -> tuple[int, int, int]:
    """``(BR, BC, num_warps)`` of the norm's launch on GPUs for ``x [rows, cols]``: the most rows per
    program (a power of two, at most ``MAX_ROWS``) that still leaves ``PROGRAMS`` programs, and columns
    to fill a ``TILE`` (no more than ``cols`` rounded up to a power of two).

    Worked example: ``rows = 8192, cols = 16384`` gives ``BR = 16`` (512 programs, about four per SM),
    ``BC = 128``, four warps, and a partial weight gradient of 512 x 16384 float32 (32 MiB, against
    256 MiB for each bfloat16 input); ``rows = 1000`` at the same width gives ``BR = 2`` (500 programs)
    and ``BC = 1024``."""
    br = 1
    while br < MAX_ROWS and triton.cdiv(rows, 2 * br) >= PROGRAMS:
        br *= 2
    bc = min(TILE // br, triton.next_power_of_2(max(cols, 1)))
    return br, bc, min(4, max(1, br * bc // 512))


def rms_norm_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, *,
                  tiles: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)`` of ``y = x * rstd[:, None] * weight`` for the gradient ``dy`` of ``y``:

    ======== ========= =================================================================
    ``dy``   ``[M, H]`` float16, bfloat16 or float32; unit column stride, any row stride
    ``x``    ``[M, H]`` the norm's input: as ``dy`` (the dtypes may differ), same device
    weight   ``[H]``    float16, bfloat16 or float32, contiguous; or None (no weight)
    ``rstd`` ``[M]``    float32, contiguous: ``1 / sqrt(mean(x * x) + eps)`` of each row, as the
                        forward wrote it (``rms_norm_quantize``)
    ``dx``   ``[M, H]`` in ``x``'s dtype, contiguous
    dweight  ``[H]``    in the weight's dtype; None without a weight
    ======== ========= =================================================================

    With ``g = dy * weight`` (``dy`` without one) and ``xhat = x * rstd``:
    ``dx = rstd * (g - xhat * mean(g * xhat))`` per row, ``dweight = sum(dy * xhat)`` over the rows, all
    in float32 (the exact gradient of the norm, ``eps`` included, for the ``rstd`` given). ``dweight`` is
    the same, bit for bit, on every call with the same inputs on the same GPU: the sum over rows is
    split and added in a fixed order, without atomics. ``tiles``: the norm's ``(BR, BC, num_warps)``, powers
    of two (that order depends on ``BR``); by default ``choose_tiles(M, H)`` on GPUs, and
    ``INTERPRETER_TILES``' in Triton's interpreter.

    Two launches on the current stream (one without a weight), no host synchronisation; a float32
    ``[programs, H]`` buffer of partial sums lives until the second has run. On the CPU this runs in
    Triton's interpreter (bfloat16 read and written through float32).

    Errors, raised before any launch, name the argument: not a tensor, a wrong shape, dtype or device, a
    non-unit column stride, ``rstd`` not float32 ``[M]``, ``tiles`` not three powers of two.
    """
    _check(dy, x, weight, rstd)
    if tiles is not None and (not isinstance(tiles, tuple) or len(tiles) != 3
                              or not all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in tiles)):
        raise ValueError(f"rms_norm_grad: tiles must be (BR, BC, num_warps), three powers of two, got {tiles!r}")
    rows, cols = x.shape
    dx = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    dweight = None
    if weight is not None:
        dweight = torch.empty(cols, dtype=weight.dtype, device=x.device) if rows else \
            torch.zeros(cols, dtype=weight.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return dx, dweight
    interp = common.interpreting()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError("rms_norm_grad on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    chosen, (bp, bc_reduce, warps_reduce) = INTERPRETER_TILES if interp else (choose_tiles(rows, cols),
                                                                              REDUCE_TILES)
    br, bc, warps = chosen if tiles is None else tiles
    # the interpreter's bfloat16 loads and stores are wrong: bfloat16 goes through float32 there
    dy_in, x_in, w_in = (_readable(t, interp) for t in (dy, x, weight))
    dx_out, dw_out = _writable(dx, interp), _writable(dweight, interp)
    programs = triton.cdiv(rows, br)
    partial = None if weight is None else torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        rms_norm_grad_kernel[(programs,)](
            dy_in, x_in, x_in if w_in is None else w_in, rstd, dx_out, dx_out if partial is None else partial,
            rows, cols, dy_in.stride(0), x_in.stride(0), dx_out.stride(0),
            BR=br, BC=bc, HAS_WEIGHT=weight is not None, num_warps=warps)
        if partial is not None:
            rms_norm_dweight_kernel[(triton.cdiv(cols, bc_reduce),)](
                partial, dw_out, programs, cols, BP=bp, BC=bc_reduce, num_warps=warps_reduce)
    for out, written in ((dx, dx_out), (dweight, dw_out)):
        if out is not None and written is not out:
            out.copy_(written)
    return dx, dweight


def _check(dy, x, weight, rstd) -> None:
    common.check_matrix("rms_norm_grad: x", x)
    common.check_matrix("rms_norm_grad: dy", dy, device=x.device)
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm_grad: dy must have x's shape {list(x.shape)} (the gradient of the norm's "
                         f"output), got {list(dy.shape)}")
    rows, cols = x.shape
    for name, t in (("dy", dy), ("x", x)):
        if cols > 1 and t.stride(1) != 1:
            raise ValueError(f"rms_norm_grad: {name} must have unit stride along its last dimension, got "
                             f"strides {t.stride()}; pass {name}.contiguous()")
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dtype not in common.SUPPORTED_DTYPES
                               or weight.device != x.device or tuple(weight.shape) != (cols,)
                               or (cols > 1 and weight.stride(0) != 1)):
        raise ValueError(f"rms_norm_grad: weight must be None or a contiguous float16, bfloat16 or float32 "
                         f"tensor of shape ({cols},) on {x.device}, got {common.describe(weight)}")
    if not isinstance(rstd, torch.Tensor) or rstd.dtype != torch.float32 or rstd.device != x.device \
            or tuple(rstd.shape) != (rows,) or (rows > 1 and rstd.stride(0) != 1):
        raise ValueError(f"rms_norm_grad: rstd must be a contiguous float32 tensor of shape ({rows},) on "
                         f"{x.device} (one per row of x, as the forward's norm wrote it), got "
                         f"{common.describe(rstd)}")


def _readable(t: torch.Tensor | None, interp: bool) -> torch.Tensor | None:
    return t.float() if interp and t is not None and t.dtype == torch.bfloat16 else t


def _writable(t: torch.Tensor | None, interp: bool) -> torch.Tensor | None:
    return torch.empty(t.shape) if interp and t is not None and t.dtype == torch.bfloat16 else t
