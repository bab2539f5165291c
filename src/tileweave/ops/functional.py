"""The functional API: one op per (group, device), shared by every caller (and so by the TP layers).
Under ``torch.compile`` the calls go through the custom ops of ``tileweave.ops.registry``, which keep
each call whole as one graph node."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops import registry
from tileweave.ops.all_gather.op import AllGatherGemm, gathered_like
from tileweave.ops.reduce_scatter.op import GemmReduceScatter


def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    return_gathered: bool = False):
    """Functional form of :class:`AllGatherGemm`: ``AllGather_M(a_shard [M/W, K]) @ b [K, N_loc]
    (+ bias)``, ``[M, N_loc]``, and with ``return_gathered`` also the gathered ``[M, K]`` input, a fresh
    tensor here (the workspace is shared by every caller of this function), which the op's copy stream
    fills. Under ``torch.compile`` this is the custom op ``torch.ops.tileweave.all_gather_gemm``."""
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        if return_gathered:
            result, gathered = registry.all_gather_gemm_gathered_op(a_shard, b, bias, group.group_name)
        else:
            result = registry.all_gather_gemm_op(a_shard, b, bias, group.group_name)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, gathered) if return_gathered else result
    op = AllGatherGemm.shared(group, a_shard.device)
    if not return_gathered:
        return op(a_shard, b, bias=bias, out=out)
    return op(a_shard, b, bias=bias, out=out, gathered_out=gathered_like(a_shard, dist.get_world_size(group)))


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                        bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form of :class:`GemmReduceScatter`: this rank's ``[M/W, N]`` rows of the sum over ranks
    of ``a [M, K_loc] @ b [K_loc, N]`` (+ bias). Under ``torch.compile`` this is the custom op
    ``torch.ops.tileweave.gemm_reduce_scatter``."""
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        result = registry.gemm_reduce_scatter_op(a, b, bias, group.group_name)
        if out is not None:
            out.copy_(result)
            result = out
        return result
    return GemmReduceScatter.shared(group, a.device)(a, b, bias=bias, out=out)
