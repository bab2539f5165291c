"""The fused ops as torch custom ops (``torch.ops.tileweave.*``), so that ``torch.compile`` keeps each
one whole as a single graph node instead of tracing into Triton launches and stream operations.

The functional API calls these only while compiling: a custom op's dispatch costs host time, which
eager calls of small layers cannot spare. Groups travel as their names, which is what a graph can hold.
"""

from typing import Optional

import torch
import torch.distributed as dist

from tileweave.ops.all_gather.op import AllGatherGemm, gathered_like
from tileweave.ops.reduce_scatter.op import GemmReduceScatter


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("tileweave::all_gather_gemm", mutates_args=())
def all_gather_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                       group_name: str) -> torch.Tensor:
    return AllGatherGemm.shared(_group(group_name), a_shard.device)(a_shard, b, bias=bias)


@all_gather_gemm_op.register_fake
def _(a_shard, b, bias, group_name):
    return a_shard.new_empty((a_shard.shape[0] * _group(group_name).size(), b.shape[1]))


@torch.library.custom_op("tileweave::all_gather_gemm_gathered", mutates_args=())
def all_gather_gemm_gathered_op(a_shard: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                                group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    group = _group(group_name)
    # A custom op's outputs may not alias the op's own workspace, which the next call overwrites.
    return AllGatherGemm.shared(group, a_shard.device)(a_shard, b, bias=bias,
                                                       gathered_out=gathered_like(a_shard, group.size()))


@all_gather_gemm_gathered_op.register_fake
def _(a_shard, b, bias, group_name):
    m = a_shard.shape[0] * _group(group_name).size()
    return a_shard.new_empty((m, b.shape[1])), a_shard.new_empty((m, a_shard.shape[1]))


@torch.library.custom_op("tileweave::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                           group_name: str) -> torch.Tensor:
    return GemmReduceScatter.shared(_group(group_name), a.device)(a, b, bias=bias)


@gemm_reduce_scatter_op.register_fake
def _(a, b, bias, group_name):
    w = _group(group_name).size()
    if a.shape[0] % w:
        raise ValueError(f"gemm_reduce_scatter: M={a.shape[0]} is not divisible by the group size {w}")
    return a.new_empty((a.shape[0] // w, b.shape[1]))
