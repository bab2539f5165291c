"""The TP linears' forward and backward in float8: the three GEMMs of each layer on the fused ops'
FP8 forms, with operands cast by a ``Float8Recipe`` (``tileweave.nn.fp8``: which tensor, which
format, which scaling). Shapes per rank, W ranks, M tokens over the group.

ColumnParallelLinear, weight ``w [N/W, K]``, ``x_shard [M/W, K]``:

=========  =================================================  ==================================
pass       computation (q(.): float8 with its scales)         op
=========  =================================================  ==================================
forward    ``y [M, N/W] = AG_M(q(x_shard)) @ q(w).T + b``     AllGather+GEMM, float8 rows travel
dgrad      ``dx_shard [M/W, K] = RS_M(q(dy) @ q(w))``         GEMM+ReduceScatter
wgrad      ``dw [N/W, K] = q(dy).T @ q(AG_M(q(x_shard)))``    GEMM; the gathered float8 rows kept
                                                              from the forward, quantized again;
                                                              ``save_gathered=False``:
                                                              ``q(dy).T @ q(AG_M(x_shard))``, the
                                                              input gathered again in backward
=========  =================================================  ==================================

RowParallelLinear, weight ``w [N, K/W]``, ``x [M, K/W]``:

=========  =================================================  ==================================
pass       computation                                        op
=========  =================================================  ==================================
forward    ``y_shard [M/W, N] = RS_M(q(x) @ q(w).T) + b``     GEMM+ReduceScatter
dgrad      ``dx [M, K/W] = AG_M(q(dy_shard)) @ q(w)``         AllGather+GEMM, float8 rows travel
wgrad      ``dw [N, K/W] = q(AG_M(q(dy_shard))).T @ q(q(x))`` GEMM on the gathered float8 ``dy``
                                                              and the forward's float8 ``x``,
                                                              each quantized again
=========  =================================================  ==================================

With a producer of the input fused in (``tileweave.nn.fused_inputs``), the column layer's ``q(x_shard)``
is ``q(rms_norm(x_shard))`` written by the norm's kernel, and the row layer's ``q(x)`` is ``q(silu(gate) *
up)`` of ``x = gate | up`` written by the SwiGLU's kernel; their backward turns the input gradient
above into the producer's. The weight gradient then takes the forward's float8 operand, requantized:
with ``save_gathered=False`` the column layer's backward casts ``q(rms_norm(x_shard))`` again with the
norm's kernel (the same bits) and gathers that, ``q(dy).T @ q(AG_M(q(rms_norm(x_shard))))`` either way.
Each ``q`` quantizes along its GEMM's contraction (the recipe's table); a transposed operand is
quantized in its own orientation, read in place. The weight is quantized each step from the master
weight (forward: along K; dgrad: along N, the weight read transposed); the blockwise recipe's forward
cast writes both (``Float8Recipe.keep_weight_transpose``: the same 128 x 128 blocks) and keeps the
dgrad's for the backward; the tensorwise recipe reuses the forward's weight scale and the dgrad's
gradient scale where the backward needs the transpose.
Outputs are in ``out_dtype`` (the input's dtype, or autocast's), ``dx`` in the input's dtype, ``dw``
in the weight's: master weights and their gradients never pass through a lower precision. All three
GEMMs run on the layer's ``TPOps``: the two with communication on its ``all_gather_gemm`` and
``gemm_reduce_scatter``, the weight gradient on its ``matmul``.
"""

from __future__ import annotations

import torch
from torch import nn

from tileweave.nn.fp8 import Float8Recipe, cached_weight_cast
from tileweave.nn.fused_inputs import norm_eps, rms_norm_backward, swiglu_backward
from tileweave.nn.tp_ops import start_gather
from tileweave.ops.compute.quantize import Quantized


def _wgrad(ops, recipe: Float8Recipe, qa, qb, out_dtype: torch.dtype) -> torch.Tensor:
    """``qa @ qb.T`` of two K-major float8 operands (``Quantized``) on ``ops.matmul``: the weight gradient."""
    return ops.matmul(qa.data, qb.data.t(), scale_a=qa.scale, scale_b=qb.scale.t(), out_dtype=out_dtype,
                      use_fast_accum=recipe.backward_fast_accum)


def _tensor_scale(recipe: Float8Recipe, q) -> torch.Tensor | None:
    """A tensorwise scale to reuse for the transpose of the same tensor; None for the other scalings,
    whose transposed operands have scales of their own."""
    return q.scale if recipe.scaling == "tensorwise" else None


def _kept(qwt) -> tuple:
    """What the forward keeps of the input gradient's weight operand (``Float8Recipe.weights``): its data
    and scales, or two Nones."""
    return (None, None) if qwt is None else (qwt.data, qwt.scale)


def _weight_t(recipe: Float8Recipe, weight, w_scale, data, scale):
    """The input gradient's weight operand: the one the forward kept, else cast now."""
    if data is not None:
        return Quantized(data, scale)
    return cached_weight_cast(recipe, weight, "rhs transposed",
                              lambda: recipe.rhs(weight, transpose=True, scale=w_scale))


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(dtype)


class ColumnParallelFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, norm_weight, group, save_gathered, ops, recipe: Float8Recipe, out_dtype,
                norm_eps):
        # norm_eps not None: x_shard is the input of an RMSNorm (weight norm_weight, or none), fused into the cast
        rstd = None
        if norm_eps is None:
            qx = recipe.lhs(x_shard)
        else:
            qx, rstd, _ = recipe.normed_lhs(x_shard, norm_weight, norm_eps)
        qw, qwt = recipe.weights(weight)
        fp8 = dict(scale_a=qx.scale, scale_b=qw.scale.t(), out_dtype=out_dtype,
                   use_fast_accum=recipe.forward_fast_accum)
        norm_saved = (x_shard, norm_weight, rstd) if norm_eps is not None else (None, None, None)
        if save_gathered:
            y, gathered, gathered_scales = ops.all_gather_gemm(qx.data, qw.data.t(), group, bias=_bias(bias, out_dtype),
                                                               return_gathered=True, **fp8)
            ctx.save_for_backward(gathered, gathered_scales, weight, _tensor_scale(recipe, qw), *_kept(qwt),
                                  *norm_saved)
        else:  # gathered again in backward: the input, or with a norm its float8 rows, cast again from its input
            y = ops.all_gather_gemm(qx.data, qw.data.t(), group, bias=_bias(bias, out_dtype), **fp8)
            ctx.save_for_backward(x_shard if norm_eps is None else None, None, weight, _tensor_scale(recipe, qw),
                                  *_kept(qwt), *norm_saved)
        ctx.group, ctx.ops, ctx.recipe, ctx.save_gathered = group, ops, recipe, save_gathered
        ctx.x_dtype, ctx.bias_dtype = x_shard.dtype, None if bias is None else bias.dtype
        ctx.norm, ctx.norm_eps = norm_eps is not None, norm_eps
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, saved_scales, weight, w_scale, wt_data, wt_scale, x_norm_in, norm_weight, rstd = ctx.saved_tensors
        recipe = ctx.recipe
        dy = dy.contiguous()
        pending = None if ctx.save_gathered else _regather(ctx, saved, x_norm_in, norm_weight)
        qdy, qdyt = recipe.grads(dy)
        qwt = _weight_t(recipe, weight, w_scale, wt_data, wt_scale)
        dx_shard = ctx.ops.gemm_reduce_scatter(qdy.data, qwt.data.t(), ctx.group, scale_a=qdy.scale,
                                               scale_b=qwt.scale.t(), out_dtype=ctx.x_dtype,
                                               use_fast_accum=recipe.backward_fast_accum)
        if pending is None:  # the forward's gathered float8 rows, quantized again along the tokens
            qxt = recipe.rhs(saved, transpose=True, tokens=True, x_scale=saved_scales)
        else:  # the input in its dtype, quantized once; or float8 rows with their scales, quantized again
            qxt = recipe.rhs(pending.wait(), transpose=True, tokens=True, x_scale=pending.gathered_scales)
            pending.release()
        dw = _wgrad(ctx.ops, recipe, qdyt, qxt, weight.dtype)
        db = None if ctx.bias_dtype is None else dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        dnorm = None
        if ctx.norm:  # dx_shard so far is the gradient of the norm's output
            dx_shard, dnorm = rms_norm_backward(dx_shard, x_norm_in, norm_weight, rstd)
        return dx_shard, dw, db, dnorm, None, None, None, None, None, None


def _regather(ctx, x_shard, x_norm_in, norm_weight):
    """Start gathering the weight gradient's activation again (``save_gathered=False``): the input in its
    own dtype; with a fused norm, whose output was never written in high precision, the forward's float8
    rows, cast again by the norm's kernel from the norm's input (kept for the norm's backward anyway; the
    kernel's fixed formula gives the forward's rows and scales bit for bit), with their scales."""
    if not ctx.norm:
        return start_gather(ctx.ops, x_shard, ctx.group)
    q = ctx.recipe.normed_lhs(x_norm_in, norm_weight, ctx.norm_eps).q
    rows = q.data.shape[0]
    scales = q.scale.reshape(1, 1).expand(rows, 1) if q.scale.dim() == 0 else q.scale  # the gathered form
    return start_gather(ctx.ops, q.data, ctx.group, scales=scales.contiguous())


class RowParallelFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, ops, recipe: Float8Recipe, out_dtype, swiglu):
        # swiglu: x is gate | up, and silu(gate) * up is computed by the kernel that casts it
        qx = recipe.swiglu_lhs(*x.chunk(2, dim=1)) if swiglu else recipe.lhs(x)
        qw, qwt = recipe.weights(weight)
        y_shard = ops.gemm_reduce_scatter(qx.data, qw.data.t(), group, bias=_bias(bias, out_dtype), scale_a=qx.scale,
                                          scale_b=qw.scale.t(), out_dtype=out_dtype,
                                          use_fast_accum=recipe.forward_fast_accum)
        ctx.save_for_backward(qx.data, qx.scale, weight, _tensor_scale(recipe, qw), *_kept(qwt),
                              x if swiglu else None)
        ctx.group, ctx.ops, ctx.recipe, ctx.swiglu = group, ops, recipe, swiglu
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return y_shard

    @staticmethod
    def backward(ctx, dy_shard):
        x8, x_scale, weight, w_scale, wt_data, wt_scale, gate_up = ctx.saved_tensors
        recipe = ctx.recipe
        qdy = recipe.lhs(dy_shard.contiguous(), grad=True)
        qwt = _weight_t(recipe, weight, w_scale, wt_data, wt_scale)
        dx, gathered, gathered_scales = ctx.ops.all_gather_gemm(
            qdy.data, qwt.data.t(), ctx.group, return_gathered=True, scale_a=qdy.scale, scale_b=qwt.scale.t(),
            out_dtype=ctx.x_dtype, use_fast_accum=recipe.backward_fast_accum)
        # Both operands of the weight gradient quantized again along the tokens, from float8.
        qdyt = recipe.lhs(gathered, grad=True, transpose=True, tokens=True, x_scale=gathered_scales)
        qxt = recipe.rhs(x8, transpose=True, tokens=True, x_scale=x_scale)
        dw = _wgrad(ctx.ops, recipe, qdyt, qxt, weight.dtype)
        # The bias is added once, on the owner of each row: its gradient sums every row of dy, here the
        # gathered float8 rows (the only whole dy this rank has), dequantized, in fp32.
        db = None if ctx.bias_dtype is None else dequantize_rows(gathered, gathered_scales).sum(0).to(ctx.bias_dtype)
        if ctx.swiglu:  # dx so far is the gradient of the SwiGLU's output
            dx = swiglu_backward(dx, gate_up)
        return dx, dw, db, None, None, None, None, None


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scales`` of float8 rows with scales in the gathered form (``[M, 1]``, or ``[M, K/128]``
    per 1 x 128 block)."""
    if scales.shape[1] > 1:
        scales = scales.repeat_interleave(q.shape[1] // scales.shape[1], dim=1)
    return q.float() * scales


def out_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype of an FP8 layer's output: autocast's where it is on, else the input's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def column_parallel(x_shard, weight, bias, group, save_gathered: bool, ops, recipe: Float8Recipe, *,
                    norm: nn.RMSNorm | None = None) -> torch.Tensor:
    """``ColumnParallelFP8`` outside autocast (the layer casts nothing: the quantization reads each
    tensor in its own dtype); ``norm``: an RMSNorm to apply to ``x_shard`` first, fused into its cast."""
    out_dtype = out_dtype_of(x_shard)
    norm_weight, eps = (None, None) if norm is None else (norm.weight, norm_eps(norm, x_shard))
    with torch.autocast(x_shard.device.type, enabled=False):
        return ColumnParallelFP8.apply(x_shard, weight, bias, norm_weight, group, save_gathered, ops, recipe, out_dtype,
                                       eps)


def row_parallel(x, weight, bias, group, ops, recipe: Float8Recipe, *, swiglu: bool = False) -> torch.Tensor:
    """``RowParallelFP8`` outside autocast; ``swiglu``: ``x`` is ``gate | up`` and the layer's input is
    ``silu(gate) * up``, computed by the kernel that casts it."""
    out_dtype = out_dtype_of(x)
    with torch.autocast(x.device.type, enabled=False):
        return RowParallelFP8.apply(x, weight, bias, group, ops, recipe, out_dtype, swiglu)
