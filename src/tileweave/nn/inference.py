"""Tensor-parallel linears on replicated activations (no sequence parallelism): the decode layers.

W ranks; every rank holds the same activation ``x [M, K]`` (M tokens: the batch at decode time).

Column-parallel (QKV, MLP gate/up), weight ``w_shard_n [N/W, K]``:

=========  ============================================  ==============================
pass       computation                                   op
=========  ============================================  ==============================
forward    ``y_shard_n [M, N/W] = x @ w.T + b``          local GEMM
dgrad      ``dx [M, K] = AllReduce_sum(dy @ w)``         GEMM, then all-reduce
wgrad      ``dw [N/W, K] = dy.T @ x``                    local GEMM
=========  ============================================  ==============================

Row-parallel (attention out, MLP down), weight ``w_shard_k [N, K/W]``:

=========  ============================================  ==============================
pass       computation                                   op
=========  ============================================  ==============================
forward    ``y [M, N] = AllReduce_sum(x @ w.T) + b``     ``gemm_all_reduce``
dgrad      ``dx_shard_k [M, K/W] = dy @ w``              local GEMM
wgrad      ``dw [N, K/W] = dy.T @ x_shard_k``            local GEMM
=========  ============================================  ==============================

The row-parallel output is bitwise the same on every rank, so a caller that computes the same loss on
every rank gets the same ``dy`` everywhere, which the backward formulas above assume; the bias is whole
on every rank and added once. Every rank must call the same layers in the same order, like any
collective. ``row_parallel_residual_norm`` is the forward-only form of the row-parallel linear with the
residual add and RMSNorm that follow it in a decoder layer fused into the all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tileweave.nn.fp8_weights import Float8Weight, gemm_operands
from tileweave.ops.functional import gemm_all_reduce


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


class _ReplicatedColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dy @ weight
        # Every rank's output features depend on all of x: the input gradient sums over the ranks.
        dist.all_reduce(dx, group=ctx.group)
        dw = dy.t() @ x
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class _ReplicatedRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return gemm_all_reduce(x, weight.t(), group, bias=bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        db = dy.sum(0) if ctx.has_bias else None
        return dy @ weight, dy.t() @ x, db, None


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, dim: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [M, features], got shape {tuple(x.shape)}")
    if x.shape[1] != weight.shape[dim]:
        raise ValueError(f"{name}: x has {x.shape[1]} features, the weight shard {tuple(weight.shape)} "
                         f"expects {weight.shape[dim]}")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``y_shard_n [M, N/W] = x [M, K] @ weight.T + bias`` with ``weight`` this rank's rows
    ``[N/W, K]`` (``bias [N/W]``), ``x`` the same on every rank. Forward is local (no communication);
    the input gradient is all-reduced over ``group`` (module docstring). Any float dtype."""
    _check("column_parallel_linear", x, weight, 1)
    return _ReplicatedColumn.apply(x, weight, bias, _group(group))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``y [M, N] = sum over ranks of x_shard_k [M, K/W] @ weight.T, + bias [N]`` once, the same on
    every rank, through ``gemm_all_reduce`` (its dtypes: float16, bfloat16, float32). ``weight`` is
    this rank's columns ``[N, K/W]``. The backward is local (module docstring)."""
    _check("row_parallel_linear", x, weight, 1)
    return _ReplicatedRow.apply(x, weight, bias, _group(group))


def row_parallel_residual_norm(x: torch.Tensor, weight: torch.Tensor | Float8Weight, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, group: dist.ProcessGroup | None = None,
                               *, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(h) * norm_weight, h)`` with ``h = residual [M, N] + row_parallel_linear(x, weight,
    bias)``: one ``gemm_all_reduce`` call with the residual add and the RMSNorm fused into its
    reduction (fp32 math, outputs in ``x``'s dtype). ``weight`` may be a ``Float8Weight`` (FP8
    inference: ``x`` is quantized per token on the device and the GEMM runs in float8, the sums, the
    residual and the norm in ``x``'s dtype as before). Forward only: no gradient flows through it."""
    _check("row_parallel_residual_norm", x, weight.data if isinstance(weight, Float8Weight) else weight, 1)
    with torch.no_grad():
        a, b, fp8 = gemm_operands(x, weight)
        return gemm_all_reduce(a, b, _group(group), bias=bias, residual=residual, norm_weight=norm_weight, eps=eps,
                               **fp8)
