"""``TPMoE(fp8=...)``'s float8 ``h``, layer 1's first operand, as layer 0's SwiGLU epilogue casts it,
checked for ``support.fp8_moe_capture`` against a reference cast written with plain torch and numpy.

The epilogue casts the float32 values it computes from its float32 accumulators ``g | u`` (the gate and
up columns of a row, which it also writes as the pre-activations ``pre [P, 2F]``, gate ``j`` at column
``2j`` and up ``j`` at ``2j + 1``), ``h = g / (1 + exp(-g)) * u``, and never writes them. The reference
is ``fp8_reference.quantize32`` (the recipe's groups and power-of-two flag, e4m3) of
``fp8_reference.swiglu_epilogue32`` of the captured pre-activations. What ``h_cast_difference`` asserts:

* **CPU** (Triton's interpreter; the model's dtype is float32, so the pre-activations are the
  accumulators themselves, and the interpreter computes the formula in float32 numpy as the reference
  does): the float8 ``h`` and its scales equal the reference cast bit for bit.
* **GPU**: the float8 ``h`` is the reference's cast of values within ``room`` of the reference's
  float32 ``h``, elementwise, with the scales of an amax within that room: each scale lies between the
  recipe's scale of the group's amax of ``max(|h| - room, 0)`` and that of ``|h| + room`` (outward
  rounded to float32), and each element between the e4m3 roundings of ``(h - room) / scale`` and
  ``(h + room) / scale`` under its own scale. Where the room reaches no rounding boundary that is one
  value: an element differs from the reference cast, by one e4m3 step, only where ``h / scale`` lies
  within ``room / scale`` of the midpoint between two e4m3 values (likewise a scale: one float32 or
  power-of-two step, only where the amax lies within the room of a boundary). ``room`` is
  ``ELEMENTWISE_UNITS`` float32 units of ``|h|`` (the GPU's ``exp`` and division against numpy's, and
  the cast's division by the scale), plus, where the pre-activations are written in bfloat16 or
  float16, their rounding (``fp8_checks.OUT_UNIT`` of ``|g|`` and ``|u|``) carried through
  ``silu(g) * u``: the epilogue cast the unrounded accumulators. A wrong scale (a factor, a group's
  scale from another group) or a wrong formula moves values by far more than that room.

The pre-activations themselves are held to float64 of layer 0's operands by the capture's GEMM check.
"""

from __future__ import annotations

import math

import torch

from support.fp8_checks import OUT_UNIT, U32, same_scale
from support.fp8_reference import E4M3, FP8_MAX, expand_scale, quantize32, swiglu_epilogue32

SILU_SLOPE = 1.1
"""The largest ``|d silu(g) / dg|`` (1.0998, at g = 2.4)."""
ELEMENTWISE_UNITS = 64
"""float32 units of room for a few float32 products and the sigmoid's exp and division (each within a
few units, and ``exp(-g)`` about ``|g|`` units for the rounding of its argument), of the terms'
magnitudes. For the SwiGLU's ``g / (1 + exp(-g)) * u``: ``exp(-g)`` is finite and not flushed for
``|g| < 88``, where its argument's rounding moves it by at most ``|g| / 2`` units, ``exp`` itself, the
add, the division and the product by a few each, and the relative error of ``exp(-g)`` reaches the
sigmoid at most whole: under 44 + 8 units of ``|h|``, and 2 more for the cast's division by its scale."""


def _float32(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """float64 ``x`` as float32, rounded toward +inf (``up``) or -inf."""
    y = x.float()
    off = y.double() < x if up else y.double() > x
    return torch.where(off, torch.nextafter(y, torch.full_like(y, math.inf if up else -math.inf)), y)


def h_room(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """float64 ``[P, F]``: how far the float32 values a GPU's epilogue cast may lie from ``h``
    (``swiglu_epilogue32`` of ``pre``), the module docstring's ``room``."""
    g, u = pre[:, 0::2].double(), pre[:, 1::2].double()
    unit = 0.0 if pre.dtype == torch.float32 else OUT_UNIT[pre.dtype]  # float32: the accumulators themselves
    dg, du = unit * g.abs(), unit * u.abs()
    carried = SILU_SLOPE * (u.abs() + du) * dg + torch.nn.functional.silu(g).abs() * du
    return carried + ELEMENTWISE_UNITS * U32 * (h.double().abs() + carried)


def h_cast_difference(label: str, data: torch.Tensor, scale: torch.Tensor, pre: torch.Tensor, groups: str,
                      pow2: bool, *, exact: bool) -> str | None:
    """None when the float8 ``data [P, F]`` and ``scale`` that layer 0's epilogue wrote hold to the
    reference cast of ``pre [P, 2F]``'s SwiGLU in ``groups`` (``quantize32``'s) with ``pow2`` as the
    module docstring says: bit for bit where ``exact`` (the CPU), within the room otherwise (a GPU);
    else a line saying how they differ."""
    gate, up = pre[:, 0::2].float(), pre[:, 1::2].float()
    h = swiglu_epilogue32(gate, up)
    ref, ref_scale = quantize32(h, groups, E4M3, pow2)
    if data.dtype != E4M3 or data.shape != ref.shape or scale.numel() != ref_scale.numel():
        return (f"{label}: {data.dtype} {tuple(data.shape)} with {scale.numel()} scales, not e4m3 "
                f"{tuple(ref.shape)} with {ref_scale.numel()}")
    scale = scale.reshape(ref_scale.shape)
    equal = data.view(torch.uint8) == ref.view(torch.uint8)
    if bool(equal.all()) and same_scale(scale, ref_scale):
        return None
    differ = (f"{label}: {int((~equal).sum())} of {equal.numel()} elements and "
              f"{int((scale != ref_scale).sum())} of {scale.numel()} scales differ from the reference cast")
    if exact:
        return differ
    room, hd = h_room(pre, h), h.double()
    low, high = ((quantize32(_float32(v, up=up), groups, E4M3, pow2)[1])
                 for v, up in (((hd.abs() - room).clamp(min=0), False), (hd.abs() + room, True)))
    if not bool(((low <= scale) & (scale <= high)).all()):
        return differ + ", scales outside the room"
    each = expand_scale(scale, groups, *h.shape).double()
    lo, hi = (_float32(((hd + side * room) / each).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]), up=side > 0).to(E4M3).float()
              for side in (-1, 1))
    got = data.float()
    outside = ~((lo <= got) & (got <= hi))
    if bool(outside.any()):
        return differ + f", {int(outside.sum())} elements outside the room"
    return None
