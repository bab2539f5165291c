"""The RMSNorm's backward (``tileweave.kernels.rms_norm``): the gradients of the input and the weight of
``y = x * rstd * weight`` from the forward's per-row ``rstd``, in one pass over the rows and a small
reduction over programs. Rows of up to ``ROW_COLS`` columns are held whole in registers and read once
(``rms_norm_grad_rows_kernel``); wider rows are walked twice (``rms_norm_grad_kernel``)."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.rms_norm import rms_norm_dweight_kernel, rms_norm_grad_kernel, rms_norm_grad_rows_kernel
from tileweave.ops import common

ROW_COLS = 16384
"""The widest rows read once, held whole in registers (``rms_norm_grad_rows_kernel``), by default. A
program holds ``g``, ``xhat`` and its partial weight gradient, each ``BR * BH`` float32 over its threads:
32 of each per thread at 16384 columns, one row and 16 warps, which ptxas fits in the 128 registers that
16 warps leave each thread of an SM's 65536, without spills. Wider rows would need more warps, and 32 warps
leave only 64 registers a thread: they are walked twice instead (``rms_norm_grad_kernel``)."""
ROW_TILE = 8192
"""Elements (``BR * BH``) of a whole-row program on GPUs, at ``ROW_TILE / 1024`` warps: 32 float32 per
thread per tensor, within 128 registers, so that two programs of 8 warps share an SM; rows of more than
``ROW_TILE`` columns take one row and up to 16 warps, one program per SM."""
ROW_MAX_ROWS = 4
"""The most rows a whole-row program holds on GPUs: narrow rows fill a ``ROW_TILE`` with up to four. At
eight rows of 1024 columns and 8 warps (still 32 float32 per thread per tensor) ptxas spills registers; at
four rows and 4 warps it keeps all in 96."""
ROW_PROGRAMS = 264
"""Programs of the whole-row kernel on GPUs for tiles of at most ``ROW_TILE`` elements: the two per SM of a
132-SM H100 or H200 that run at once, each persistent over a share of the row blocks; proportionally
fewer for larger tiles (132 at 16384 columns, one per SM). Never more than the row blocks."""
PROGRAMS = 256
"""The fewest programs a two-walk launch aims for on GPUs: about two per SM of a 132-SM H100 or H200, so that
enough loads are in flight to keep the memory busy."""
MAX_ROWS = 16
"""The most rows a two-walk program owns. The partial weight gradient (``H`` float32 per program, written once and
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
"""The two-walk norm's ``(BR, BC, num_warps)`` and the reduction's ``(BP, BC, num_warps)`` in Triton's
interpreter (the CPU tests), whose cost is per program: not many, yet small enough that the tests' small
inputs span several programs and column blocks."""
INTERPRETER_ROWS = 8
"""``BR`` of the whole-row kernel in Triton's interpreter (``BH`` is ``H`` rounded up to a power of two):
few row blocks, since each costs the interpreter a pass of the loop, yet more of them than
``INTERPRETER_ROW_PROGRAMS`` in the tests' inputs of a few dozen rows."""
INTERPRETER_ROW_PROGRAMS = 4
"""Programs of the whole-row kernel in Triton's interpreter: few, each taking several row blocks."""


def choose_tiles(rows: int, cols: int) -> tuple[int, int, int]:
    """``(BR, BC, num_warps)`` of the norm's launch on GPUs for ``x [rows, cols]``.

    Rows of at most ``ROW_COLS`` columns are read once: ``BC`` is ``cols`` rounded up to a power of two
    (whole rows), ``BR`` fills a ``ROW_TILE`` (at most ``ROW_MAX_ROWS``, halved while that leaves fewer
    row blocks than ``ROW_PROGRAMS``), at ``BR * BC / 1024`` warps (1 to 16): 32 float32 per thread per
    tensor. Worked example: ``rows = 8192`` and ``cols = 8192`` (or 5120, 7168) give ``(1, 8192, 8)``,
    264 programs of 31 or 32 rows each and a partial weight gradient of 264 x 8192 float32 (8.3 MiB,
    against 128 MiB for each bfloat16 input);
    ``cols = 2048`` gives ``(4, 2048, 8)``, ``cols = 1024`` gives ``(4, 1024, 4)``; ``cols = 16384`` gives
    ``(1, 16384, 16)`` and 132 programs.

    Wider rows are walked twice: the most rows per program (a power of two, at most ``MAX_ROWS``) that
    still leaves ``PROGRAMS`` programs, and columns to fill a ``TILE``. Worked example: ``rows = 8192,
    cols = 32768`` gives ``BR = 16`` (512 programs, about four per SM), ``BC = 128`` and four warps;
    ``rows = 1000`` at the same width gives ``BR = 2`` (500 programs) and ``BC = 1024``."""
    if cols <= ROW_COLS:
        bh = triton.next_power_of_2(max(cols, 1))
        br = max(1, min(ROW_MAX_ROWS, ROW_TILE // bh))
        while br > 1 and triton.cdiv(rows, br) < ROW_PROGRAMS:
            br //= 2
        return br, bh, min(16, max(1, br * bh // 1024))
    br = 1
    while br < MAX_ROWS and triton.cdiv(rows, 2 * br) >= PROGRAMS:
        br *= 2
    bc = min(TILE // br, triton.next_power_of_2(max(cols, 1)))
    return br, bc, min(4, max(1, br * bc // 512))


def row_programs(rows: int, br: int, bh: int, *, interpreter: bool = False) -> int:
    """Programs of the whole-row kernel for ``rows`` rows in blocks of ``br`` rows of ``bh`` columns:
    ``ROW_PROGRAMS`` for tiles of at most ``ROW_TILE`` elements, proportionally fewer for larger ones
    (at least one), ``INTERPRETER_ROW_PROGRAMS`` in Triton's interpreter; never more than the row blocks.
    A function of its arguments alone, so that the order of the weight gradient's sums is too."""
    most = INTERPRETER_ROW_PROGRAMS if interpreter else max(1, ROW_PROGRAMS * ROW_TILE // max(ROW_TILE, br * bh))
    return min(most, triton.cdiv(rows, br))


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
    in float32 (the exact gradient of the norm, ``eps`` included, for the ``rstd`` given).

    ``tiles``: the norm's ``(BR, BC, num_warps)``, powers of two with ``num_warps`` at most 32 and
    ``BR * BC`` at most ``2**20`` (Triton's largest block). With ``BC >= H`` a program holds ``BR`` whole
    rows and ``dy`` and ``x`` are read once (``rms_norm_grad_rows_kernel``, ``row_programs(M, BR, BC)``
    persistent programs, each taking every ``programs``-th block of ``BR`` rows); with ``BC < H`` a
    program owns ``BR`` rows and walks them ``BC`` columns at a time twice (``rms_norm_grad_kernel``, one
    program per ``BR`` rows). By default ``choose_tiles(M, H)`` on GPUs, which reads rows of up to
    ``ROW_COLS`` columns once; in Triton's interpreter ``(INTERPRETER_ROWS, BH, 4)`` for those (``BH``:
    ``H`` rounded up to a power of two) and ``INTERPRETER_TILES[0]`` for wider rows.

    ``dweight`` is the same, bit for bit, on every call with the same inputs and tiles on the same GPU,
    without atomics: each program adds its rows' ``dy * xhat`` in the order of its row blocks into its
    own float32 row of partial sums, and a second kernel adds those rows in program order. The number of
    programs, and so that order, depends only on ``M``, the tiles and whether Triton's interpreter runs.

    Two launches on the current stream (one without a weight), no host synchronisation; a float32
    ``[programs, H]`` buffer of partial sums lives until the second has run. On the CPU this runs in
    Triton's interpreter (bfloat16 read and written through float32).

    Errors, raised before any launch, name the argument: not a tensor, a wrong shape, dtype or device, a
    non-unit column stride, ``rstd`` not float32 ``[M]``, ``tiles`` not three powers of two, more than 32
    warps or more than ``2**20`` elements.
    """
    _check(dy, x, weight, rstd)
    _check_tiles(tiles)
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
    if tiles is not None:
        br, bc, warps = tiles
    elif not interp:
        br, bc, warps = choose_tiles(rows, cols)
    elif cols <= ROW_COLS:
        br, bc, warps = INTERPRETER_ROWS, triton.next_power_of_2(cols), 4
    else:
        br, bc, warps = INTERPRETER_TILES[0]
    bp, bc_reduce, warps_reduce = INTERPRETER_TILES[1] if interp else REDUCE_TILES
    whole_rows = bc >= cols
    # the interpreter's bfloat16 loads and stores are wrong: bfloat16 goes through float32 there
    dy_in, x_in, w_in = (_readable(t, interp) for t in (dy, x, weight))
    dx_out, dw_out = _writable(dx, interp), _writable(dweight, interp)
    programs = row_programs(rows, br, bc, interpreter=interp) if whole_rows else triton.cdiv(rows, br)
    partial = None if weight is None else torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    kernel, block = (rms_norm_grad_rows_kernel, {"BH": bc}) if whole_rows else (rms_norm_grad_kernel, {"BC": bc})
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[(programs,)](
            dy_in, x_in, x_in if w_in is None else w_in, rstd, dx_out, dx_out if partial is None else partial,
            rows, cols, dy_in.stride(0), x_in.stride(0), dx_out.stride(0),
            BR=br, **block, HAS_WEIGHT=weight is not None, num_warps=warps)
        if partial is not None:
            rms_norm_dweight_kernel[(triton.cdiv(cols, bc_reduce),)](
                partial, dw_out, programs, cols, BP=bp, BC=bc_reduce, num_warps=warps_reduce)
    for out, written in ((dx, dx_out), (dweight, dw_out)):
        if out is not None and written is not out:
            out.copy_(written)
    return dx, dweight


def _check_tiles(tiles) -> None:
    if tiles is None:
        return
    if not isinstance(tiles, tuple) or len(tiles) != 3 \
            or not all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in tiles):
        raise ValueError(f"rms_norm_grad: tiles must be (BR, BC, num_warps), three powers of two, got {tiles!r}")
    br, bc, warps = tiles
    if warps > 32 or br * bc > 2**20:
        raise ValueError(f"rms_norm_grad: tiles must have num_warps <= 32 and BR * BC <= 2**20 (Triton's largest "
                         f"block), got {tiles!r}; pass smaller tiles")


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
