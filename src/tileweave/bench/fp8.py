"""FP8 inputs for the benchmark's ``gemm`` and ``grouped`` sections: bf16 data quantised to float8
e4m3 with each recipe's scales, the float32 of the dequantised values (what every variant is checked
against), and torch's own scaled matmuls as the ``torch`` variant.

Recipes (torch's shapes, so the same tensors go to both implementations):

* ``tensorwise``: one scale per tensor, ``amax / 448`` (448: e4m3's largest finite value);
* ``rowwise``: one per row of the activation ``[M, 1]`` and per output column of the weight ``[1, N]``;
* ``blockwise`` (DeepSeek-V3): one per 1 x 128 block of the activation ``[M, K/128]`` (stored M-major,
  as torch wants it) and per 128 x 128 block of the weight ``[N/128, K/128]``, passed transposed
  (``[K/128, N/128]`` with strides ``(1, K/128)``).

This is the benchmark's own quantisation, in plain torch: a fused on-device quantisation is not part
of what these sections time.
"""

from __future__ import annotations

from typing import Callable

import torch

SCALINGS = ("tensorwise", "rowwise", "blockwise")
FAST = ("tensorwise-fast", "rowwise-fast")
"""Also accepted by ``--scaling``: tensorwise and rowwise with ``use_fast_accum=True``, in ours and in
torch's (the tensor cores accumulate across K steps); the plain names run both with the default, False."""
E4M3_MAX = 448.0
BLOCK = 128


def dtype_label(scaling: str | None) -> str:
    """The ``dtype`` field of a row: ``"bf16"`` or ``"fp8-<scaling>"``."""
    return "bf16" if scaling is None else f"fp8-{scaling}"


def parse_scalings(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in chosen if s not in SCALINGS + FAST]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--scaling expects distinct names from {', '.join(SCALINGS + FAST)}; got {text!r}")
    return chosen


def split(scaling: str) -> tuple[str, bool]:
    """``(the scaling of the scales, use_fast_accum)`` of a ``--scaling`` name."""
    return scaling.removesuffix("-fast"), scaling.endswith("-fast")


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / E4M3_MAX).clamp_min(1e-12)


def m_major(scale: torch.Tensor) -> torch.Tensor:
    """A copy of 1 x 128 scales ``[M, K/128]`` with strides ``(1, M)``, as torch's blockwise scaled matmul
    wants them (``t().contiguous().t()`` keeps a one-row tensor's strides, which torch refuses)."""
    out = torch.empty_strided(scale.shape, (1, scale.shape[0]), dtype=scale.dtype, device=scale.device)
    return out.copy_(scale)


def quantize_rows(x: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x8, scale, dequantised float32)`` of an activation ``x [M, K]``: ``scale`` is a 0-d tensor
    (tensorwise), ``[M, 1]`` (rowwise) or ``[M, K/128]`` M-major (blockwise)."""
    m, k = x.shape
    if scaling == "tensorwise":
        scale = _amax_scale(x.abs().amax())
        full = scale
    elif scaling == "rowwise":
        scale = _amax_scale(x.abs().amax(dim=1, keepdim=True))
        full = scale
    else:
        blocks = _amax_scale(x.abs().reshape(m, k // BLOCK, BLOCK).amax(dim=2))
        scale = m_major(blocks)
        full = blocks.repeat_interleave(BLOCK, dim=1)
    x8 = _to_e4m3(x, full)
    return x8, scale, x8.float() * full


def quantize_weight(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w8 [N, K], scale_b, dequantised float32 [N, K])`` of an ``nn.Linear`` weight, ``scale_b`` as
    the scale of ``b = w8.t()``: 0-d (tensorwise), ``[1, N]`` (rowwise), ``[K/128, ceil(N/128)]``
    (blockwise, the transpose of a contiguous ``[ceil(N/128), K/128]``; K a multiple of 128)."""
    n, k = w.shape
    if scaling == "tensorwise":
        scale = _amax_scale(w.abs().amax())
        full = scale
        scale_b = scale
    elif scaling == "rowwise":
        scale = _amax_scale(w.abs().amax(dim=1, keepdim=True))
        full = scale
        scale_b = scale.t()
    else:
        nb = -(-n // BLOCK)  # a last, partial block of rows when N is not a multiple of 128
        padded = torch.nn.functional.pad(w.abs(), (0, 0, 0, nb * BLOCK - n))
        blocks = _amax_scale(padded.reshape(nb, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3)))
        full = blocks.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n]
        scale_b = blocks.t()
    w8 = _to_e4m3(w, full)
    return w8, scale_b, w8.float() * full


def quantize_experts(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w8 [E, N, K], scale_b, dequantised float32 [E, N, K])`` of stacked ``nn.Linear`` weights, with
    ``scale_b`` in ``grouped_gemm``'s shapes for ``b = w8.transpose(1, 2)``: ``[E]`` (tensorwise),
    ``[E, N]`` (rowwise, as ``torch._scaled_grouped_mm`` takes it), ``[E, K/128, N/128]`` (blockwise)."""
    parts = [quantize_weight(w[e], scaling) for e in range(w.shape[0])]
    w8 = torch.stack([p[0] for p in parts])
    deq = torch.stack([p[2] for p in parts])
    scales = [p[1] for p in parts]
    if scaling == "tensorwise":
        scale_b = torch.stack(scales).reshape(-1)
    elif scaling == "rowwise":
        scale_b = torch.stack([s.reshape(-1) for s in scales])
    else:
        scale_b = torch.stack(scales)
    return w8, scale_b, deq


def torch_scaled_mm(scaling: str) -> tuple[Callable | None, str]:
    """torch's scaled matmul for ``scaling`` as ``fn(a8, b, scale_a, scale_b, *, out_dtype=torch.bfloat16,
    use_fast_accum=...)``, or ``(None, why)``: ``torch._scaled_mm`` for tensorwise and rowwise,
    ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` for blockwise (torch
    2.10 and later; it adds each K step in fp32 and takes no ``use_fast_accum``); ``use_fast_accum``
    defaults to True for a ``-fast`` name (``FAST``), else False."""
    scaling, fast = split(scaling)
    if scaling != "blockwise":
        if not hasattr(torch, "_scaled_mm"):
            return None, "torch._scaled_mm missing in this torch"
        return (lambda a, b, sa, sb, *, out_dtype=torch.bfloat16, use_fast_accum=fast: torch._scaled_mm(
            a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=use_fast_accum)), ""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if fn is None or kinds is None or not hasattr(kinds, "BlockWise1x128"):
        return None, "torch.nn.functional.scaled_mm with blockwise scaling missing in this torch"
    return (lambda a, b, sa, sb, *, out_dtype=torch.bfloat16, use_fast_accum=False: fn(
        a, b, sa, kinds.BlockWise1x128, sb, kinds.BlockWise128x128, output_dtype=out_dtype)), ""


def torch_scaled_grouped_mm(scaling: str) -> tuple[Callable | None, str]:
    """``torch._scaled_grouped_mm`` (rowwise only) as ``fn(a8_perm, b8, scale_a_perm [P], scale_b [E, N],
    ends) -> bf16``, or ``(None, why)``; a ``-fast`` name with ``use_fast_accum=True``."""
    scaling, fast = split(scaling)
    if scaling != "rowwise":
        return None, "torch._scaled_grouped_mm takes rowwise scales only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None, "torch._scaled_grouped_mm missing in this torch"
    return (lambda a, b, sa, sb, ends: torch._scaled_grouped_mm(a, b, sa, sb, offs=ends, out_dtype=torch.bfloat16,
                                                               use_fast_accum=fast)), ""
