"""The fused ops as torch custom ops (``torch.ops.tileweave.*``), so that ``torch.compile`` keeps each
one whole as a single graph node instead of tracing into Triton launches and stream operations.

The functional API calls these only while compiling: a custom op's dispatch costs host time, which
eager calls of small layers cannot spare. Groups travel as their names, which is what a graph can hold;
an MoE routing plan travels as its tensors (``MoEPlan.tensors()``). A custom op's outputs are fresh
tensors: none aliases an op's workspace, which the next call overwrites.

=================================  ==============================================================
op                                 schema (``group_name``: ``ProcessGroup.group_name``)
=================================  ==============================================================
``all_gather_gemm``                ``(a_shard, b, bias?, group_name) -> out``
``all_gather_gemm_gathered``       ``(a_shard, b, bias?, group_name) -> (out, gathered)``
``gemm_reduce_scatter``            ``(a, b, bias?, group_name) -> out_shard``
``gemm_all_reduce``                ``(a, b, bias?, residual?, group_name) -> out``
``gemm_all_reduce_norm``           ``(a, b, bias?, residual?, norm_weight, eps, group_name) ->
                                   (normed, resid)``
``moe_all_gather_gemm``            ``(x_shard, w0, plan[], group_name) -> y``
``moe_all_gather_gemm_gathered``   ``(x_shard, w0, plan[], group_name) -> (y, gathered)``
``moe_gemm_reduce_scatter``        ``(h, w1, plan[], topk_weights_shard?, group_name) -> out_shard``
=================================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tileweave.ops.all_gather.op import AllGatherGemm, gathered_like
from tileweave.ops.all_reduce.op import shared_op as shared_all_reduce
from tileweave.ops.moe.op import MoEAllGatherGemm, MoEGemmReduceScatter
from tileweave.ops.moe.plan import MoEPlan
from tileweave.ops.reduce_scatter.op import GemmReduceScatter


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def _define(name: str, schema: str, run: Callable, fake: Callable):
    """``torch.ops.tileweave.<name>``: ``run`` on real tensors, ``fake`` for shapes while tracing."""
    op = torch.library.custom_op(f"tileweave::{name}", run, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


# Dense pair.

def _all_gather_gemm(a_shard, b, bias, group_name):
    return AllGatherGemm.shared(_group(group_name), a_shard.device)(a_shard, b, bias=bias)


def _all_gather_gemm_gathered(a_shard, b, bias, group_name):
    group = _group(group_name)
    return AllGatherGemm.shared(group, a_shard.device)(a_shard, b, bias=bias,
                                                       gathered_out=gathered_like(a_shard, group.size()))


def _gathered_rows(a_shard, group_name) -> int:
    return a_shard.shape[0] * _group(group_name).size()


def _fake_all_gather_gemm(a_shard, b, bias, group_name):
    return a_shard.new_empty((_gathered_rows(a_shard, group_name), b.shape[1]))


def _fake_all_gather_gemm_gathered(a_shard, b, bias, group_name):
    m = _gathered_rows(a_shard, group_name)
    return a_shard.new_empty((m, b.shape[1])), a_shard.new_empty((m, a_shard.shape[1]))


def _gemm_reduce_scatter(a, b, bias, group_name):
    return GemmReduceScatter.shared(_group(group_name), a.device)(a, b, bias=bias)


def _fake_gemm_reduce_scatter(a, b, bias, group_name):
    w = _group(group_name).size()
    if a.shape[0] % w:
        raise ValueError(f"gemm_reduce_scatter: M={a.shape[0]} is not divisible by the group size {w}")
    return a.new_empty((a.shape[0] // w, b.shape[1]))


_BIAS = "Tensor? bias, str group_name"
all_gather_gemm_op = _define("all_gather_gemm", f"(Tensor a_shard, Tensor b, {_BIAS}) -> Tensor",
                             _all_gather_gemm, _fake_all_gather_gemm)
all_gather_gemm_gathered_op = _define("all_gather_gemm_gathered",
                                      f"(Tensor a_shard, Tensor b, {_BIAS}) -> (Tensor, Tensor)",
                                      _all_gather_gemm_gathered, _fake_all_gather_gemm_gathered)
gemm_reduce_scatter_op = _define("gemm_reduce_scatter", f"(Tensor a, Tensor b, {_BIAS}) -> Tensor",
                                 _gemm_reduce_scatter, _fake_gemm_reduce_scatter)


# GEMM + AllReduce.

def _gemm_all_reduce(a, b, bias, residual, group_name):
    return shared_all_reduce(_group(group_name), a.device)(a, b, bias=bias, residual=residual)


def _gemm_all_reduce_norm(a, b, bias, residual, norm_weight, eps, group_name):
    return shared_all_reduce(_group(group_name), a.device)(a, b, bias=bias, residual=residual,
                                                           norm_weight=norm_weight, eps=eps)


def _fake_gemm_all_reduce(a, b, bias, residual, group_name):
    return a.new_empty((a.shape[0], b.shape[1]))


def _fake_gemm_all_reduce_norm(a, b, bias, residual, norm_weight, eps, group_name):
    return a.new_empty((a.shape[0], b.shape[1])), a.new_empty((a.shape[0], b.shape[1]))


gemm_all_reduce_op = _define("gemm_all_reduce",
                             "(Tensor a, Tensor b, Tensor? bias, Tensor? residual, str group_name) -> Tensor",
                             _gemm_all_reduce, _fake_gemm_all_reduce)
gemm_all_reduce_norm_op = _define("gemm_all_reduce_norm",
                                  "(Tensor a, Tensor b, Tensor? bias, Tensor? residual, Tensor norm_weight, "
                                  "float eps, str group_name) -> (Tensor, Tensor)",
                                  _gemm_all_reduce_norm, _fake_gemm_all_reduce_norm)


# MoE pair. ``plan``: MoEPlan.tensors(), (offsets, row_token, row_expert, pair_row, splits).

def _moe_all_gather_gemm(x_shard, w0, plan, group_name):
    op = MoEAllGatherGemm.shared(_group(group_name), x_shard.device)
    return op(x_shard, w0, MoEPlan.from_tensors(*plan))


def _moe_all_gather_gemm_gathered(x_shard, w0, plan, group_name):
    op = MoEAllGatherGemm.shared(_group(group_name), x_shard.device)
    return op(x_shard, w0, MoEPlan.from_tensors(*plan), return_gathered=True)


def _moe_gemm_reduce_scatter(h, w1, plan, topk_weights_shard, group_name):
    op = MoEGemmReduceScatter.shared(_group(group_name), h.device)
    return op(h, w1, MoEPlan.from_tensors(*plan), topk_weights_shard)


def _fake_moe_all_gather_gemm(x_shard, w0, plan, group_name):
    return x_shard.new_empty((plan[3].numel(), w0.shape[2]))  # [T*k, F_loc]


def _fake_moe_all_gather_gemm_gathered(x_shard, w0, plan, group_name):
    return _fake_moe_all_gather_gemm(x_shard, w0, plan, group_name), x_shard.new_empty((plan[3].shape[0],
                                                                                         x_shard.shape[1]))


def _fake_moe_gemm_reduce_scatter(h, w1, plan, topk_weights_shard, group_name):
    return h.new_empty((plan[3].shape[0] // _group(group_name).size(), w1.shape[2]))  # [T/W, H]


moe_all_gather_gemm_op = _define("moe_all_gather_gemm",
                                 "(Tensor x_shard, Tensor w0, Tensor[] plan, str group_name) -> Tensor",
                                 _moe_all_gather_gemm, _fake_moe_all_gather_gemm)
moe_all_gather_gemm_gathered_op = _define("moe_all_gather_gemm_gathered",
                                          "(Tensor x_shard, Tensor w0, Tensor[] plan, str group_name) -> "
                                          "(Tensor, Tensor)",
                                          _moe_all_gather_gemm_gathered, _fake_moe_all_gather_gemm_gathered)
moe_gemm_reduce_scatter_op = _define("moe_gemm_reduce_scatter",
                                     "(Tensor h, Tensor w1, Tensor[] plan, Tensor? topk_weights_shard, "
                                     "str group_name) -> Tensor",
                                     _moe_gemm_reduce_scatter, _fake_moe_gemm_reduce_scatter)
