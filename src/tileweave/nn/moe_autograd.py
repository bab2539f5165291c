"""The autograd Functions of the tensor-parallel MoE layer (``tileweave.nn.moe.TPMoE``): both expert
GEMMs forward and backward on the MoE pair, by duality.

W ranks, T tokens over the group, E experts, top-k k, P = T*k plan rows, hidden H, F_loc = F/W.
``w0 [E, 2*F_loc, H]`` and ``w1 [E, H, F_loc]`` are stacked ``nn.Linear`` weights (``[out, in]`` per
expert); the ops read their transposes in place.

Layer 0, ``y [P, 2*F_loc] = gather(AG(x_shard)) @ w0.T`` (``moe_all_gather_gemm``):

=========  ================================================  ========================================
pass       computation                                       op
=========  ================================================  ========================================
forward    ``y[p] = X[tok(p)] @ w0[e(p)].T``, X = AG(x)      layer 0 (keeps X ``[T, H]`` or not)
dgrad      ``dx_shard [T/W, H] = RS(sum_j dy[p(t,j)] @        layer 1's form with all weights 1
           w0[e])``
wgrad      ``dw0[e] = sum over rows p of e: dy[p].T X[tok]``  grouped GEMM over the plan's rows
=========  ================================================  ========================================

Layer 1, ``out_shard [T/W, H] = RS(sum_j wt[t,j] Z[p(t,j)])``, ``Z[p] = h[p] @ w1[e(p)].T``
(``moe_gemm_reduce_scatter``):

==========  ===============================================  =======================================
pass        computation                                      op
==========  ===============================================  =======================================
forward     as above                                         layer 1
dgrad       ``G [P, F_loc]``, ``G[p] = dO[tok(p)] @ w1[e]``,  layer 0's form (keeps AG(dO) ``[T, H]``)
            ``dh[p] = wt[p] * G[p]``
d weights   ``dwt[t, j] = <dO[t], Z[p]> = <G[p], h[p]>``,    row dot products, then a reduce-scatter
            summed over ranks (each holds an F_loc part)     of the ``[T, k]`` partials
wgrad       ``dw1[e] = sum over rows p of e: wt[p] dO[tok]   grouped GEMM over the plan's rows
            .T h[p]``
==========  ===============================================  =======================================

The routing weights' gradient uses the unscaled ``G``: ``<G[p], h[p]>`` equals ``<dO[t], Z[p]>``, so
``Z`` is neither kept from the forward nor computed again.

Two forms. ``FusedExperts`` (the default, on ops that take epilogues: ``MoEOps.swiglu``) runs the
whole expert MLP with the SwiGLU fused into layer 0's epilogue, forward and backward:

* forward: ``h = silu(gate) * up`` is computed in layer 0's epilogue, which also stores the
  pre-activations ``[P, 2*F_loc]`` (interleaved) for the backward; they are all that is kept of the
  experts' activations (``h`` is not: the backward recomputes it from them, which costs no GEMM);
* backward: layer 1's input gradient ``G = dO[tok] @ w1[e]`` runs layer 0's form (the plain grouped
  GEMM), then one pass (``tileweave.ops.compute.swiglu.swiglu_grad``) reads ``G`` and the pre-activations once
  and writes ``dgate | dup`` of ``wt * G``, ``wt * h`` and ``<G[p], h[p]>``; the weight gradients run
  ``tileweave.ops.compute.grouped_wgrad`` over the plan's rows, gathering rows by index (no permuted copies).
  The SwiGLU's derivative inside the GEMM's epilogue ran two to two and a half times slower than the
  GEMM and this pass together (its loads stall each tile), so it is a pass of its own.

``ExpertsUp`` / ``ExpertsDown`` (ops without epilogues: the benchmark's baselines, and
``torch.compile``) run the two layers apart with the SwiGLU between them in torch, and sum the weight
gradients over each expert's rows by putting the rows in expert order and calling
``torch._grouped_mm`` where it takes the shapes, else one matmul per expert (a host read of the expert
counts).

Every rank must run the same layers in the same order, forward and backward, like any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from tileweave.ops.functional import moe_all_gather_gemm, moe_gemm_reduce_scatter
from tileweave.ops.compute.grouped_gemm import SwiGLU
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.moe import MoEAllGatherGemm, MoEGemmReduceScatter, MoEPlan, moe_plan
from tileweave.ops.compute.swiglu import swiglu_grad


@dataclasses.dataclass(frozen=True)
class MoEOps:
    """What the MoE layer runs its communication and expert GEMMs on; the default is tileweave's MoE
    pair. A benchmark or test passes other implementations with the same signatures:

    * ``plan(topk_ids_shard [T/W, k], num_experts, group) -> MoEPlan`` (collective);
    * ``layer0(x_shard [T/W, K], w [E, K, N], plan, group, return_gathered) -> y [P, N]`` or
      ``(y, AG(x_shard) [T, K])``;
    * ``layer1(h [P, K], w [E, K, N], plan, weights_shard [T/W, k] | None, group) -> [T/W, N]``
      (``None``: every weight 1).

    ``swiglu``: ``layer0`` also takes the keyword ``epilogue=`` of
    ``tileweave.ops.moe.MoEAllGatherGemm`` (the SwiGLU fused into its epilogue), and the layer runs
    ``FusedExperts`` on them. ``fp8``: both layers also take the ops' float8 keywords (``scale_a``,
    ``scale_b``, ``out_dtype``, ``use_fast_accum``; ``layer0`` then returns ``(y, x, x_scales)`` with
    ``return_gathered``) and, with ``swiglu``, ``layer0`` takes ``SwiGLU(cast=...)`` (``y`` is then the
    float8 ``h`` and its scales), which ``TPMoE(fp8=...)`` needs (``tileweave.nn.moe_fp8``).
    """

    plan: Callable[..., MoEPlan]
    layer0: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    layer1: Callable[..., torch.Tensor]
    swiglu: bool = False
    fp8: bool = False


def _tileweave_plan(topk_ids_shard: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> MoEPlan:
    # The layer's ids are top-k indices of its router's num_experts logits, in range by construction:
    # their values are neither read on the host (which would synchronise every forward) nor tracked by
    # the ops on the device (a few launches per op call).
    plan = moe_plan(topk_ids_shard, num_experts=num_experts, group=group, validate=False)
    return dataclasses.replace(plan, invalid=None)


def _tileweave_layer0(x_shard, w, plan, group, return_gathered, **options):
    return moe_all_gather_gemm(x_shard, w, plan, group, return_gathered=return_gathered, **options)


def _tileweave_layer1(h, w, plan, weights_shard, group, **options):
    return moe_gemm_reduce_scatter(h, w, plan, weights_shard, group, **options)


TILEWEAVE_OPS = MoEOps(plan=_tileweave_plan, layer0=_tileweave_layer0, layer1=_tileweave_layer1, swiglu=True,
                       fp8=True)
"""tileweave's functional MoE ops (one cached op object per group and device, ``policy="auto"``)."""


def tileweave_ops(*, policy: str = "auto", group: dist.ProcessGroup | None = None,
                  max_spin: int | None = None) -> MoEOps:
    """tileweave's MoE pair on op objects of their own, bound to ``group`` (None: WORLD), with ``policy``
    (``"auto"``, ``"fused"``, ``"fallback"``) and ``max_spin`` (see ``tileweave.ops.moe``). The layers
    given these ops must all run on ``group``."""
    up = MoEAllGatherGemm(group, policy=policy, max_spin=max_spin)
    down = MoEGemmReduceScatter(group, policy=policy, max_spin=max_spin)

    def layer0(x_shard, w, plan, group, return_gathered, **options):
        return up(x_shard, w, plan, return_gathered=return_gathered, **options)

    def layer1(h, w, plan, weights_shard, group, **options):
        return down(h, w, plan, weights_shard, **options)

    return MoEOps(plan=_tileweave_plan, layer0=layer0, layer1=layer1, swiglu=True, fp8=True)


def gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather of ``t [n, ...]`` along its rows, in rank order (NCCL on GPUs, gloo on the CPU)."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((t.shape[0] * world, *t.shape[1:]))
    if t.is_cuda:
        dist.all_gather_into_tensor(out, t, group=group)
    else:
        dist.all_gather(list(out.chunk(world)), t, group=group)
    return out


def reduce_scatter_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of ``t [n, ...]`` over the ranks, this rank's ``n/W`` rows of it (gloo has no reduce-scatter:
    an all-reduce there)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    t = t.contiguous()
    if t.is_cuda:
        out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
        dist.reduce_scatter_tensor(out, t, group=group)
        return out
    total = t.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(world)[rank].clone()


def row_weights(plan: MoEPlan, weights: torch.Tensor) -> torch.Tensor:
    """fp32 ``[P]``: the routing weight of each plan row, from the gathered ``weights [T, k]``."""
    out = torch.empty(plan.rows, dtype=torch.float32, device=weights.device)
    out[plan.pair_row.reshape(-1).long()] = weights.reshape(-1).float()
    return out


def expert_weight_grad(lhs: torch.Tensor, rhs: torch.Tensor, plan: MoEPlan, dtype: torch.dtype) -> torch.Tensor:
    """``[E, N, K]``: ``sum over the plan rows p of expert e of lhs[p].T rhs[p]`` for ``lhs [P, N]``,
    ``rhs [P, K]`` in plan order (an ``nn.Linear``-layout weight gradient), fp32 accumulation, in
    ``dtype``."""
    e = plan.num_experts
    order = torch.argsort(plan.row_expert, stable=True)  # expert order; rows of one expert stay in plan order
    lhs, rhs = lhs[order], rhs[order]
    n, k = lhs.shape[1], rhs.shape[1]
    if _grouped_mm_fits(lhs, n, k):
        ends = torch.cumsum(plan.splits, 0, dtype=torch.int32)
        return torch._grouped_mm(lhs.t(), rhs, offs=ends).to(dtype)
    out = torch.zeros((e, n, k), dtype=torch.float32, device=lhs.device)
    start = 0
    for expert, count in enumerate(plan.splits.tolist()):
        if count:
            out[expert] = lhs[start:start + count].float().t() @ rhs[start:start + count].float()
        start += count
    return out.to(dtype)


def _grouped_mm_fits(lhs: torch.Tensor, n: int, k: int) -> bool:
    """``torch._grouped_mm`` takes fp16/bf16 (and fp32 on the CPU), rows of 16-byte multiples."""
    if not hasattr(torch, "_grouped_mm") or lhs.shape[0] == 0:
        return False
    dtypes = (torch.bfloat16,) if lhs.is_cuda else (torch.float16, torch.bfloat16, torch.float32)
    size = lhs.element_size()
    return lhs.dtype in dtypes and (n * size) % 16 == 0 and (k * size) % 16 == 0 and (lhs.shape[0] * size) % 16 == 0


class ExpertsUp(torch.autograd.Function):
    """Layer 0 (module docstring): ``y [P, 2*F_loc]`` from ``x_shard [T/W, H]`` and ``w0 [E, 2*F_loc, H]``."""

    @staticmethod
    def forward(ctx, x_shard, w0, plan: MoEPlan, group, ops: MoEOps, save_gathered: bool):
        w_in = w0.transpose(1, 2)
        if save_gathered:
            y, gathered = ops.layer0(x_shard, w_in, plan, group, True)
        else:
            y, gathered = ops.layer0(x_shard, w_in, plan, group, False), None
        ctx.plan, ctx.group, ctx.ops, ctx.save_gathered = plan, group, ops, save_gathered
        ctx.save_for_backward(gathered if save_gathered else x_shard, w0)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, w0 = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        dy = dy.contiguous()
        dx_shard = ctx.ops.layer1(dy, w0, plan, None, group) if ctx.needs_input_grad[0] else None
        dw0 = None
        if ctx.needs_input_grad[1]:
            gathered = saved if ctx.save_gathered else gather_rows(saved, group)
            dw0 = expert_weight_grad(dy, gathered[plan.row_token.long()], plan, w0.dtype)
        return dx_shard, dw0, None, None, None, None


class ExpertsDown(torch.autograd.Function):
    """Layer 1 (module docstring): ``out_shard [T/W, H]`` from ``h [P, F_loc]``, ``w1 [E, H, F_loc]`` and
    the routing weights ``topk_weights_shard [T/W, k]`` (fp32)."""

    @staticmethod
    def forward(ctx, h, w1, topk_weights_shard, plan: MoEPlan, group, ops: MoEOps):
        out = ops.layer1(h, w1.transpose(1, 2), plan, topk_weights_shard, group)
        ctx.plan, ctx.group, ctx.ops = plan, group, ops
        ctx.save_for_backward(h, w1, topk_weights_shard)
        return out

    @staticmethod
    def backward(ctx, dout_shard):
        h, w1, weights_shard = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        g, dout = ctx.ops.layer0(dout_shard.contiguous(), w1, plan, group, True)  # [P, F_loc], [T, H]
        wrow = row_weights(plan, gather_rows(weights_shard, group))
        dh = (g.float() * wrow[:, None]).to(h.dtype)
        dweights = None
        if ctx.needs_input_grad[2]:
            partial = (g.float() * h.float()).sum(1)[plan.pair_row.long()]  # [T, k], this rank's F_loc part
            dweights = reduce_scatter_rows(partial, group).to(weights_shard.dtype)
        dw1 = None
        if ctx.needs_input_grad[1]:
            scaled = (dout[plan.row_token.long()].float() * wrow[:, None]).to(h.dtype)
            dw1 = expert_weight_grad(scaled, h, plan, w1.dtype)
        return dh, dw1, dweights, None, None, None


class FusedExperts(torch.autograd.Function):
    """The expert MLP with the SwiGLU fused into layer 0 (module docstring): ``out_shard [T/W, H]`` from
    ``x_shard [T/W, H]``, ``w0 [E, 2*F_loc, H]`` (gate rows, then up rows), ``w1 [E, H, F_loc]`` and
    ``topk_weights_shard [T/W, k]`` (fp32). ``grad_enabled``: the caller's ``torch.is_grad_enabled()``
    (inside ``forward`` grad mode is always off, and ``needs_input_grad`` says what the inputs require even
    under ``torch.no_grad``): without it nothing is kept for a backward."""

    @staticmethod
    def forward(ctx, x_shard, w0, w1, topk_weights_shard, plan: MoEPlan, group, ops: MoEOps, save_gathered: bool,
                grad_enabled: bool = True):
        grads = grad_enabled and any(ctx.needs_input_grad[:4])
        pre = x_shard.new_empty((plan.rows, w0.shape[1])) if grads else None
        keep = grads and save_gathered and ctx.needs_input_grad[1]
        result = ops.layer0(x_shard, w0.transpose(1, 2), plan, group, keep, epilogue=SwiGLU(pre=pre))
        h, gathered = result if keep else (result, None)
        out = ops.layer1(h, w1.transpose(1, 2), plan, topk_weights_shard, group)
        ctx.plan, ctx.group, ctx.ops, ctx.keep = plan, group, ops, keep
        if grads:
            ctx.save_for_backward(gathered if keep else x_shard, w0, w1, topk_weights_shard, pre)
        return out

    @staticmethod
    def backward(ctx, dout_shard):
        saved, w0, w1, weights_shard, pre = ctx.saved_tensors
        plan, group, ops = ctx.plan, ctx.group, ctx.ops
        e = plan.num_experts
        wrow = row_weights(plan, gather_rows(weights_shard, group))
        g, dout = ops.layer0(dout_shard.contiguous(), w1, plan, group, True)  # [P, F_loc] = dO[tok] @ w1[e]; AG(dO)
        dy, h_scaled, row_dot = swiglu_grad(g, pre, wrow)
        del g
        dweights = None
        if ctx.needs_input_grad[3]:
            # This rank's F_loc share of <dO[t], Z[p(t, j)]>, summed over the ranks.
            dweights = reduce_scatter_rows(row_dot[plan.pair_row.long()], group).to(weights_shard.dtype)
        dw1 = None
        if ctx.needs_input_grad[2]:
            dw1 = grouped_wgrad(dout, h_scaled, plan.offsets, experts=e, lhs_rows=plan.row_token)
        dx_shard = ops.layer1(dy, w0, plan, None, group) if ctx.needs_input_grad[0] else None
        dw0 = None
        if ctx.needs_input_grad[1]:
            gathered = saved if ctx.keep else gather_rows(saved, group)
            dw0 = grouped_wgrad(dy, gathered, plan.offsets, experts=e, rhs_rows=plan.row_token)
        return dx_shard, dw0, dw1, dweights, None, None, None, None, None
