"""The weight gradient of the grouped GEMM over a routing plan's rows, with rows gathered by index."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.grouped_wgrad import grouped_wgrad_kernel
from tileweave.ops import common
from tileweave.ops.compute import scaling
from tileweave.tune.grouped import WgradConfig, choose_wgrad_config


def grouped_wgrad(lhs: torch.Tensor, rhs: torch.Tensor, offsets: torch.Tensor, *, experts: int,
                  lhs_rows: torch.Tensor | None = None, rhs_rows: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  config: WgradConfig | None = None, lhs_scale: torch.Tensor | None = None,
                  rhs_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  use_fast_accum: bool = False) -> torch.Tensor:
    """``out [E, N, K]``: ``out[e] = sum over the rows p of expert e of (lhs[l(p)] * scale[p]).T @
    rhs[r(p)]``, fp32 accumulation, in a fixed order (deterministic): the ``nn.Linear``-layout gradient
    of a stacked expert weight.

    Rows: ``offsets`` int32 ``[S*E + 1]`` on the device (a plan's: group ``g = s*E + e`` is rows
    ``[offsets[g], offsets[g+1])``, expert ``g % E``, S sources). Row p of the sum reads ``lhs[lhs_rows[p]]``
    (``lhs [Ml, N]``) and ``rhs[rhs_rows[p]]`` (``rhs [Mr, K]``), or row p itself where the index is None;
    ``scale`` float32 ``[P]`` multiplies lhs row p (rounded to lhs's dtype, as a scaled copy would be).
    ``lhs`` and ``rhs`` share one dtype (fp16, bf16, fp32), each with a unit stride along one of its
    dimensions; ``out`` (contiguous, ``[E, N, K]``) or a new tensor has that dtype. Experts without rows
    get zeros. No host sync. On the CPU this runs in Triton's interpreter (bfloat16 computed in float32
    there). ``config``: the tile shape (default ``tileweave.tune.grouped.choose_wgrad_config``).

    FP8 (``torch._scaled_grouped_mm``'s 2d-2d form, the weight gradient of an MoE layer): float8 ``lhs``
    and ``rhs`` (e4m3fn or e5m2, either) with float32 ``lhs_scale`` and ``rhs_scale``: ``out[e] = sum_p
    (lhs[l(p)] * lhs_scale).T @ (rhs[r(p)] * rhs_scale)`` in ``out_dtype`` (bfloat16 by default, float16,
    float32), fp32 accumulation. The scales vary along the rows, which the sum contracts, in groups a
    product can be scaled by (``tileweave.ops.compute.scaling.wgrad_scales``):

    ==========  ===========================================  ==========================================
    scaling     ``lhs_scale``                                ``rhs_scale``
    ==========  ===========================================  ==========================================
    tensorwise  one element, or ``[E]`` (per expert)         one element, or ``[E]``
    rowwise     ``[E, N]`` or ``[E * N]`` (per expert and    ``[E, K]`` or ``[E * K]``
                column: torch's)
    blockwise   ``[P // 128 + G, N]``: per 128 rows of a     ``[P // 128 + G, K]``
                group and column (block j of group g is
                row ``offsets[g] // 128 + g + j``)
    ==========  ===========================================  ==========================================

    Blockwise is DeepSeek-V3's 128 x 1 tiles along the tokens, each group's rows cut into blocks from its
    first row (a group's last block holds fewer rows, as if padded with zeros), each block's product
    scaled before it is added (``WgradConfig.block_r`` divides 128). ``use_fast_accum`` as
    ``tileweave.matmul``'s (tensorwise and rowwise; default False: each step's product added in fp32).
    Every offset must be a multiple of 16 (each group's rows padded with zero rows, as torch's 2d-2d form
    wants its groups): the kernel then loads whole 16-byte vectors. The operands are read as given: a
    float8 operand is best stored K-major, ``[N, P]`` with the rows contiguous, and passed as its
    transpose view (``tileweave.ops.compute.quantize.quantize_segments`` writes that layout, its padded
    offsets and its scales). ``scale`` does not apply to float8 (it scales the contraction: fold it into
    ``lhs`` before quantizing). In the interpreter a bfloat16 output is computed in float32 and rounded
    once. The offsets are checked (against P, and for float8 their multiples of 16) only under
    ``TILEWEAVE_DEBUG=1`` (a host sync).
    """
    scaled = _check_float8(lhs, rhs, lhs_scale, rhs_scale)
    if not scaled:
        common.check_matrix("lhs", lhs)
        common.check_matrix("rhs", rhs, dtype=lhs.dtype, device=lhs.device)
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if t.dim() != 2:
            raise ValueError(f"grouped_wgrad: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.stride(1) != 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must have unit stride along one of its dimensions, got strides {t.stride()}")
    dtype = scaling.out_dtype_of("grouped_wgrad", lhs, out_dtype)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"experts must be a positive int, got {experts!r}")
    common.check_index("offsets", offsets, lhs.device)
    groups = offsets.numel() - 1
    if groups < experts or groups % experts:
        raise ValueError(f"offsets must have S*E + 1 entries for E = {experts} experts, got {offsets.numel()}")
    sources = groups // experts
    rows = _rows(lhs, rhs, lhs_rows, rhs_rows)
    if scale is not None:
        if scaled:
            raise TypeError("grouped_wgrad: scale (a factor per row of lhs) does not apply to float8 operands: the "
                            "rows are the sum's contraction; multiply lhs's rows before quantizing it")
        if not isinstance(scale, torch.Tensor) or scale.shape != (rows,) or scale.dtype != torch.float32 \
                or scale.device != lhs.device:
            raise ValueError(f"scale must be a float32 tensor of shape ({rows},) on {lhs.device}, "
                             f"got {common.describe(scale)}")
    n, k = lhs.shape[1], rhs.shape[1]
    scales = (scaling.wgrad_scales("grouped_wgrad", rows, groups, experts, n, k, lhs_scale, rhs_scale,
                                   fast_accum=use_fast_accum) if scaled else None)
    if out is None:
        out = torch.empty((experts, n, k), dtype=dtype, device=lhs.device)
    elif tuple(out.shape) != (experts, n, k) or out.dtype != dtype or out.device != lhs.device \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor [E, N, K] = [{experts}, {n}, {k}] on "
                         f"{lhs.device}, got {common.describe(out)}")
    interp = common.interpreting()
    config = config or choose_wgrad_config(lhs.dtype, interpreter=interp)
    if not isinstance(config, WgradConfig):
        raise TypeError(f"config must be a WgradConfig, got {type(config).__name__}")
    if scales is not None and scales.kernel_mode == "block" and scaling.BLOCK % config.block_r:
        raise ValueError(f"grouped_wgrad: blockwise scales need WgradConfig.block_r to divide {scaling.BLOCK}, "
                         f"got {config.block_r}")
    if common.debug_mode():
        _check_offsets(offsets, rows, 16 if scaled else 1)
    if n == 0 or k == 0:
        return out
    if lhs.device.type == "cpu" and not interp:
        raise RuntimeError("grouped_wgrad on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    target = out
    if interp and dtype == torch.bfloat16:  # the interpreter's bfloat16 is wrong: float32, rounded once
        target = torch.empty(out.shape, dtype=torch.float32)
        if not scaled:
            lhs, rhs = lhs.float(), rhs.float()
    if lhs.dtype == torch.float32:
        precision = "tf32" if (lhs.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    bn, bk, br, warps, stages = config.block_n, config.block_k, config.block_r, config.num_warps, config.num_stages
    grid = (experts * triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    scale_tensors = (target, target) if scales is None else (scales.lhs, scales.rhs)
    scale_strides = (0, 0, 0, 0) if scales is None else (*scales.lhs_strides, *scales.rhs_strides)
    with torch.cuda.device(lhs.device) if lhs.is_cuda else contextlib.nullcontext():
        grouped_wgrad_kernel[grid](
            lhs, offsets if lhs_rows is None else lhs_rows, rhs, offsets if rhs_rows is None else rhs_rows,
            target if scale is None else scale, offsets, target, *scale_tensors, experts, sources, n, k,
            *lhs.stride(), *rhs.stride(), target.stride(0), target.stride(1), *scale_strides,
            BN=bn, BK=bk, BR=br, S_BLOCK=triton.next_power_of_2(sources), L_GATHER=lhs_rows is not None,
            R_GATHER=rhs_rows is not None, HAS_SCALE=scale is not None, PRECISION=precision,
            SCALING=None if scales is None else scales.kernel_mode, ALIGNED=scaled, num_warps=warps, num_stages=stages)
    if target is not out:
        out.copy_(target)
    return out


def _check_float8(lhs, rhs, lhs_scale, rhs_scale) -> bool:
    """Whether this is a float8 call, after refusing mixed operands, missing scales and scales without float8."""
    return scaling.check_operands("grouped_wgrad", lhs, rhs, lhs_scale, rhs_scale, names=("lhs", "rhs"),
                                  shapes="tileweave.ops.compute.scaling.wgrad_scales for their shapes")


def _rows(lhs: torch.Tensor, rhs: torch.Tensor, lhs_rows, rhs_rows) -> int:
    """P, the rows of the sum, after checking the indices against the operands."""
    rows = None
    for name, idx in (("lhs_rows", lhs_rows), ("rhs_rows", rhs_rows)):
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
    return rows


def _check_offsets(offsets: torch.Tensor, rows: int, multiple: int) -> None:
    values = offsets.cpu()
    if values[0] != 0 or values[-1] > rows or bool((values[1:] < values[:-1]).any()) or bool((values % multiple).any()):
        raise ValueError(f"grouped_wgrad: offsets must start at 0, not decrease, end at most at P = {rows}"
                         + (f" and be multiples of {multiple} (float8)" if multiple > 1 else "")
                         + f"; got {values.tolist()}")
