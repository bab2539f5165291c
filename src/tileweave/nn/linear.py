"""Tensor-parallel linear layers with sequence parallelism, forward and backward on the fused ops.

W ranks, M tokens over the group, activations between layers sharded by tokens (``x_shard_m``).

ColumnParallelLinear (QKV, MLP up/gate), weight ``w_shard_n [N/W, K]``:

=========  ==========================================  =================================
pass       computation                                 op
=========  ==========================================  =================================
forward    ``y [M, N/W] = AG_M(x_shard_m) @ w.T + b``  AllGather+GEMM (keeps AG_M(x))
dgrad      ``dx_shard_m [M/W, K] = RS_M(dy @ w)``      GEMM+ReduceScatter
wgrad      ``dw [N/W, K] = dy.T @ AG_M(x)``            GEMM on the gathered input
=========  ==========================================  =================================

RowParallelLinear (attention out, MLP down), weight ``w_shard_k [N, K/W]``:

=========  ==========================================  =================================
pass       computation                                 op
=========  ==========================================  =================================
forward    ``y_shard_m [M/W, N] = RS_M(x @ w.T) + b``  GEMM+ReduceScatter
dgrad      ``dx [M, K/W] = AG_M(dy_shard_m) @ w``      AllGather+GEMM (keeps AG_M(dy))
wgrad      ``dw [N, K/W] = AG_M(dy).T @ x``            GEMM on the gathered output grad
=========  ==========================================  =================================

The column layer keeps the gathered input for its weight gradient (``save_gathered=True``, memory
``[M, K]``) or gathers it again in backward (``False``), on the copy engines while the input-gradient
GEMM+ReduceScatter runs. Every rank must run the same layers in the same order, forward and backward,
like any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tileweave.ops.all_gather_gemm import all_gather_gemm
from tileweave.ops.all_gather_gemm import cached_op as cached_all_gather_op
from tileweave.ops import all_gather_gemm as _all_gather_module
from tileweave.ops.gemm_reduce_scatter import gemm_reduce_scatter
from tileweave.nn import inference


def _group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Under autocast, run in the autocast dtype: the fused ops take one dtype for all operands. The
    casts are autograd ops, so gradients reach fp32 parameters in fp32."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def _check_divisible(name: str, value: int, world: int) -> None:
    if value % world:
        raise ValueError(f"{name}={value} must be divisible by the TP group size {world}")


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, save_gathered):
        if save_gathered:
            y, gathered = all_gather_gemm(x_shard, weight.t(), group, bias=bias, return_gathered=True)
        else:  # the gathered input is not kept: do not copy it out of the op's workspace either
            y, gathered = all_gather_gemm(x_shard, weight.t(), group, bias=bias), None
        ctx.group, ctx.has_bias, ctx.save_gathered = group, bias is not None, save_gathered
        ctx.save_for_backward(gathered if save_gathered else x_shard, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        # Without the saved gathered input, gather it again while the input gradient runs: on the copy
        # engines (no SMs, so nothing competes with a fused kernel spinning on its peers, unlike an
        # NCCL kernel would), into the all-gather op's own buffer, released after the weight gradient.
        pending = None if ctx.save_gathered else cached_all_gather_op(ctx.group, saved.device).all_gather(saved)
        dx_shard = gemm_reduce_scatter(dy, weight, ctx.group)
        gathered = saved if pending is None else pending.wait()
        dw = dy.t() @ gathered
        if pending is not None:
            pending.release()
        db = dy.sum(0) if ctx.has_bias else None
        return dx_shard, dw, db, None, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        y_shard = gemm_reduce_scatter(x, weight.t(), group, bias=bias)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return y_shard

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        dx, dy = _gather_for_weight_grad(dy_shard.contiguous(), weight, ctx.group)
        dw = dy.t() @ x
        # The bias is added once, on the owner of each row: its gradient sums every row of dy.
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def _gather_for_weight_grad(dy_shard: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup):
    """``(dy_shard gathered @ weight, dy_shard gathered)`` for a weight gradient that the caller queues
    at once. On tileweave's shared op (outside ``torch.compile``) the gathered tensor is the op's buffer
    itself, lent until this rank's next all-gather call: no copy into a fresh tensor, as the functional
    op makes for callers that keep it."""
    if all_gather_gemm is _all_gather_module.all_gather_gemm and not torch.compiler.is_compiling():
        return cached_all_gather_op(group, dy_shard.device)(dy_shard, weight, return_gathered=True)
    return all_gather_gemm(dy_shard, weight, group, return_gathered=True)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` split by output features over a TP group, with
    sequence-parallel input: takes ``x_shard_m [M/W, in]`` (or ``[..., M/W, in]`` flattened by the
    caller), returns ``[M, out/W]``. See the module docstring for forward and backward.
    ``sequence_parallel=False``: replicated input ``x [M, in]`` instead (``tileweave.nn.inference``)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 group: dist.ProcessGroup | None = None, save_gathered: bool = True,
                 device=None, dtype=None, sequence_parallel: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.group, self.rank, self.world = _group_info(group)
        _check_divisible("out_features", out_features, self.world)
        self.in_features, self.out_features = in_features, out_features
        self.save_gathered = save_gathered
        local = out_features // self.world
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        x_shard, weight, bias = _autocast(x_shard, self.weight, self.bias)
        with torch.autocast(x_shard.device.type, enabled=False):
            if not self.sequence_parallel:
                return inference.column_parallel_linear(x_shard, weight, bias, self.group)
            return _ColumnParallel.apply(x_shard, weight, bias, self.group, self.save_gathered)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's rows from an unsharded ``{"weight": [out, in], "bias": [out]}``."""
        rows = slice(self.rank * self.weight.shape[0], (self.rank + 1) * self.weight.shape[0])
        self.weight.copy_(state["weight"][rows])
        if self.bias is not None:
            self.bias.copy_(state["bias"][rows])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (collective: every rank must call it)."""
        out = {"weight": _gather(self.weight, 0, self.group, self.world)}
        if self.bias is not None:
            out["bias"] = _gather(self.bias, 0, self.group, self.world)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, tp={self.world}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` split by input features over a TP group, with
    sequence-parallel output: takes ``x [M, in/W]``, returns ``y_shard_m [M/W, out]``. The bias is
    whole on every rank and added once. See the module docstring for forward and backward.
    ``sequence_parallel=False``: returns the replicated ``y [M, out]`` (``tileweave.nn.inference``)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 group: dist.ProcessGroup | None = None, device=None, dtype=None,
                 sequence_parallel: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.group, self.rank, self.world = _group_info(group)
        _check_divisible("in_features", in_features, self.world)
        self.in_features, self.out_features = in_features, out_features
        local = in_features // self.world
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = _autocast(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):
            if not self.sequence_parallel:
                return inference.row_parallel_linear(x, weight, bias, self.group)
            return _RowParallel.apply(x, weight, bias, self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's columns from an unsharded ``{"weight": [out, in], "bias": [out]}``."""
        cols = slice(self.rank * self.weight.shape[1], (self.rank + 1) * self.weight.shape[1])
        self.weight.copy_(state["weight"][:, cols])
        if self.bias is not None:
            self.bias.copy_(state["bias"])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (collective: every rank must call it)."""
        out = {"weight": _gather(self.weight, 1, self.group, self.world)}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.world}")


def _gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)
