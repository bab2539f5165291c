"""The weight gradient of the grouped GEMM over a routing plan's rows, with rows gathered by index."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.grouped_wgrad import grouped_wgrad_kernel
from tileweave.ops import common
from tileweave.tune.grouped import WgradConfig, choose_wgrad_config


def grouped_wgrad(lhs: torch.Tensor, rhs: torch.Tensor, offsets: torch.Tensor, *, experts: int,
                  lhs_rows: torch.Tensor | None = None, rhs_rows: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  config: WgradConfig | None = None) -> torch.Tensor:
    """``out [E, N, K]``: ``out[e] = sum over the rows p of expert e of (lhs[l(p)] * scale[p]).T @
    rhs[r(p)]``, fp32 accumulation, in a fixed order (deterministic): the ``nn.Linear``-layout gradient
    of a stacked expert weight.

    Rows: ``offsets`` int32 ``[S*E + 1]`` on the device (a plan's: group ``g = s*E + e`` is rows
    ``[offsets[g], offsets[g+1])``, expert ``g % E``, S sources). Row p of the sum reads ``lhs[lhs_rows[p]]``
    (``lhs [Ml, N]``) and ``rhs[rhs_rows[p]]`` (``rhs [Mr, K]``), or row p itself where the index is None;
    ``scale`` float32 ``[P]`` multiplies lhs row p (rounded to lhs's dtype, as a scaled copy would be).
    ``lhs`` and ``rhs`` share one dtype (fp16, bf16, fp32), with unit column stride; ``out`` (contiguous,
    ``[E, N, K]``) or a new tensor has that dtype. Experts without rows get zeros. No host sync. On the
    CPU this runs in Triton's interpreter (bfloat16 computed in float32 there). ``config``: the tile
    shape (default ``tileweave.tune.grouped.choose_wgrad_config``).
    """
    common.check_matrix("lhs", lhs)
    common.check_matrix("rhs", rhs, dtype=lhs.dtype, device=lhs.device)
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension, got strides {t.stride()}")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"experts must be a positive int, got {experts!r}")
    common.check_index("offsets", offsets, lhs.device)
    groups = offsets.numel() - 1
    if groups < experts or groups % experts:
        raise ValueError(f"offsets must have S*E + 1 entries for E = {experts} experts, got {offsets.numel()}")
    sources = groups // experts
    rows = None
    for name, idx, base in (("lhs_rows", lhs_rows, lhs), ("rhs_rows", rhs_rows, rhs)):
        if idx is not None:
            common.check_index(name, idx, lhs.device)
            rows = idx.numel() if rows is None else rows
            if idx.numel() != rows:
                raise ValueError(f"lhs_rows and rhs_rows must have the same length P, got {rows} and {idx.numel()}")
    for idx, base, name in ((lhs_rows, lhs, "lhs"), (rhs_rows, rhs, "rhs")):
        if idx is None:
            if rows is not None and base.shape[0] != rows:
                raise ValueError(f"{name} without an index must have P = {rows} rows, got {base.shape[0]}")
            rows = base.shape[0] if rows is None else rows
    if scale is not None and (not isinstance(scale, torch.Tensor) or scale.shape != (rows,)
                              or scale.dtype != torch.float32 or scale.device != lhs.device):
        raise ValueError(f"scale must be a float32 tensor of shape ({rows},) on {lhs.device}, "
                         f"got {common.describe(scale)}")
    n, k = lhs.shape[1], rhs.shape[1]
    if out is None:
        out = torch.empty((experts, n, k), dtype=lhs.dtype, device=lhs.device)
    elif tuple(out.shape) != (experts, n, k) or out.dtype != lhs.dtype or out.device != lhs.device \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {lhs.dtype} tensor [E, N, K] = [{experts}, {n}, {k}] on "
                         f"{lhs.device}, got {common.describe(out)}")
    if n == 0 or k == 0:
        return out
    interp = common.interpreting()
    if lhs.device.type == "cpu" and not interp:
        raise RuntimeError("grouped_wgrad on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    target = out
    if interp and lhs.dtype == torch.bfloat16:
        lhs, rhs, target = lhs.float(), rhs.float(), torch.empty(out.shape, dtype=torch.float32)
    if lhs.dtype == torch.float32:
        precision = "tf32" if (lhs.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    config = config or choose_wgrad_config(lhs.dtype, interpreter=interp)
    if not isinstance(config, WgradConfig):
        raise TypeError(f"config must be a WgradConfig, got {type(config).__name__}")
    bn, bk, br, warps, stages = config.block_n, config.block_k, config.block_r, config.num_warps, config.num_stages
    grid = (experts * triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    with torch.cuda.device(lhs.device) if lhs.is_cuda else contextlib.nullcontext():
        grouped_wgrad_kernel[grid](
            lhs, offsets if lhs_rows is None else lhs_rows, rhs, offsets if rhs_rows is None else rhs_rows,
            target if scale is None else scale, offsets, target, experts, sources, n, k,
            lhs.stride(0), rhs.stride(0), target.stride(0), target.stride(1),
            BN=bn, BK=bk, BR=br, S_BLOCK=triton.next_power_of_2(sources), L_GATHER=lhs_rows is not None,
            R_GATHER=rhs_rows is not None, HAS_SCALE=scale is not None, PRECISION=precision, num_warps=warps,
            num_stages=stages)
    if target is not out:
        out.copy_(target)
    return out
