"""The MoE top-k reduce on the device: one pass over the expert outputs, weighted, in a fixed order."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.topk_reduce import topk_reduce_kernel
from tileweave.ops import common

TILES = (16, 512, 4)
"""Tokens and columns of a program, and its warps, on GPUs."""
INTERPRETER_TILES = (16, 128, 4)
"""The same in Triton's interpreter (the CPU tests)."""


def topk_reduce(z: torch.Tensor, pair_row: torch.Tensor, weights: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out [n, H]``: ``out[t] = sum_j weights[t, j] * z[pair_row[t, j]]`` (``weights`` None: every
    weight 1), summed in fp32 in slot order j = 0, 1, ..., k-1, then rounded once to ``out``'s dtype.

    ``z [P, H]`` (fp16, bf16 or fp32, unit column stride), rows in any order (the grouped GEMM's plan
    order); ``pair_row`` int32/int64 ``[n, k]`` with unit stride along k, values in ``[0, P)`` (not checked:
    a plan's rows are); ``weights [n, k]`` fp32, fp16 or bf16 with unit stride along k; ``out`` (``[n, H]``,
    unit column stride) or a new tensor of ``out_dtype``. Each row of ``z`` named by ``pair_row`` is read
    once; the result is bitwise the same on every call. No host synchronisation. On the CPU this runs in
    Triton's interpreter (bfloat16 read through float32 there).
    """
    common.check_matrix("z", z)
    if z.stride(1) != 1:
        raise ValueError(f"z must have unit stride along its last dimension, got strides {z.stride()}")
    if not isinstance(pair_row, torch.Tensor) or pair_row.dim() != 2 \
            or pair_row.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pair_row must be an int32/int64 tensor [n, k], got {common.describe(pair_row)}")
    if pair_row.device != z.device or (pair_row.shape[1] > 1 and pair_row.stride(1) != 1):
        raise ValueError(f"pair_row must be on {z.device} with unit stride along k, got {common.describe(pair_row)} "
                         f"with strides {pair_row.stride()}")
    n, k = pair_row.shape
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n, k) \
                or weights.dtype not in common.SUPPORTED_DTYPES or weights.device != z.device \
                or (k > 1 and weights.stride(1) != 1):
            raise ValueError(f"weights must be a float tensor [n, k] = [{n}, {k}] on {z.device} with unit stride "
                             f"along k, got {common.describe(weights)}")
    hidden = z.shape[1]
    out = common.out_or_new(out, (n, hidden), out.dtype if out is not None else out_dtype, z.device)
    if n == 0 or hidden == 0:
        return out
    if k == 0:
        return out.zero_()
    interp = common.interpreting()
    if z.device.type == "cpu" and not interp:
        raise RuntimeError("topk_reduce on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    target = out
    if interp and (z.dtype == torch.bfloat16 or out.dtype == torch.bfloat16):
        z = z.float()
        weights = None if weights is None else weights.float()
        target = torch.empty((n, hidden), dtype=torch.float32)
    bt, bh, warps = INTERPRETER_TILES if interp else TILES
    grid = (triton.cdiv(n, bt), triton.cdiv(hidden, bh))
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        topk_reduce_kernel[grid](z, pair_row, target if weights is None else weights, target, n, hidden, k,
                                 z.stride(0), pair_row.stride(0), 0 if weights is None else weights.stride(0),
                                 target.stride(0), BT=bt, BH=bh, HAS_W=weights is not None, num_warps=warps)
    if target is not out:
        out.copy_(target)
    return out
