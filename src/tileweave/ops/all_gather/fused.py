"""AllGather+GEMM's fused transport: the push transport (``push``) feeding the persistent GEMM, which
computes its own rows straight from ``a_shard`` while the shards travel, then each peer's rows once
that peer's ready flag carries this call's value (``tileweave.kernels.gemm``, ``ALL_GATHER``)."""

from __future__ import annotations

from tileweave.ops.all_gather.push import run_pushed
from tileweave.ops.dense import launch_fused, programs
from tileweave.ops.skeleton import Call
from tileweave.ops.workspace import READY


def _kernel(call: Call, ws, pushes, a_shard, b, bias, out, ready: int, ring: bool) -> None:
    backend, config = call.backend, call.plan.config
    launch_fused(call, a=a_shard, gathered=pushes.gathered, b=b, c=out, bias=bias, config=config,
                 m_chunk=a_shard.shape[0], rank=backend.rank, world=backend.world_size,
                 programs=programs(config, backend), ready=ws.flag_slice(READY), err=ws.err,
                 epoch=ready, max_spin=call.spin, ring=ring)


def _mesh(call: Call, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    _kernel(call, ws, pushes, a_shard, b, bias, out, ready, ring=False)


def _ring(call: Call, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    _kernel(call, ws, pushes, a_shard, b, bias, out, ready, ring=True)


def run_mesh(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    """Every rank pushes its shard to every peer (NVSwitch-class nodes: each pair has its own links)."""
    return run_pushed(call, _mesh, a_shard, b, bias, out, return_gathered, gathered_out)


def run_ring(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    """Each rank forwards every chunk to rank+1 once it has it (one stream of data per link: PCIe or
    partial meshes)."""
    return run_pushed(call, _ring, a_shard, b, bias, out, return_gathered, gathered_out, ring=True)
