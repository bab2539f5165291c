"""FP8 in the dense pair (``AllGatherGemm``, ``GemmReduceScatter``): a call's float8 arguments, their
checks, and the forms of the scales that the transports move.

The semantics are ``matmul``'s (``tileweave.ops.compute.scaling``): float8 ``a`` and ``b`` (e4m3fn or
e5m2), float32 scales of this rank's operands, fp32 accumulation, ``out_dtype`` (bfloat16 by default,
float16, float32). Every rank must pass scales of the same shapes (the scaling is part of what the
ranks agree on); their values may differ.

Gathered a-scales. An all-gather moves each shard's scales beside its rows in one form for the three
scalings, ``[rows, KB]`` float32 with a row per row of ``a`` (``KB`` = 1, or ``K/128`` for blockwise):
a tensorwise scale, which differs per rank, travels as its shard's rows each holding it
(:func:`shard_rows`), so a gathered row's scale never depends on which rank sent it.
"""

from __future__ import annotations

import dataclasses

import torch

from tileweave.ops import common
from tileweave.ops.compute import scaling


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A float8 call's scales and output dtype, as the dense transports take them."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    out_dtype: torch.dtype
    fast_accum: bool
    scaling: str
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``."""

    def matmul_args(self, rows: slice | None = None, *, scale_a: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> dict:
        """``matmul``'s FP8 keyword arguments for ``rows`` of ``a`` (all rows when None), or for another
        ``a`` whose scales are ``scale_a``; ``out_dtype``: another output dtype (float32 for a partial
        that is summed before it is rounded)."""
        sa = self.scale_a if scale_a is None else scale_a
        if rows is not None and self.scaling != "tensorwise":
            sa = sa[rows]
        return {"scale_a": sa, "scale_b": self.scale_b, "out_dtype": out_dtype or self.out_dtype,
                "use_fast_accum": self.fast_accum}

    def shard_rows(self, rows: int) -> torch.Tensor:
        """``scale_a`` of a shard of ``rows`` rows in the gathered form (module docstring): ``[rows, KB]``,
        contiguous, ready for a copy engine."""
        sa = self.scale_a
        if self.scaling == "tensorwise":
            return sa.reshape(1, 1).expand(rows, 1).contiguous()
        return sa.reshape(rows, -1).contiguous()

    def gathered_args(self, gathered_scales: torch.Tensor, n: int) -> dict:
        """``matmul``'s FP8 keyword arguments for gathered rows whose a-scales are ``gathered_scales`` (the
        gathered form): tensorwise calls become rowwise ones, ``scale_b`` broadcast along N (no copy)."""
        scale_b = self.scale_b
        if self.scaling == "tensorwise":
            scale_b = scale_b.reshape(1, 1).expand(1, n)
        return {"scale_a": gathered_scales, "scale_b": scale_b, "out_dtype": self.out_dtype,
                "use_fast_accum": self.fast_accum}


def wanted(a, b, scale_a, scale_b, out_dtype) -> bool:
    """Whether a call is a float8 one, or meant to be (its checks then decide)."""
    return scaling.is_fp8(a) or scaling.is_fp8(b) or scale_a is not None or scale_b is not None or out_dtype is not None


def key(scale_a, scale_b, out_dtype, use_fast_accum) -> tuple | None:
    """The float8 part of a dense call's signature: the scales' shapes, dtypes and devices, the output
    dtype and ``use_fast_accum``; ``()`` for a call without them, None for scales that are not tensors."""
    if scale_a is None and scale_b is None and out_dtype is None and not use_fast_accum:
        return ()
    parts = []
    for s in (scale_a, scale_b):
        if s is not None and type(s) is not torch.Tensor:
            return None
        parts.append(None if s is None else (s.shape, s.stride(), s.dtype, s.device))
    return (*parts, out_dtype, bool(use_fast_accum))


def check(op: str, a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype, use_fast_accum, *,
          m: int, n: int, k: int) -> Scaled | None:
    """The float8 arguments of ``a [m, k] @ b [k, n]`` (this rank's GEMM, before any communication), or
    None for a call on float16/bfloat16/float32 inputs (after refusing scales and ``out_dtype`` there)."""
    scaled = scaling.check_operands(op, a, b, scale_a, scale_b)
    dtype = scaling.out_dtype_of(op, a, out_dtype)
    if not scaled:
        return None
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype == torch.bfloat16 and common.interpreting():
        raise TypeError(f"{op}: out_dtype is bfloat16 (the default for float8 inputs), which Triton's interpreter "
                        "(TRITON_INTERPRET=1, the CPU) computes wrongly in the fused kernels; pass "
                        "out_dtype=torch.float16 or torch.float32 on the CPU (bfloat16 runs on GPUs)")
    scales = scaling.dense_scales(op, m, n, k, scale_a, scale_b, fast_accum=use_fast_accum)
    return Scaled(scale_a, scale_b, dtype, bool(use_fast_accum), scales.scaling)
