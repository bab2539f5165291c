"""RMSNorm and SwiGLU with their output cast to float8 in the same kernel
(``tileweave.kernels.fused_quantize``): the first operand of the GEMM that follows each, in the forms of
``tileweave.ops.compute.quantize`` (``"tensorwise"``, ``"rowwise"``, ``"blockwise_1x128"``), equal bit for
bit to ``quantize`` of the same values, without the values ever being written in high precision.

The values are computed by a fixed formula in float32 (the kernel module's docstring: a float64 sum of
squares rounded once, a sigmoid by fixed float32 steps), so they are the same on every GPU and in
Triton's interpreter. ``rowwise`` and ``blockwise_1x128`` take one launch; ``tensorwise`` two (the amax over the
whole tensor with an atomic max, then the cast; no host synchronisation).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton

from tileweave.kernels.fused_quantize import rms_norm_quantize_kernel, swiglu_quantize_kernel
from tileweave.ops import common
from tileweave.ops.compute.quantize import _GRID, _GROUP, FP8_MAX, Quantized, _host_scale
from tileweave.ops.compute.scaling import BLOCK, FP8_DTYPES

GRANULARITIES = ("tensorwise", "rowwise", "blockwise_1x128")
"""The forms of a GEMM's first operand that the fused kernels write."""
TILES = {"norm": (1, 2048, 4), "swiglu_row": (1, 2048, 4), "swiglu": (8, 512, 4)}
"""``(BR, BC, num_warps)`` on GPUs: the norm and the rowwise SwiGLU walk one row per program (its second
and third reads find the row in cache), the other SwiGLU launches take ``BR x BC`` tiles. Chosen by
analogy with ``quantize``'s row and tile launches, not tuned."""
INTERPRETER_TILES = {"norm": (32, 256, 4), "swiglu_row": (32, 256, 4), "swiglu": (32, 256, 4)}
"""The same in Triton's interpreter (the CPU tests), whose cost is per program: few, large ones."""


class NormQuantized(NamedTuple):
    """``rms_norm_quantize``'s result: the float8 operand ``q``, the float32 ``rstd [M]`` of each row (what
    the norm's backward needs besides its input and weight), and the normalized ``values`` (None unless
    asked for)."""

    q: Quantized | None
    rstd: torch.Tensor
    values: torch.Tensor | None


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor | None, eps: float, granularity: str | None, *,
                      dtype: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False,
                      return_values: bool = False) -> NormQuantized:
    """``y = x * rstd * weight``, ``rstd = 1 / sqrt(mean(x * x) + eps)`` per row of ``x [M, H]`` (float16,
    bfloat16 or float32, unit column stride; ``weight [H]`` of any of those dtypes, or None for no
    weight), cast to ``dtype`` with one scale per group of ``granularity`` (``"tensorwise"``,
    ``"rowwise"``, ``"blockwise_1x128"`` as ``quantize``; None: no cast, with ``return_values``).
    ``power_of_two``: scales rounded up to powers of two. ``return_values``: also ``y`` in ``x``'s dtype.

    Errors name the argument: a granularity or dtype not listed, ``x`` or ``weight`` of a wrong shape,
    dtype or device, blockwise with ``H`` not a multiple of 128."""
    _check_x("rms_norm_quantize", "x", x)
    rows, cols = x.shape
    if weight is not None:
        _check_vector("rms_norm_quantize", "weight", weight, cols, x.device)
    group = _check_form("rms_norm_quantize", granularity, dtype, cols, return_values)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    data, scale, values = _outputs(group, rows, cols, dtype, x, return_values)
    if rows and cols:
        interp = _interpreter("rms_norm_quantize", x)
        x_in, w_in, v_out = _readable(x, interp), _readable(weight, interp), _writable(values, interp)
        br, bc, warps = (INTERPRETER_TILES if interp else TILES)["norm"]
        fp8_max, (mant, min_exp) = FP8_MAX[dtype], _GRID[dtype]
        amax = torch.zeros(1, dtype=torch.float32, device=x.device) if group == "tensor" else rstd
        scale_strides = (0, 0) if scale is None or scale.dim() == 0 else scale.stride()
        args = (x_in, x_in if w_in is None else w_in, rstd if data is None else data, rstd if scale is None else scale,
                rstd, amax, rstd if v_out is None else v_out, rows, cols, float(eps), x_in.stride(0),
                0 if data is None else data.stride(0), *scale_strides, 0 if v_out is None else v_out.stride(0))
        switches = dict(BR=br, BC=bc, FP8_MAX=fp8_max, MANT=mant, MIN_EXP=min_exp, POW2=bool(power_of_two),
                        HAS_WEIGHT=weight is not None, num_warps=warps)
        with _on(x):
            if group == "tensor":
                rms_norm_quantize_kernel[(triton.cdiv(rows, br),)](*args, GROUP=group, CAST=False, VALUES=False,
                                                                   **switches)
            rms_norm_quantize_kernel[(triton.cdiv(rows, br),)](*args, GROUP=group, CAST=group == "tensor",
                                                               VALUES=v_out is not None, **switches)
        _copy_back(values, v_out)
    elif data is not None:
        _empty_result(data, scale, dtype, power_of_two)
    return NormQuantized(None if data is None else Quantized(data, scale), rstd, values)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, granularity: str, *,
                    dtype: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False,
                    return_values: bool = False) -> tuple[Quantized, torch.Tensor | None]:
    """``(q, values)``: ``h = silu(gate) * up`` of ``gate, up [M, F]`` (one dtype of float16, bfloat16,
    float32; unit column strides, any row strides: say, the two halves of a ``[M, 2F]`` projection)
    cast to ``dtype`` with one scale per group of ``granularity`` (``"tensorwise"``, ``"rowwise"``,
    ``"blockwise_1x128"`` as ``quantize``); ``power_of_two``: scales rounded up to powers of two;
    ``values``: ``h`` in ``gate``'s dtype with ``return_values``, else None.

    Errors name the argument: a granularity or dtype not listed, ``gate`` and ``up`` of different
    shapes, dtypes or devices, blockwise with ``F`` not a multiple of 128."""
    _check_x("swiglu_quantize", "gate", gate)
    _check_x("swiglu_quantize", "up", up)
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"swiglu_quantize: gate and up must have one shape, dtype and device, got gate "
                         f"{common.describe(gate)} and up {common.describe(up)}")
    rows, cols = gate.shape
    group = _check_form("swiglu_quantize", granularity, dtype, cols, return_values)
    data, scale, values = _outputs(group, rows, cols, dtype, gate, return_values)
    if rows and cols:
        interp = _interpreter("swiglu_quantize", gate)
        g_in, u_in, v_out = _readable(gate, interp), _readable(up, interp), _writable(values, interp)
        tiles = INTERPRETER_TILES if interp else TILES
        br, bc, warps = tiles["swiglu_row" if group == "row" else "swiglu"]
        grid = (triton.cdiv(rows, br), 1 if group == "row" else triton.cdiv(cols, bc))
        amax = torch.zeros(1, dtype=torch.float32, device=gate.device)
        scale_strides = (0, 0) if scale.dim() == 0 else scale.stride()
        args = (g_in, u_in, data, scale, amax, data if v_out is None else v_out, rows, cols, g_in.stride(0),
                u_in.stride(0), data.stride(0), *scale_strides, 0 if v_out is None else v_out.stride(0))
        switches = dict(BR=br, BC=bc, FP8_MAX=FP8_MAX[dtype], MANT=_GRID[dtype][0], MIN_EXP=_GRID[dtype][1],
                        POW2=bool(power_of_two), num_warps=warps,
                        enable_fp_fusion=False)  # the sigmoid's fixed steps: no product and sum as one FMA
        with _on(gate):
            if group == "tensor":
                swiglu_quantize_kernel[grid](*args, GROUP=group, CAST=False, VALUES=False, **switches)
            swiglu_quantize_kernel[grid](*args, GROUP=group, CAST=group == "tensor", VALUES=v_out is not None,
                                         **switches)
        _copy_back(values, v_out)
    else:
        _empty_result(data, scale, dtype, power_of_two)
    return Quantized(data, scale), values


def _check_x(op: str, name: str, x) -> None:
    common.check_matrix(f"{op}: {name}", x)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{op}: {name} must have unit stride along its last dimension, got strides {x.stride()}")


def _check_vector(op: str, name: str, t, size: int, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in common.SUPPORTED_DTYPES or t.device != device \
            or tuple(t.shape) != (size,) or (size > 1 and t.stride(0) != 1):
        raise ValueError(f"{op}: {name} must be a contiguous float16, bfloat16 or float32 tensor of shape "
                         f"({size},) on {device}, got {common.describe(t)}")


def _check_form(op: str, granularity, dtype, cols: int, return_values: bool) -> str:
    if granularity is None and op == "rms_norm_quantize":
        if not return_values:
            raise ValueError(f"{op}: granularity=None (no cast) needs return_values=True")
        return "none"
    if granularity not in GRANULARITIES:
        raise ValueError(f"{op}: granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity == "blockwise_1x128" and cols % BLOCK:
        raise ValueError(f"{op}: blockwise_1x128 needs the columns to be a multiple of {BLOCK}, got {cols}")
    return _GROUP[granularity]


def _outputs(group: str, rows: int, cols: int, dtype, like: torch.Tensor, return_values: bool):
    device = like.device
    values = torch.empty((rows, cols), dtype=like.dtype, device=device) if return_values else None
    if group == "none":
        return None, None, values
    shape = {"tensor": (), "row": (rows, 1), "1x128": (rows, cols // BLOCK)}[group]
    return (torch.empty((rows, cols), dtype=dtype, device=device),
            torch.empty(shape, dtype=torch.float32, device=device), values)


def _empty_result(data: torch.Tensor, scale: torch.Tensor, dtype, power_of_two: bool) -> None:
    # no elements: the scales of an all-zero group, as quantize gives them
    data.zero_()
    scale.fill_(_host_scale(0.0, dtype, power_of_two))


def _interpreter(op: str, x: torch.Tensor) -> bool:
    interp = common.interpreting()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError(f"{op} on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    return interp


def _readable(t: torch.Tensor | None, interp: bool) -> torch.Tensor | None:
    # the interpreter's bfloat16 loads are wrong: read bfloat16 through float32 there
    return t.float() if interp and t is not None and t.dtype == torch.bfloat16 else t


def _writable(values: torch.Tensor | None, interp: bool) -> torch.Tensor | None:
    return torch.empty(values.shape) if interp and values is not None and values.dtype == torch.bfloat16 else values


def _copy_back(values: torch.Tensor | None, written: torch.Tensor | None) -> None:
    if values is not None and written is not values:
        values.copy_(written)


def _on(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
