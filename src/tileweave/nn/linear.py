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

The layers run on the ops of a ``TPOps`` (tileweave's fused ops by default, ``TILEWEAVE_OPS``): pass
other ops to the constructor, or set the ``ops`` attribute, to run the same layer on, say, NCCL and
cuBLAS. The column layer keeps the gathered input for its weight gradient (``save_gathered=True``, memory
``[M, K]``) or gathers it again in backward (``False``), on the copy engines while the input-gradient
GEMM+ReduceScatter runs. Every rank must run the same layers in the same order, forward and backward,
like any collective.

FP8 training: ``fp8=`` a ``Float8Recipe`` (``tileweave.nn.fp8``: ``"tensorwise"``, ``"rowwise"``,
``"blockwise"``) runs all three GEMMs of each layer in float8, on the same ops, with the operands
quantized on the device each step (``tileweave.nn.fp8_linear``: the tables of what is quantized where);
the parameters stay in their dtype. None (the default): no float8 anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tileweave.nn import fp8_linear, fused_inputs, inference
from tileweave.nn.checkpoint import Reader, check_unused, dict_reader
from tileweave.nn.fp8 import Float8Recipe, resolve
from tileweave.nn.shards import from_rank_major, gather_shards, to_rank_major
from tileweave.nn.tp_ops import TILEWEAVE_OPS, TPOps, gather_for_weight_grad, start_gather


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Under autocast, run in the autocast dtype: the fused ops take one dtype for all operands. The
    casts are autograd ops, so gradients reach fp32 parameters in fp32."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def _run(call, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> torch.Tensor:
    """``call(x, weight, bias, *args)`` in the autocast dtype, if autocast is on: an autograd
    Function's ``apply`` or a function of ``tileweave.nn.inference``."""
    x, weight, bias = _autocast(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        return call(x, weight, bias, *args)


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, save_gathered, ops):
        if save_gathered:
            y, gathered = ops.all_gather_gemm(x_shard, weight.t(), group, bias=bias, return_gathered=True)
        else:  # the gathered input is not kept: do not copy it out of the op's workspace either
            y, gathered = ops.all_gather_gemm(x_shard, weight.t(), group, bias=bias), None
        ctx.group, ctx.has_bias, ctx.save_gathered, ctx.ops = group, bias is not None, save_gathered, ops
        ctx.save_for_backward(gathered if save_gathered else x_shard, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        # Without the saved gathered input, gather it again while the input gradient runs: on the copy
        # engines (no SMs, so nothing competes with a fused kernel spinning on its peers, unlike an
        # NCCL kernel would), into the all-gather op's own buffer, released after the weight gradient.
        pending = None if ctx.save_gathered else start_gather(ctx.ops, saved, ctx.group)
        dx_shard = ctx.ops.gemm_reduce_scatter(dy, weight, ctx.group)
        gathered = saved if pending is None else pending.wait()
        dw = dy.t() @ gathered
        if pending is not None:
            pending.release()
        db = dy.sum(0) if ctx.has_bias else None
        return dx_shard, dw, db, None, None, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, ops):
        y_shard = ops.gemm_reduce_scatter(x, weight.t(), group, bias=bias)
        ctx.group, ctx.has_bias, ctx.ops = group, bias is not None, ops
        ctx.save_for_backward(x, weight)
        return y_shard

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        dx, dy = gather_for_weight_grad(ctx.ops, dy_shard.contiguous(), weight, ctx.group)
        dw = dy.t() @ x
        # The bias is added once, on the owner of each row: its gradient sums every row of dy.
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


def all_gather_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      group: dist.ProcessGroup | None = None, *, save_gathered: bool = True,
                      ops: TPOps | None = None, fp8: Float8Recipe | str | None = None,
                      norm: nn.RMSNorm | None = None) -> torch.Tensor:
    """``ColumnParallelLinear``'s computation on given shards, differentiable: ``y [M, N/W] =
    AG_M(x_shard_m [M/W, K]) @ weight.T + bias``, with ``weight`` this rank's rows ``[N/W, K]`` and
    ``bias [N/W]`` (forward and backward in the module docstring). ``ops``: the communication GEMMs
    (None: tileweave's); ``fp8``: a recipe, as the layer's; ``norm``: as the layer's ``forward``.
    Collective over ``group``, like the layer."""
    group = group if group is not None else dist.group.WORLD
    recipe = resolve(fp8)
    if norm is not None:
        fused_inputs.check_norm("all_gather_linear", norm, x_shard)
    if recipe is not None:
        recipe.check_features("all_gather_linear", {"K": weight.shape[1], "N/W": weight.shape[0]})
        return fp8_linear.column_parallel(x_shard, weight, bias, group, save_gathered, ops or TILEWEAVE_OPS, recipe,
                                          norm=norm)
    if norm is not None:
        x_shard = norm(x_shard)
    return _run(_ColumnParallel.apply, x_shard, weight, bias, group, save_gathered, ops or TILEWEAVE_OPS)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          group: dist.ProcessGroup | None = None, *, ops: TPOps | None = None,
                          fp8: Float8Recipe | str | None = None, swiglu: bool = False) -> torch.Tensor:
    """``RowParallelLinear``'s computation on given shards, differentiable: ``y_shard_m [M/W, N] =
    RS_M(x [M, K/W] @ weight.T) + bias``, with ``weight`` this rank's columns ``[N, K/W]`` and the whole
    ``bias [N]``, added once (module docstring); ``fp8``: a recipe, as the layer's; ``swiglu``: as the
    layer's ``forward``. Collective over ``group``, like the layer."""
    group = group if group is not None else dist.group.WORLD
    recipe = resolve(fp8)
    if swiglu:
        fused_inputs.check_swiglu("linear_reduce_scatter", x, weight.shape[1])
    if recipe is not None:
        recipe.check_features("linear_reduce_scatter", {"K/W": weight.shape[1], "N": weight.shape[0]})
        return fp8_linear.row_parallel(x, weight, bias, group, ops or TILEWEAVE_OPS, recipe, swiglu=swiglu)
    if swiglu:
        x = fused_inputs.swiglu(x)
    return _run(_RowParallel.apply, x, weight, bias, group, ops or TILEWEAVE_OPS)


class _TPLinear(nn.Module):
    """What both TP linears hold: the group, the ops, the FP8 recipe, and this rank's shard of an
    ``nn.Linear``'s ``weight [out, in]`` (split along ``split_dim``: 0 by output features, 1 by input
    features; kaiming-uniform, as ``nn.Linear``) and ``bias`` (zeros, as many as the local output
    features; None without a bias)."""

    def __init__(self, in_features: int, out_features: int, *, split_dim: int, bias: bool,
                 group: dist.ProcessGroup | None, device, dtype, ops: TPOps | None,
                 sequence_parallel: bool, fp8: Float8Recipe | str | None) -> None:
        super().__init__()
        self.fp8 = resolve(fp8)
        if self.fp8 is not None and not sequence_parallel:
            raise ValueError(f"{type(self).__name__}: fp8 applies to the sequence-parallel layers (training); "
                             "pass sequence_parallel=True or fp8=None")
        self.ops = ops or TILEWEAVE_OPS
        self.sequence_parallel = sequence_parallel
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        shape = [out_features, in_features]
        if shape[split_dim] % self.world:
            name = ("out_features", "in_features")[split_dim]
            raise ValueError(f"{name}={shape[split_dim]} must be divisible by the TP group size {self.world}")
        self.in_features, self.out_features = in_features, out_features
        shape[split_dim] //= self.world
        if self.fp8 is not None:
            self.fp8.check_features(type(self).__name__, {
                "in_features" if split_dim == 0 else "in_features/W": shape[1],
                "out_features/W" if split_dim == 0 else "out_features": shape[0]})
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(shape[0], device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def _fp8_repr(self) -> str:
        return "" if self.fp8 is None else f", fp8={self.fp8.scaling}"

    def _reader(self, state: dict[str, torch.Tensor]) -> Reader:
        # dict_reader over an unsharded state, tensors the layer has no place for refused first
        owner = f"{type(self).__name__}.load_full_state_dict"
        check_unused(state, {"weight"} | ({"bias"} if self.bias is not None else set()), owner)
        return dict_reader(state, owner)


class ColumnParallelLinear(_TPLinear):
    """``nn.Linear(in_features, out_features)`` split by output features over a TP group, with
    sequence-parallel input: takes ``x_shard_m [M/W, in]`` (or ``[B, S/W, in]``), returns ``[M, out/W]``
    (or ``[B, S, out/W]``). See the module docstring for forward and backward.
    ``sequence_parallel=False``: replicated input ``x [M, in]`` instead (``tileweave.nn.inference``)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 group: dist.ProcessGroup | None = None, save_gathered: bool = True,
                 device=None, dtype=None, ops: TPOps | None = None, sequence_parallel: bool = True,
                 fp8: Float8Recipe | str | None = None) -> None:
        """``ops``: the communication GEMMs to run on (``TPOps``; None: ``TILEWEAVE_OPS``); ``fp8``: the
        FP8 recipe of its three GEMMs (``tileweave.nn.fp8``), or None (no float8). With ``fp8`` the kept
        gathered input is the forward's float8 rows (``[M, K]`` bytes); ``save_gathered=False`` gathers
        the input again in its own dtype, or, called with ``norm=``, the forward's float8 rows, cast
        again from the norm's input (the same gradients as ``save_gathered=True``)."""
        super().__init__(in_features, out_features, split_dim=0, bias=bias, group=group, device=device,
                         dtype=dtype, ops=ops, sequence_parallel=sequence_parallel, fp8=fp8)
        self.save_gathered = save_gathered

    def forward(self, x_shard: torch.Tensor, *, norm: nn.RMSNorm | None = None) -> torch.Tensor:
        """``x_shard [M/W, in]`` (rank r's block of the M token rows) -> ``[M, out/W]``; or ``[B, S/W,
        in]`` (positions ``[r*S/W, (r+1)*S/W)`` of every sequence: sharded on the sequence dimension,
        the one before the features) -> ``[B, S, out/W]``. Without sequence parallelism ``[..., in]`` ->
        ``[..., out/W]``.

        ``norm``: an ``nn.RMSNorm`` over the features; the layer then computes ``self(norm(x_shard))``
        and the gradients of both. With ``fp8`` the norm runs in the kernel that casts its output to
        float8 (``tileweave.nn.fp8``: the normalized input is not written in high precision), else
        first, in torch."""
        if norm is not None:
            fused_inputs.check_norm(type(self).__name__, norm, x_shard)
        fused = self.fp8 is not None and self.sequence_parallel
        if norm is not None and not fused:
            x_shard = norm(x_shard)
        flat = x_shard.reshape(-1, x_shard.shape[-1]) if x_shard.dim() > 2 else x_shard
        if not self.sequence_parallel:
            y = _run(inference.column_parallel_linear, flat, self.weight, self.bias, self.group)
            return y.view(*x_shard.shape[:-1], y.shape[-1])
        if fused:
            y = fp8_linear.column_parallel(flat, self.weight, self.bias, self.group, self.save_gathered, self.ops,
                                           self.fp8, norm=norm)
        else:
            y = _run(_ColumnParallel.apply, flat, self.weight, self.bias, self.group, self.save_gathered, self.ops)
        return y if x_shard.dim() <= 2 else from_rank_major(y, self.world, x_shard.shape[:-1], x_shard.dim() - 2)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's rows from an unsharded ``{"weight": [out, in], "bias": [out]}``. Raises
        ``ValueError`` naming a tensor of the wrong shape or one the layer has no place for, ``KeyError``
        for a missing one."""
        read = self._reader(state)
        n = self.weight.shape[0]
        self.weight.copy_(read("weight", (self.out_features, self.in_features), 0, self.rank * n, (self.rank + 1) * n))
        if self.bias is not None:
            self.bias.copy_(read("bias", (self.out_features,), 0, self.rank * n, (self.rank + 1) * n))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (collective: every rank must call it)."""
        out = {"weight": gather_shards(self.weight, 0, self.group)}
        if self.bias is not None:
            out["bias"] = gather_shards(self.bias, 0, self.group)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, tp={self.world}{self._fp8_repr()}")


class RowParallelLinear(_TPLinear):
    """``nn.Linear(in_features, out_features)`` split by input features over a TP group, with
    sequence-parallel output: takes ``x [M, in/W]`` (or ``[B, S, in/W]``), returns ``y_shard_m [M/W,
    out]`` (or ``[B, S/W, out]``). The bias is
    whole on every rank and added once. See the module docstring for forward and backward.
    ``sequence_parallel=False``: returns the replicated ``y [M, out]`` (``tileweave.nn.inference``)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 group: dist.ProcessGroup | None = None, device=None, dtype=None,
                 ops: TPOps | None = None, sequence_parallel: bool = True,
                 fp8: Float8Recipe | str | None = None) -> None:
        """``ops``: the communication GEMMs to run on (``TPOps``; None: ``TILEWEAVE_OPS``); ``fp8``: the
        FP8 recipe of its three GEMMs (``tileweave.nn.fp8``), or None (no float8)."""
        super().__init__(in_features, out_features, split_dim=1, bias=bias, group=group, device=device,
                         dtype=dtype, ops=ops, sequence_parallel=sequence_parallel, fp8=fp8)

    def forward(self, x: torch.Tensor, *, swiglu: bool = False) -> torch.Tensor:
        """``x [M, in/W]`` -> ``y_shard_m [M/W, out]`` (rank r's block of the M token rows); or ``[B, S,
        in/W]`` -> ``[B, S/W, out]`` (positions ``[r*S/W, (r+1)*S/W)`` of every sequence; S divisible
        by W). Without sequence parallelism ``[..., in/W]`` -> ``[..., out]``.

        ``swiglu``: ``x`` is ``gate | up`` (``[..., 2 in/W]``, the two halves of its last dimension) and the
        layer's input is ``silu(gate) * up``. With ``fp8`` the SwiGLU runs in the kernel that casts its
        output to float8 (``tileweave.nn.fp8``), else first, in torch."""
        if swiglu:
            fused_inputs.check_swiglu(type(self).__name__, x, self.weight.shape[1])
            if self.fp8 is None or not self.sequence_parallel:
                x, swiglu = fused_inputs.swiglu(x), False
        if not self.sequence_parallel:
            y = _run(inference.row_parallel_linear, x.reshape(-1, x.shape[-1]), self.weight, self.bias, self.group)
            return y.view(*x.shape[:-1], y.shape[-1])
        if x.dim() <= 2:
            return self._row_parallel(x, swiglu)
        seq = x.shape[-2]
        if seq % self.world:
            raise ValueError(f"RowParallelLinear: x {list(x.shape)} has S={seq} positions per sequence, which "
                             f"do not split over the {self.world} ranks of the TP group")
        y = self._row_parallel(to_rank_major(x, self.world, x.dim() - 2), swiglu)
        return y.view(*x.shape[:-2], seq // self.world, y.shape[-1])

    def _row_parallel(self, x: torch.Tensor, swiglu: bool) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear.row_parallel(x, self.weight, self.bias, self.group, self.ops, self.fp8, swiglu=swiglu)
        return _run(_RowParallel.apply, x, self.weight, self.bias, self.group, self.ops)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's columns from an unsharded ``{"weight": [out, in], "bias": [out]}``. Raises
        ``ValueError`` naming a tensor of the wrong shape or one the layer has no place for, ``KeyError``
        for a missing one."""
        read = self._reader(state)
        n = self.weight.shape[1]
        self.weight.copy_(read("weight", (self.out_features, self.in_features), 1, self.rank * n, (self.rank + 1) * n))
        if self.bias is not None:
            self.bias.copy_(read("bias", (self.out_features,)))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (collective: every rank must call it)."""
        out = {"weight": gather_shards(self.weight, 1, self.group)}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.world}{self._fp8_repr()}")
