"""The functional API: one op per (group, device), shared by every caller (and so by the TP layers).
Under ``torch.compile`` the calls go through the custom ops of ``tileweave.ops.registry``, which keep
each call whole as one graph node; there ``out=`` is filled by a copy of the op's result."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops import registry
from tileweave.ops.all_gather.op import AllGatherGemm, gathered_like
from tileweave.ops.all_reduce.op import shared_op as shared_all_reduce
from tileweave.ops.moe.op import MoEAllGatherGemm, MoEGemmReduceScatter
from tileweave.ops.moe.plan import MoEPlan
from tileweave.ops.reduce_scatter.op import GemmReduceScatter


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """A compiled call's result, copied into ``out`` when one was given."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _no_fp8_compiled(op: str, scale_a, scale_b, out_dtype) -> None:
    if scale_a is not None or scale_b is not None or out_dtype is not None:
        raise NotImplementedError(f"{op} in FP8 (scale_a, scale_b, out_dtype) under torch.compile: its custom op "
                                  "takes bf16/fp16/fp32 only; call it outside the compiled region")


def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    return_gathered: bool = False, scale_a: torch.Tensor | None = None,
                    scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                    use_fast_accum: bool = False):
    """Functional form of :class:`AllGatherGemm`: ``AllGather_M(a_shard [M/W, K]) @ b [K, N_loc]
    (+ bias)``, ``[M, N_loc]``, and with ``return_gathered`` also the gathered ``[M, K]`` input, a fresh
    tensor here (the workspace is shared by every caller of this function), which the op's copy stream
    fills. FP8 with ``scale_a``, ``scale_b``, ``out_dtype``, ``use_fast_accum`` (``tileweave.ops.all_gather.op``;
    with ``return_gathered``: ``(out, gathered, gathered_scales)``, fresh). Under ``torch.compile`` this is the custom op
    ``torch.ops.tileweave.all_gather_gemm``, not yet in FP8."""
    group = group if group is not None else dist.group.WORLD
    if scale_a is not None or scale_b is not None or out_dtype is not None or use_fast_accum:
        if torch.compiler.is_compiling():
            _no_fp8_compiled("all_gather_gemm", scale_a, scale_b, out_dtype)
        return AllGatherGemm.shared(group, a_shard.device)(
            a_shard, b, bias=bias, out=out, return_gathered=return_gathered, scale_a=scale_a, scale_b=scale_b,
            out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    if torch.compiler.is_compiling():
        if return_gathered:
            result, gathered = registry.all_gather_gemm_gathered_op(a_shard, b, bias, group.group_name)
        else:
            result = registry.all_gather_gemm_op(a_shard, b, bias, group.group_name)
        result = _into(out, result)
        return (result, gathered) if return_gathered else result
    op = AllGatherGemm.shared(group, a_shard.device)
    if not return_gathered:
        return op(a_shard, b, bias=bias, out=out)
    return op(a_shard, b, bias=bias, out=out, gathered_out=gathered_like(a_shard, dist.get_world_size(group)))


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                        bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """Functional form of :class:`GemmReduceScatter`: this rank's ``[M/W, N]`` rows of the sum over ranks
    of ``a [M, K_loc] @ b [K_loc, N]`` (+ bias); FP8 with ``scale_a``, ``scale_b``, ``out_dtype``,
    ``use_fast_accum`` (``tileweave.ops.reduce_scatter.op``). Under ``torch.compile`` this is the custom
    op ``torch.ops.tileweave.gemm_reduce_scatter``, not yet in FP8."""
    group = group if group is not None else dist.group.WORLD
    fp8 = scale_a is not None or scale_b is not None or out_dtype is not None or use_fast_accum
    if torch.compiler.is_compiling():
        _no_fp8_compiled("gemm_reduce_scatter", scale_a, scale_b, out_dtype)
        return _into(out, registry.gemm_reduce_scatter_op(a, b, bias, group.group_name))
    if not fp8:
        return GemmReduceScatter.shared(group, a.device)(a, b, bias=bias, out=out)
    return GemmReduceScatter.shared(group, a.device)(a, b, bias=bias, out=out, scale_a=scale_a, scale_b=scale_b,
                                                     out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, out: torch.Tensor | None = None,
                    scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None):
    """Functional form of :class:`GemmAllReduce` (``tileweave.ops.all_reduce.op``: shapes, semantics,
    synchronisation, FP8 with ``scale_a``, ``scale_b``, ``out_dtype``) on the op shared per group and
    device, which ``TILEWEAVE_GRAPHABLE=1`` makes graphable and ``TILEWEAVE_POLICY`` gives its policy.
    Returns ``[M, N]``, or ``(normed, resid)`` with ``norm_weight``. Under ``torch.compile`` this is
    ``torch.ops.tileweave.gemm_all_reduce`` (or ``gemm_all_reduce_norm``), not yet in FP8."""
    group = group if group is not None else dist.group.WORLD
    if not torch.compiler.is_compiling():
        return shared_all_reduce(group, a.device)(a, b, bias=bias, residual=residual, norm_weight=norm_weight,
                                                  eps=eps, out=out, scale_a=scale_a, scale_b=scale_b,
                                                  out_dtype=out_dtype)
    _no_fp8_compiled("gemm_all_reduce", scale_a, scale_b, out_dtype)
    if norm_weight is None:
        return _into(out, registry.gemm_all_reduce_op(a, b, bias, residual, group.group_name))
    normed, resid = registry.gemm_all_reduce_norm_op(a, b, bias, residual, norm_weight, float(eps), group.group_name)
    return _into(out, normed), resid


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, out: torch.Tensor | None = None):
    """The sum over ranks of each rank's partial ``x [M, N]``, on the op shared with ``gemm_all_reduce``
    (``GemmAllReduce.all_reduce``: its paths, its graphable protocol under ``TILEWEAVE_GRAPHABLE=1``, its
    fixed summation order); returns ``[M, N]``, or ``(normed, resid)`` with ``norm_weight``. Not under
    ``torch.compile``."""
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        raise NotImplementedError("all_reduce_sum has no custom op: call it outside the compiled region")
    return shared_all_reduce(group, x.device).all_reduce(x, residual=residual, norm_weight=norm_weight, eps=eps,
                                                         out=out)


def moe_all_gather_gemm(x_shard: torch.Tensor, w0: torch.Tensor, plan: MoEPlan,
                        group: dist.ProcessGroup | None = None, *, out: torch.Tensor | None = None,
                        return_gathered: bool = False, epilogue=None, **fp8):
    """Functional form of :class:`MoEAllGatherGemm` (``tileweave.ops.moe.op``: shapes and
    semantics), with one op per (group, device): ``y [T*k, F_loc]``, or ``(y, x [T, H])`` with
    ``return_gathered`` (``(y, x, x_scales)`` for float8 inputs). ``fp8``: the op's ``scale_a``,
    ``scale_b``, ``out_dtype``, ``use_fast_accum``. Under ``torch.compile`` this is
    ``torch.ops.tileweave.moe_all_gather_gemm`` (or ``moe_all_gather_gemm_gathered``), without
    ``epilogue`` or float8."""
    group = group if group is not None else dist.group.WORLD
    if not torch.compiler.is_compiling():
        return MoEAllGatherGemm.shared(group, x_shard.device)(x_shard, w0, plan, out=out, return_gathered=return_gathered,
                                                               epilogue=epilogue, **fp8)
    if epilogue is not None or fp8:
        raise NotImplementedError("moe_all_gather_gemm: epilogue and float8 arguments are not supported under "
                                  "torch.compile; call it eagerly")
    if not return_gathered:
        return _into(out, registry.moe_all_gather_gemm_op(x_shard, w0, list(plan.tensors()), group.group_name))
    y, gathered = registry.moe_all_gather_gemm_gathered_op(x_shard, w0, list(plan.tensors()), group.group_name)
    return _into(out, y), gathered


def moe_gemm_reduce_scatter(h: torch.Tensor, w1: torch.Tensor, plan: MoEPlan, topk_weights_shard: torch.Tensor | None,
                            group: dist.ProcessGroup | None = None, *, out: torch.Tensor | None = None,
                            **fp8) -> torch.Tensor:
    """Functional form of :class:`MoEGemmReduceScatter` (``tileweave.ops.moe.op``: shapes and
    semantics), with one op per (group, device): ``out_shard [T/W, H]``. ``fp8``: the op's ``scale_a``,
    ``scale_b``, ``out_dtype``, ``use_fast_accum``. Under ``torch.compile`` this is
    ``torch.ops.tileweave.moe_gemm_reduce_scatter``, without float8."""
    group = group if group is not None else dist.group.WORLD
    if not torch.compiler.is_compiling():
        return MoEGemmReduceScatter.shared(group, h.device)(h, w1, plan, topk_weights_shard, out=out, **fp8)
    if fp8:
        raise NotImplementedError("moe_gemm_reduce_scatter: float8 arguments are not supported under torch.compile; "
                                  "call it eagerly")
    return _into(out, registry.moe_gemm_reduce_scatter_op(h, w1, list(plan.tensors()), topk_weights_shard,
                                                          group.group_name))
