"""The TP MoE layer's expert MLP in float8 (``TPMoE(fp8=...)``): all six grouped GEMMs, the forward
pair, both input gradients and both weight gradients, on float8 operands cast by a ``Float8Recipe``
(``tileweave.nn.fp8``): the first four on the MoE pair's FP8 forms, the weight gradients on
``grouped_wgrad``'s.

Shapes per rank as in ``tileweave.nn.moe_autograd`` (W ranks, T tokens, E experts, top-k k, P = T*k
plan rows, F_loc = F/W, ``w0 [E, 2*F_loc, H]``, ``w1 [E, H, F_loc]``). ``q(.)``: float8 with its
scales, quantized along its GEMM's contraction; ``qt(.)``: the plan rows of a tensor quantized along
each expert's tokens (``Float8Recipe.expert_tokens``), the contraction of a weight gradient.

==============  ===================================================  =====================================
GEMM            computation                                          operands (format, scaling)
==============  ===================================================  =====================================
layer 0         ``gate | up = AG(q(x_shard))[tok] @ q(w0[e]).T``,    x e4m3 along H; w0 e4m3 along H
                ``q(h) = q(silu(gate) * up)`` (epilogue)
layer 1         ``out = RS(sum_j wt * q(h)[p] @ q(w1[e]).T)``        h e4m3 along F_loc; w1 e4m3 along F_loc
dgrad layer 1   ``G = AG(q(dO))[tok] @ q(w1[e])``                    dO grad format along H; w1 e4m3 along H
dgrad layer 0   ``dx_shard = RS(sum_j q(dy)[p] @ q(w0[e]))``         dy grad format along 2*F_loc; w0 e4m3
                                                                     along 2*F_loc
wgrad w1        ``dw1[e] = sum_p qt(AG(q(dO))[tok]).T qt(wt*h)[p]``  dO grad format, ``wt * h`` e4m3, each
                                                                     along e's tokens
wgrad w0        ``dw0[e] = sum_p qt(dy)[p].T qt(AG(q(x))[tok])``     dy grad format, x e4m3, each along
                                                                     e's tokens
==============  ===================================================  =====================================

Scalings per recipe (``Float8Recipe.scaling``):

=========================  ===========================================  ====================================
recipe                     forward and input gradients                  weight gradients (both operands)
=========================  ===========================================  ====================================
tensorwise (torchao)       one scale per activation or gradient         one scale per operand (``dy``'s
                           tensor, one per stacked weight (shared by    reused from its input-gradient
                           its experts); gradients in ``grad_dtype``    cast); gradients in ``grad_dtype``
                           (e5m2 in the preset)
rowwise (torchao)          one per row along the contraction (per       one per expert and feature, over
                           token or plan row, per expert's output       the expert's tokens from every rank
                           feature), powers of two in the preset        (torchao's MoE recipe: torch's
                                                                        ``_scaled_grouped_mm`` 2d-2d scales)
blockwise (DeepSeek-V3)    1 x 128 blocks of activations and            one per 128 tokens of a (source
                           gradients, 128 x 128 blocks of each          rank, expert) group and feature: 128
                           expert's weight; H and F_loc multiples of    x 1 tiles, a group's last one padded
                           128                                          with zeros
=========================  ===========================================  ====================================

The weights are quantized from the master weights at each forward and backward (in both orientations: the
input gradients contract over the other dimension; the backward's casts read each expert's weight
transposed through its strides, no transposed copy is made, and tensorwise reuses the forward's scale),
each expert's 128 x 128 blocks on its own, all experts in one launch. A weight
gradient's operands are the plan rows of each expert, the rows of ``x`` and ``dO`` gathered by token:
``x`` and ``dO`` are the float8 rows that the forward and the input gradient moved (half the bytes of
bf16), dequantized and quantized again along the tokens (DeepSeek-V3's requantization), ``dy`` and
``wt * h`` (the SwiGLU pass's outputs, in the model's dtype) are quantized once. Each is written K-major
in plan order, every group of rows padded with zero rows to a multiple of 16 (``quantize_segments``):
``[features, P + 15 G]`` bytes, made just before its GEMM and dropped after it (a token's row once per
expert it is routed to, k times the gathered ``[T, H]``). ``h`` is cast by layer 0's SwiGLU epilogue
(``Float8Recipe.swiglu_epilogue``) from the float32 values it computes, never written in the model's
dtype (the backward recomputes ``h`` from the pre-activations); tensorwise takes a cast launch after the
GEMM. Master weights, their gradients (the weight-gradient GEMMs write the parameters' dtype) and the optimizer state stay in the parameters' dtype; routing and the routing weights' gradient
(``<G[p], h[p]>``) in float32 as in the unquantized layer. Kept for the backward: the gathered float8
``x [T, H]`` and its scales (or this rank's shard, gathered again in float8 with ``save_gathered=False``)
and the pre-activations ``[P, 2*F_loc]``.
"""

from __future__ import annotations

import torch

from tileweave.nn.fp8 import Float8Recipe, cached_weight_cast
from tileweave.nn.moe_autograd import gather_rows, reduce_scatter_rows, row_weights
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.quantize import Segments
from tileweave.ops.compute.swiglu import swiglu_grad
from tileweave.ops.moe import MoEPlan


def quantize_experts(recipe: Float8Recipe, w: torch.Tensor, *, transpose: bool = False,
                     scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(b [E, K, N], scale_b, scale)`` of a stacked ``nn.Linear`` weight ``w [E, N, K]`` quantized along
    K, as the grouped GEMM takes them (``b`` is the transpose view of the float8 ``[E, N, K]``; ``scale_b``
    ``[E]``, ``[E, 1, N]`` or ``[E, K/128, N/128]``), and the cast's own scale. ``transpose``: ``w [E, K,
    N]``, each expert's transpose quantized, read through its strides in the same pass (an input
    gradient's operand); ``scale``: tensorwise, the scale to cast with (the other orientation's: the
    amax is the same), no amax pass."""
    q = cached_weight_cast(recipe, w, ("experts", transpose), lambda: recipe.rhs(w, transpose=transpose, scale=scale))
    e, n, _ = q.data.shape
    data = q.data.transpose(1, 2)
    if recipe.scaling == "tensorwise":
        return data, q.scale.reshape(1).expand(e), q.scale
    if recipe.scaling == "rowwise":
        return data, q.scale.view(e, 1, n), q.scale
    return data, q.scale.transpose(1, 2), q.scale


def _gather_fp8(x8: torch.Tensor, scales: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x8.shape[0]
    if scales.dim() < 2 or scales.shape[0] != rows:  # a tensorwise scale travels on every row
        scales = scales.reshape(1, 1).expand(rows, 1)
    return gather_rows(x8.view(torch.uint8), group).view(x8.dtype), gather_rows(scales.contiguous(), group)


class FusedExpertsFP8(torch.autograd.Function):
    """The expert MLP with the SwiGLU fused into layer 0, in float8 (module docstring): ``out_shard [T/W,
    H]`` from ``x_shard [T/W, H]``, ``w0``, ``w1``, ``topk_weights_shard [T/W, k]`` (fp32), in
    ``x_shard``'s dtype. ``grad_enabled``: as ``FusedExperts``'s."""

    @staticmethod
    def forward(ctx, x_shard, w0, w1, topk_weights_shard, plan: MoEPlan, group, ops, save_gathered: bool,
                recipe: Float8Recipe, grad_enabled: bool = True):
        dtype = x_shard.dtype
        grads = grad_enabled and any(ctx.needs_input_grad[:4])
        fast = recipe.forward_fast_accum
        qx = recipe.lhs(x_shard)
        b0, s0, w0_scale = quantize_experts(recipe, w0)
        pre = x_shard.new_empty((plan.rows, w0.shape[1])) if grads else None
        keep = grads and save_gathered and ctx.needs_input_grad[1]
        # Layer 0's epilogue writes q(h) from its float32 values: h is never written in the model's dtype.
        result = ops.layer0(qx.data, b0, plan, group, keep, epilogue=recipe.swiglu_epilogue(pre), scale_a=qx.scale,
                            scale_b=s0, out_dtype=dtype, use_fast_accum=fast)
        qh, gathered, gathered_scales = result if keep else (result, None, None)
        b1, s1, w1_scale = quantize_experts(recipe, w1)
        out = ops.layer1(qh.data, b1, plan, topk_weights_shard, group, scale_a=qh.scale, scale_b=s1, out_dtype=dtype,
                         use_fast_accum=fast)
        ctx.plan, ctx.group, ctx.ops, ctx.keep, ctx.recipe = plan, group, ops, keep, recipe
        # tensorwise: the backward casts each weight transposed with the forward's scale
        ctx.weight_scales = (w0_scale, w1_scale) if recipe.scaling == "tensorwise" else (None, None)
        if grads:
            if keep:
                ctx.save_for_backward(gathered, gathered_scales, w0, w1, topk_weights_shard, pre)
            else:
                ctx.save_for_backward(qx.data, qx.scale, w0, w1, topk_weights_shard, pre)
        return out

    @staticmethod
    def backward(ctx, dout_shard):
        x8, x_scales, w0, w1, weights_shard, pre = ctx.saved_tensors
        plan, group, ops, recipe = ctx.plan, ctx.group, ctx.ops, ctx.recipe
        dtype, e, fast = pre.dtype, plan.num_experts, recipe.backward_fast_accum
        wrow = row_weights(plan, gather_rows(weights_shard, group))
        qdo = recipe.lhs(dout_shard.contiguous(), grad=True)
        w0_scale, w1_scale = ctx.weight_scales
        b1t, s1t, _ = quantize_experts(recipe, w1, transpose=True, scale=w1_scale)  # w1 [E, H, F_loc] along H
        g, dout8, dout_scales = ops.layer0(qdo.data, b1t, plan, group, True, scale_a=qdo.scale, scale_b=s1t,
                                           out_dtype=dtype, use_fast_accum=fast)
        dy, h_scaled, row_dot = swiglu_grad(g, pre, wrow)
        del g
        dweights = None
        if ctx.needs_input_grad[3]:
            dweights = reduce_scatter_rows(row_dot[plan.pair_row.long()], group).to(weights_shard.dtype)
        dw1 = None
        if ctx.needs_input_grad[2]:  # the gathered float8 dO requantized along the tokens, and wt * h
            lhs = recipe.expert_tokens(dout8, plan.offsets, e, grad=True, rows=plan.row_token, x_scale=dout_scales)
            dw1 = expert_wgrad(recipe, lhs, recipe.expert_tokens(h_scaled, plan.offsets, e), e, w1.dtype)
        del h_scaled
        qdy = None
        dx_shard = None
        if ctx.needs_input_grad[0]:
            qdy = recipe.lhs(dy, grad=True)
            b0t, s0t, _ = quantize_experts(recipe, w0, transpose=True, scale=w0_scale)  # w0 along 2*F_loc
            dx_shard = ops.layer1(qdy.data, b0t, plan, None, group, scale_a=qdy.scale, scale_b=s0t, out_dtype=dtype,
                                  use_fast_accum=fast)
        dw0 = None
        if ctx.needs_input_grad[1]:
            # dy along the tokens (tensorwise: its input-gradient cast's scale), the gathered float8 x requantized
            reuse = qdy.scale if qdy is not None and recipe.scaling == "tensorwise" else None
            lhs = recipe.expert_tokens(dy, plan.offsets, e, grad=True, scale=reuse)
            del dy
            if not ctx.keep:
                x8, x_scales = _gather_fp8(x8, x_scales, group)
            rhs = recipe.expert_tokens(x8, plan.offsets, e, rows=plan.row_token, x_scale=x_scales)
            dw0 = expert_wgrad(recipe, lhs, rhs, e, w0.dtype)
        return dx_shard, dw0, dw1, dweights, None, None, None, None, None, None


def expert_wgrad(recipe: Float8Recipe, lhs: Segments, rhs: Segments, experts: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``dw [E, N, K]``, ``dw[e] = sum over the plan rows p of expert e of lhs[p].T rhs[p]``, of two float8
    operands quantized along the tokens (``Float8Recipe.expert_tokens``: ``lhs.data [N, P16]``, ``rhs.data
    [K, P16]``): one ``grouped_wgrad`` launch, fp32 accumulation, written in ``dtype`` (the weight's)."""
    return grouped_wgrad(lhs.data.t(), rhs.data.t(), lhs.offsets, experts=experts, lhs_scale=lhs.scale,
                         rhs_scale=rhs.scale, out_dtype=dtype, use_fast_accum=recipe.backward_fast_accum)
