"""FP8 inference weights: a linear's weight stored once in float8 with its scales, and the operands of
each GEMM that uses it, the activations quantized per token on the device at each call.

Two scalings, the ones FP8 serving stacks run (vLLM's and SGLang's dynamic per-token FP8, DeepSeek-V3's
and Qwen3-FP8's block quantization):

==========  =====================================  ===========================================
scaling     weight ``[N, K]`` (quantized once)     activation ``x [M, K]`` (at every call)
==========  =====================================  ===========================================
rowwise     e4m3, one scale per output row         e4m3, one scale per token (row) of the
            ``[N, 1]``                             rank's features ``[M, 1]``
blockwise   e4m3, one scale per 128 x 128 block    e4m3, one scale per 1 x 128 block of a token
            ``[ceil(N/128), K/128]``               ``[M, K/128]``
==========  =====================================  ===========================================

Each scale is ``max(amax, 1e-12) / 448`` of its group (``tileweave.ops.compute.quantize``), so
``x ~ q * scale``; the GEMMs accumulate in fp32, each K step added exactly (no fast accumulation), and
write the model's dtype. Blockwise needs K to be a multiple of 128.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tileweave.ops.compute.quantize import EPS, FP8_MAX, quantize
from tileweave.ops.compute.scaling import BLOCK

SCALINGS = ("rowwise", "blockwise")
"""The weight scalings of FP8 inference."""
_WEIGHT = {"rowwise": "rowwise", "blockwise": "blockwise_128x128"}
_TOKENS = {"rowwise": "rowwise", "blockwise": "blockwise_1x128"}


class Float8Weight(NamedTuple):
    """A weight ``[N, K]`` in float8 e4m3 (``data``) with its float32 ``scale`` (the module's table)."""

    data: torch.Tensor
    scale: torch.Tensor
    scaling: str

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(a, b, fp8)`` for ``x [M, K] @ weight.T`` on any of tileweave's GEMMs (``matmul``,
        ``all_gather_gemm``, ``gemm_reduce_scatter``, ``gemm_all_reduce``), called as
        ``gemm(a, b, ..., **fp8)``: ``x`` quantized per token, ``b = data.t()`` read in place, and
        the keyword arguments ``scale_a``, ``scale_b`` and ``out_dtype`` (``x``'s dtype)."""
        q = quantize(x, _TOKENS[self.scaling])
        return q.data, self.data.t(), {"scale_a": q.scale, "scale_b": self.scale.t(), "out_dtype": x.dtype}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``data * scale`` in ``dtype``, ``[N, K]`` (computed in float32)."""
        scale = self.scale
        if self.scaling == "blockwise":
            n, k = self.data.shape
            scale = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return (self.data.float() * scale).to(dtype)


def gemm_operands(x: torch.Tensor, weight: torch.Tensor | Float8Weight) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(a, b, fp8 keyword arguments)`` of ``x @ weight.T``: ``Float8Weight.operands``, or for a plain
    weight ``(x, weight.t(), {})``."""
    if isinstance(weight, Float8Weight):
        return weight.operands(x)
    return x, weight.t(), {}


def quantize_weight(w: torch.Tensor, scaling: str, *, row_amax: torch.Tensor | None = None) -> Float8Weight:
    """``w [N, K]`` (float16, bfloat16 or float32) as a ``Float8Weight``. ``row_amax [N, 1]`` (rowwise
    only): the amax of each row to scale by instead of ``w``'s own (the whole row of a weight whose
    columns are split over ranks). On the meta device, empty tensors of the right shapes (a model
    built there, to be loaded later)."""
    check_scaling(scaling)
    n, k = w.shape
    if w.is_meta:
        shape = (n, 1) if scaling == "rowwise" else (-(-n // BLOCK), k // BLOCK)
        return Float8Weight(torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device),
                            torch.empty(shape, dtype=torch.float32, device=w.device), scaling)
    if row_amax is None:
        q = quantize(w, _WEIGHT[scaling])
        return Float8Weight(q.data, q.scale, scaling)
    if scaling != "rowwise" or tuple(row_amax.shape) != (n, 1):
        raise ValueError(f"row_amax applies to rowwise scaling and must be [N, 1] = {[n, 1]}, got {scaling!r} "
                         f"and {list(row_amax.shape)}")
    # quantize's arithmetic (float32, IEEE division, clamped, cast to nearest even) with the given amax.
    # The divisor is a tensor: CUDA divides by a Python number as a product with its reciprocal, which
    # can differ from the quotient in the last bit.
    amax = row_amax.float().clamp_min(EPS)
    scale = amax / torch.full_like(amax, FP8_MAX[torch.float8_e4m3fn])
    data = (w.float() / scale).clamp(-FP8_MAX[torch.float8_e4m3fn], FP8_MAX[torch.float8_e4m3fn])
    return Float8Weight(data.to(torch.float8_e4m3fn), scale, scaling)


def check_scaling(scaling: object) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 must be None or one of {', '.join(repr(s) for s in SCALINGS)}, got {scaling!r}")
