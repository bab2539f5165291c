"""Dynamic float8 quantization of GEMM operands on the device (``tileweave.kernels.quantize``).

``quantize`` casts a matrix, or its transpose, to float8 with the scales that ``matmul``'s FP8
arguments take (``tileweave.ops.compute.scaling``): the amax of each group is found on the device
(no host sync), ``scale = max(amax, 1e-12) / fp8_max`` (448 for e4m3fn, 57344 for e5m2; optionally
rounded up to a power of two), ``q = clamp(x / scale, -fp8_max, fp8_max)`` cast to nearest even, so
that ``x ~ q * scale`` (torch's and torchao's convention).

Every operand is quantized K-major, as the tensor cores read float8: rows along the contraction. For
``matmul(a, b)``, ``a = quantize(x, ...)`` of ``x [M, K]`` is ``(a.data, a.scale)``; the other operand
is quantized as ``[N, K]`` (an ``nn.Linear`` weight as it is, anything else with ``transpose=True``),
and ``b = (q.data.t(), q.scale.t())``:

====================  ===================  =====================  ===================================
granularity           ``scale`` of [R, C]  as ``a`` (``[M, K]``)  as ``b`` (``.t()``)
====================  ===================  =====================  ===================================
``tensorwise``        one element (0-d)    tensorwise             tensorwise
``rowwise``           ``[R, 1]``           ``[M, 1]``             ``[1, N]``
``blockwise_1x128``   ``[R, C/128]``       ``[M, K/128]``         (not an operand form of ``b``)
``blockwise_128x128`` ``[ceil(R/128),      (not a form of ``a``)  ``[K/128, ceil(N/128)]``
                      C/128]``
====================  ===================  =====================  ===================================

``quantize_segments`` casts an operand of an MoE layer's weight gradient (``grouped_wgrad``), whose sum
runs over each expert's tokens: the rows of a routing plan's groups, quantized along the tokens per
tensor, per expert and column, or per 128 tokens of a group and column, written K-major with each group
padded to 16 rows.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton

from tileweave.kernels.quantize import amax_kernel, quantize_kernel, quantize_segments_kernel
from tileweave.ops import common
from tileweave.ops.compute.scaling import BLOCK, FP8_DTYPES, wgrad_blocks

GRANULARITIES = ("tensorwise", "rowwise", "blockwise_1x128", "blockwise_128x128")
"""Which elements share a scale: all, a row, 128 consecutive elements of a row, a 128 x 128 block."""
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""The largest finite value of each float8 format."""
_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
# (mantissa bits, smallest normal exponent) of each format: its grid of values
_GROUP = {"tensorwise": "tensor", "rowwise": "row", "blockwise_1x128": "1x128", "blockwise_128x128": "128x128"}
EPS = 1e-12
"""The floor of an amax (torchao's): an all-zero group gets a finite scale."""

TILES = {"tensor": (8, 1024, 8), "tensor_t": (32, 128, 4), "row": (1, 2048, 4), "row_amax": (8, 1024, 8),
         "row_amax_t": (32, 256, 8), "1x128": (32, 128, 4), "1x128_t": (64, 128, 4), "128x128": (128, 128, 4),
         "128x128_t": (128, 128, 4), "segments": (128, 32, 4)}
"""Per group kind, ``(BR, BC, num_warps)`` on GPUs; ``<kind>_t``: the input read across a transposed view
(its contiguous dimension is the tile's rows). A ``"row"`` program owns one row and walks it twice (its
amax, then the cast: the second read finds the row in cache); a row read across a transposed view takes
``"row_amax"``: an amax pass over tiles (an atomic max per row), then the cast over tiles, as do rows
whose amax is given (the cast alone, tiled as ``"tensor"``'s). Chosen on one H200 over the quantize
launches of a transformer block's training step, and ``"segments"`` (``quantize_segments``, whose BR is
its block of 128 rows) over an MoE layer's four weight-gradient operands in each scaling;
``"row_amax"`` read along its rows is not measured yet."""
INTERPRETER_TILES = {"tensor": (128, 256, 4), "row": (128, 256, 4), "row_amax": (128, 256, 4), "1x128": (128, 128, 4),
                     "128x128": (128, 128, 4), "segments": (128, 256, 4)}
"""The same in Triton's interpreter (the CPU tests), whose cost is per program: few, large ones (the
transposed kinds take their group's)."""
TWIN_TILES = (128, 128, 4)
"""``(BR, BC, num_warps)`` of a ``blockwise_1x128`` cast with its twin (``quantize``'s ``twin``): square
tiles, whose rows and columns are both 1 x 128 blocks, on GPUs and in the interpreter alike."""
SEGMENT_ALIGN = 16
"""``quantize_segments`` pads each group's rows to a multiple of this many: torch's 2d-2d scaled grouped GEMM
wants its groups so (16 bytes of float8), and ``grouped_wgrad`` loads whole 16-byte vectors of them."""


class Quantized(NamedTuple):
    """A float8 operand: ``data`` (contiguous ``[R, C]``, zero columns past the input's for ``pad``) and
    its float32 ``scale`` (the module's table), ``data * scale ~ x``."""

    data: torch.Tensor
    scale: torch.Tensor


def quantize(x: torch.Tensor, granularity: str, *, dtype: torch.dtype = torch.float8_e4m3fn,
             transpose: bool = False, pad: bool = False, power_of_two: bool = False,
             scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
             amax: torch.Tensor | None = None, twin: bool = False) -> Quantized | tuple[Quantized, Quantized]:
    """``x [R, C]`` (or ``x.T`` with ``transpose``: read through its strides, written contiguous, no
    transpose pass) cast to ``dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) with one scale
    per group of ``granularity`` (module docstring). ``x``: float16, bfloat16 or float32, any strides.
    A stack ``x [B, R, C]`` (``transpose``: each matrix transposed, ``[B, C, R]`` read as ``[B, R, C]``)
    is cast in the same launches, each matrix as one would be alone (``tensorwise``: one scale over the
    stack): ``data [B, R, C_out]``, ``scale`` the table's with ``B`` in front (``[B, R, 1]``, ``[B, R,
    C/128]``, ``[B, ceil(R/128), C/128]``; tensorwise 0-d).

    * ``pad`` (blockwise only): zero columns up to a multiple of 128 (for an operand whose contraction
      dimension is not one, such as the tokens of a weight gradient); without it the columns of a
      blockwise result must be a multiple of 128.
    * ``power_of_two``: each scale rounded up to a power of two (torchao's rowwise recipe), so that
      scaling loses no bits.
    * ``scale`` (tensorwise only): the scale to use, a one-element float32 tensor (say, the one
      computed for the same tensor in another orientation): no amax pass; it is returned as is.
    * ``amax`` (tensorwise and rowwise): ``max |x|`` already found on the device (say, raised by the
      kernel that wrote ``x``), a one-element float32 tensor, or for rowwise one per row (``R`` elements,
      ``B * R`` for a stack): no amax pass, the scales are computed from it.
    * ``x_scale``: ``x`` is float8 with these scales (``matmul``'s ``scale_a`` forms for ``x`` as
      given: one element, ``[R, 1]`` or ``[R, C/128]``; not for a stack), and ``x * x_scale`` is quantized
      again.
    * ``twin`` (blockwise, one matrix, without ``pad``): also the cast of the other orientation (``x.T``,
      or ``x`` with ``transpose``) from the same pass, returned second, bit for bit what a second call
      would give, for one read of ``x``. ``blockwise_128x128`` (both dimensions multiples of 128): the
      same blocks, so the first's float8 values and scales transposed (a weight's operand for the
      forward GEMM and for the input gradient's). ``blockwise_1x128``: ``quantize(x.T, "blockwise_1x128",
      pad=True)`` (an output gradient's operand for the input gradient and, along the tokens, for
      the weight gradient's).

    No host synchronisation: tensorwise, and rowwise of ``x.T``, are two launches (an amax, then the
    cast; one with ``amax`` or ``scale``), the others one.
    On the CPU this runs in Triton's interpreter; bfloat16 is read through float32 there.

    Errors name the argument: a granularity or dtype not listed, ``pad`` or ``scale`` with a
    granularity that takes neither, blockwise columns not a multiple of 128 without ``pad``, a float8
    ``x`` without ``x_scale`` (or ``x_scale`` with another ``x``), scales of a wrong dtype, device or shape.
    """
    group = _check(x, granularity, dtype, transpose, pad, scale, x_scale, amax, twin)
    stack = x.shape[:-2]  # (B,) for a stack of matrices
    rows, cols = (x.shape[-1], x.shape[-2]) if transpose else tuple(x.shape[-2:])
    cols_out = -(-cols // BLOCK) * BLOCK if pad else cols
    device = x.device
    data = torch.empty((*stack, rows, cols_out), dtype=dtype, device=device)
    out_scale = _new_scale(group, stack, rows, cols_out, device) if scale is None else scale
    rows_pad = -(-rows // BLOCK) * BLOCK if group == "1x128" else rows  # the twin's columns
    other = Quantized(torch.empty((cols, rows_pad), dtype=dtype, device=device),
                      _new_scale(group, (), cols, rows_pad, device)) if twin else None
    if rows == 0 or cols == 0:
        data.zero_()
        if scale is None:
            out_scale.fill_(_host_scale(0.0, dtype, power_of_two))
        return (Quantized(data, out_scale), other) if twin else Quantized(data, out_scale)
    interp = common.interpreting()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError("quantize on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if interp and x.dtype == torch.bfloat16:
        x = x.float()  # the interpreter's bfloat16 loads are wrong
    strides = x.stride()[-2:][::-1] if transpose else x.stride()[-2:]
    batch, stride_xb = (x.shape[0], x.stride(0)) if stack else (1, 0)
    in_scale, in_strides, in_groups = _input_scales(x, x_scale, transpose)
    fp8_max = FP8_MAX[dtype]
    mant, min_exp = _GRID[dtype]
    if group == "row" and (_across(*strides) or amax is not None):
        # the rows are strided columns (an amax pass over tiles, then the cast), or their amax is given
        group = "row_amax"
    br, bc, warps = tiles_of(group, *strides, interpreter=interp)
    if twin and group == "1x128":  # a tile's columns are blocks of x.T too
        br, bc, warps = TWIN_TILES
    switches = dict(DEQUANT=x_scale is not None, IN_GR=in_groups[0], IN_GC=in_groups[1],
                    IN_ALONG=_in_along(in_strides, in_groups, br, bc))
    with torch.cuda.device(device) if x.is_cuda else contextlib.nullcontext():
        tensor = scale if amax is None else amax
        if group in ("tensor", "row_amax") and tensor is None:
            tensor = torch.zeros(batch * rows if group == "row_amax" else 1, dtype=torch.float32, device=device)
            amax_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc), batch)](
                x, in_scale, tensor, rows, cols, stride_xb, *strides, *in_strides, BR=br, BC=bc, num_warps=warps,
                PER_ROW=group == "row_amax", **switches)
        grid = (triton.cdiv(rows, br), 1 if group == "row" else triton.cdiv(cols_out, bc), batch)
        scale_strides = (0, 0, 0) if out_scale.dim() == 0 else (0,) * (3 - out_scale.dim()) + out_scale.stride()
        quantize_kernel[grid](
            x, in_scale, data, out_scale, out_scale if tensor is None else tensor,
            data if other is None else other.data, out_scale if other is None else other.scale, rows, cols,
            cols_out, stride_xb, data.stride(0) if stack else 0, scale_strides[0], *strides, *in_strides,
            *data.stride()[-2:], *scale_strides[1:],
            GROUP=group, BR=br, BC=bc, FP8_MAX=fp8_max, MANT=mant, MIN_EXP=min_exp, POW2=bool(power_of_two),
            SCALE_GIVEN=scale is not None, TWIN=twin, num_warps=warps, **switches)
    return (Quantized(data, out_scale), other) if twin else Quantized(data, out_scale)


def _in_along(strides: tuple[int, int], groups: tuple[int, int], br: int, bc: int) -> str:
    """How an input's scales (``strides`` and ``groups`` per row and column, in the orientation read) vary
    over a ``br x bc`` tile that starts on a multiple of its size: ``"one"`` (a single scale), ``"row"``
    (one per row: every tile's columns lie in one group), ``"col"`` (one per column: its rows lie in one
    group), else ``"each"``."""
    (stride_r, stride_c), (group_r, group_c) = strides, groups
    if stride_r == stride_c == 0:
        return "one"
    if stride_c == 0 or group_c % bc == 0:
        return "row"
    return "col" if stride_r == 0 or group_r % br == 0 else "each"


def _across(stride_xr: int, stride_xc: int) -> bool:
    # Whether the input is read across its memory's rows (a transposed view): its rows are contiguous.
    return stride_xr == 1 and stride_xc != 1


def tiles_of(group: str, stride_xr: int, stride_xc: int, *, interpreter: bool) -> tuple[int, int, int]:
    """``(BR, BC, num_warps)`` of a launch of ``group`` over an input of strides ``(stride_xr, stride_xc)``."""
    if interpreter:
        return INTERPRETER_TILES[group]
    return TILES[f"{group}_t" if _across(stride_xr, stride_xc) else group]


def _check(x, granularity, dtype, transpose, pad, scale, x_scale, amax=None, twin=False) -> str:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"quantize: x must be 2-D, or 3-D for a stack of matrices, got shape {tuple(x.shape)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize: granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fp8_in = x.dtype in FP8_DTYPES
    if fp8_in and x_scale is None:
        raise TypeError(f"quantize: x is {x.dtype}: pass its scales as x_scale to quantize it again")
    if not fp8_in and x.dtype not in common.SUPPORTED_DTYPES:
        raise TypeError(f"quantize: x has dtype {x.dtype}; supported: float16, bfloat16, float32, or float8 with "
                        "x_scale")
    if x_scale is not None and not fp8_in:
        raise TypeError(f"quantize: x_scale applies to a float8 x; x is {x.dtype}")
    blockwise = granularity.startswith("blockwise")
    if pad and not blockwise:
        raise ValueError(f"quantize: pad applies to blockwise granularities, got {granularity!r}")
    if scale is not None:
        if granularity != "tensorwise":
            raise ValueError(f"quantize: a given scale applies to tensorwise, got granularity {granularity!r}")
        _check_scale("scale", scale, x.device, lambda s: s.numel() == 1, "one element")
    rows = x.shape[-1] if transpose else x.shape[-2]
    if amax is not None:
        if granularity not in ("tensorwise", "rowwise") or scale is not None:
            raise ValueError(f"quantize: a given amax applies to tensorwise and rowwise without a given scale, got "
                             f"granularity {granularity!r}{' and a scale' if scale is not None else ''}")
        count = 1 if granularity == "tensorwise" else rows * (x.shape[0] if x.dim() == 3 else 1)
        _check_scale("amax", amax, x.device, lambda s: s.numel() == count and s.is_contiguous(),
                     f"{count} contiguous element{'s' if count > 1 else ''}")
    if x_scale is not None:
        if x.dim() != 2:
            raise ValueError(f"quantize: x_scale applies to a 2-D x, got shape {tuple(x.shape)}")
        _check_scale("x_scale", x_scale, x.device, lambda s: True, "")
    cols = x.shape[-2] if transpose else x.shape[-1]
    if twin and (not blockwise or pad or x.dim() != 2 or (granularity == "blockwise_128x128" and rows % BLOCK)):
        raise ValueError(f"quantize: twin applies to blockwise granularities of one matrix without pad (and for "
                         f"blockwise_128x128 rows that are a multiple of {BLOCK}); got {granularity!r}, pad={pad}, "
                         f"x of shape {tuple(x.shape)}{' (transposed)' if transpose else ''}")
    if blockwise and not pad and cols % BLOCK:
        what = "rows of x (the columns of x.T)" if transpose else "columns of x"
        raise ValueError(f"quantize: {granularity} needs the {what} to be a multiple of {BLOCK}, got {cols}; "
                         "pass pad=True to pad them with zeros")
    return _GROUP[granularity]


def _check_scale(name, s, device, ok, expected: str) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != device:
        raise TypeError(f"quantize: {name} must be a float32 tensor on {device}, got {common.describe(s)}")
    if not ok(s):
        raise ValueError(f"quantize: {name} must have {expected}, got shape {list(s.shape)}")


def _new_scale(group: str, stack: tuple, rows: int, cols: int, device) -> torch.Tensor:
    shape = {"tensor": (), "row": (*stack, rows, 1), "1x128": (*stack, rows, cols // BLOCK),
             "128x128": (*stack, -(-rows // BLOCK), cols // BLOCK)}[group]
    return torch.empty(shape, dtype=torch.float32, device=device)


def _host_scale(amax: float, dtype: torch.dtype, power_of_two: bool) -> float:
    scale = torch.tensor(max(amax, EPS), dtype=torch.float32) / FP8_MAX[dtype]
    return float(torch.exp2(torch.ceil(torch.log2(scale.double())))) if power_of_two else float(scale)


def _input_scales(x: torch.Tensor, x_scale: torch.Tensor | None, transpose: bool) -> tuple:
    """``(tensor, (stride per row, per column), (rows, columns) per scale)`` of the input's scales in the
    orientation read (a dummy without them)."""
    if x_scale is None:
        return x, (0, 0), (1, 1)
    rows, cols = x.shape
    if x_scale.numel() == 1 and x_scale.dim() <= 2:
        strides, groups = (0, 0), (1, 1)
    elif x_scale.dim() == 2 and x_scale.shape[0] == rows and x_scale.shape[1] == 1:
        strides, groups = (x_scale.stride(0), 0), (1, 1)
    elif x_scale.dim() == 2 and cols % BLOCK == 0 and tuple(x_scale.shape) == (rows, cols // BLOCK):
        strides, groups = tuple(x_scale.stride()), (1, BLOCK)
    else:
        raise ValueError(f"quantize: x_scale must have one element, [R, 1] = {[rows, 1]} or [R, C/128] = "
                         f"{[rows, cols // BLOCK]} for x {list(x.shape)}, got {list(x_scale.shape)}")
    return x_scale, strides[::-1] if transpose else strides, groups[::-1] if transpose else groups


class Segments(NamedTuple):
    """A float8 operand of a grouped weight gradient (``quantize_segments``): ``data [C, P16]`` K-major, the
    rows of group g at columns ``[offsets[g], offsets[g + 1])`` (``grouped_wgrad`` takes ``data.t()``), its
    float32 ``scale`` table, and those padded ``offsets`` (int32 ``[G + 1]``, multiples of 16)."""

    data: torch.Tensor
    scale: torch.Tensor
    offsets: torch.Tensor


def pad_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """The offsets of groups padded to multiples of ``SEGMENT_ALIGN`` rows: int32 ``[G + 1]``, on the
    device (no host sync)."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    padded = torch.zeros_like(offsets)
    padded[1:] = torch.cumsum((counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN, 0)
    return padded


def quantize_segments(x: torch.Tensor, offsets: torch.Tensor, experts: int, granularity: str, *,
                      rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn,
                      power_of_two: bool = False, scale: torch.Tensor | None = None,
                      x_scale: torch.Tensor | None = None) -> Segments:
    """An operand of ``grouped_wgrad`` (an MoE layer's weight gradient), quantized along its sum's rows,
    the tokens of each expert: the plan rows ``p`` of every group ``g = s*E + e`` (``[offsets[g],
    offsets[g + 1])``), each ``x[p]``, or ``x[rows[p]]`` with ``rows``, cast to ``dtype`` and written
    K-major, each group padded with zero rows to a multiple of 16 (``Segments``). Groups of scales
    (``granularity``, named as ``quantize``'s for the written ``[C, P16]``: a row of it runs along the
    tokens):

    * ``"tensorwise"``: one scale (0-d) over every row; or ``scale``, a given one-element float32 tensor;
    * ``"rowwise"``: one per expert and column, over the expert's rows of every source (torchao's MoE
      recipe): ``scale [E, C]``, torch's ``[E * C]`` when flattened;
    * ``"blockwise_1x128"``: one per 128 rows of a group and column (DeepSeek-V3's 128 x 1 tiles along the
      tokens; a group's last block holds fewer rows, as if padded with zeros): ``scale [P16 // 128 + G, C]``,
      block j of group g at row ``offsets16[g] // 128 + g + j`` (of the padded offsets).

    ``x [R, C]``: float16, bfloat16 or float32, or float8 with ``x_scale`` (``quantize``'s forms: one
    element, ``[R, 1]``, ``[R, C/128]``), dequantized first. ``offsets`` int32 ``[S*E + 1]`` on the device
    (a plan's); ``rows`` int32/int64 ``[P]``. ``P16 = P + 15 G`` rounded up to 16 columns are allocated:
    past ``offsets16[G]`` they are not written, and nothing reads them. An expert without rows gets the
    scale of zeros (``1e-12 / fp8_max``). Scales as ``quantize``'s (``power_of_two`` too). No host
    synchronisation: one launch for blockwise, two (an amax, then the cast) for the others.
    """
    group = _check_segments(x, offsets, experts, granularity, rows, dtype, scale, x_scale)
    device = x.device
    groups = offsets.numel() - 1
    plan_rows = rows.numel() if rows is not None else x.shape[0]
    cols = x.shape[1]
    capacity = -(-(plan_rows + (SEGMENT_ALIGN - 1) * groups) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    blocks = wgrad_blocks(capacity, groups)
    padded = pad_offsets(offsets)
    data = torch.empty((cols, capacity), dtype=dtype, device=device)
    out_scale = scale
    if scale is None:
        shape = {"tensor": (), "expert": (experts, cols), "block": (blocks, cols)}[group]
        out_scale = torch.empty(shape, dtype=torch.float32, device=device)
    if plan_rows == 0 or cols == 0:
        data.zero_()
        if scale is None:
            out_scale.fill_(_host_scale(0.0, dtype, power_of_two))
        return Segments(data, out_scale, padded)
    interp = common.interpreting()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError("quantize_segments on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if interp and x.dtype == torch.bfloat16:
        x = x.float()  # the interpreter's bfloat16 loads are wrong
    in_scale, in_strides, in_groups = _input_scales(x, x_scale, False)
    br, bc, warps = INTERPRETER_TILES["segments"] if interp else TILES["segments"]
    assert br == BLOCK, "a program of quantize_segments takes one block of 128 rows"
    mant, min_exp = _GRID[dtype]
    common_args = dict(GROUP=group, BC=bc, FP8_MAX=FP8_MAX[dtype], MANT=mant, MIN_EXP=min_exp,
                       POW2=bool(power_of_two), DEQUANT=x_scale is not None, IN_GR=in_groups[0], IN_GC=in_groups[1],
                       GATHER=rows is not None, SCALE_GIVEN=scale is not None, num_warps=warps)
    amax = scale
    if group != "block" and scale is None:
        amax = torch.zeros(() if group == "tensor" else (experts, cols), dtype=torch.float32, device=device)
    writers = {"tensor": 0 if scale is not None else 1, "expert": experts, "block": 0}[group]
    scale_strides = (0, 0) if out_scale.dim() < 2 else out_scale.stride()
    args = [x, offsets if rows is None else rows, in_scale, offsets, padded, data, out_scale,
            out_scale if amax is None else amax, groups, experts, blocks, cols, *x.stride(), *in_strides,
            data.stride(0), *scale_strides]
    col_blocks = triton.cdiv(cols, bc)
    with torch.cuda.device(device) if x.is_cuda else contextlib.nullcontext():
        if group != "block" and scale is None:
            quantize_segments_kernel[(blocks, col_blocks)](*args, AMAX=True, **common_args)
        quantize_segments_kernel[(blocks + writers, col_blocks)](*args, AMAX=False, **common_args)
    return Segments(data, out_scale, padded)


_SEGMENT_GROUP = {"tensorwise": "tensor", "rowwise": "expert", "blockwise_1x128": "block"}


def _check_segments(x, offsets, experts, granularity, rows, dtype, scale, x_scale) -> str:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"quantize_segments: x must be a 2-D tensor, got {common.describe(x)}")
    if granularity not in _SEGMENT_GROUP:
        raise ValueError(f"quantize_segments: granularity must be one of {', '.join(_SEGMENT_GROUP)}, got "
                         f"{granularity!r}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"quantize_segments: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fp8_in = x.dtype in FP8_DTYPES
    if fp8_in != (x_scale is not None):
        raise TypeError(f"quantize_segments: x is {x.dtype}: " + (
            "pass its scales as x_scale to quantize it again" if fp8_in else "x_scale applies to a float8 x only"))
    if not fp8_in and x.dtype not in common.SUPPORTED_DTYPES:
        raise TypeError(f"quantize_segments: x has dtype {x.dtype}; supported: float16, bfloat16, float32, or "
                        "float8 with x_scale")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"quantize_segments: experts must be a positive int, got {experts!r}")
    common.check_index("quantize_segments: offsets", offsets, x.device, (torch.int32,))
    groups = offsets.numel() - 1
    if groups < experts or groups % experts:
        raise ValueError(f"quantize_segments: offsets must have S*E + 1 entries for E = {experts} experts, got "
                         f"{offsets.numel()}")
    if rows is not None:
        common.check_index("quantize_segments: rows", rows, x.device)
    if scale is not None:
        if granularity != "tensorwise":
            raise ValueError(f"quantize_segments: a given scale applies to tensorwise, got granularity "
                             f"{granularity!r}")
        _check_scale("scale", scale, x.device, lambda t: t.numel() == 1, "one element")
    if x_scale is not None:
        _check_scale("x_scale", x_scale, x.device, lambda t: True, "")
    return _SEGMENT_GROUP[granularity]
