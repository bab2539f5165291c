"""AllGather+GEMM's fused transport: the push transport (``push``) feeding the persistent GEMM, which
computes its own rows straight from ``a_shard`` while the shards travel, then each peer's rows once
that peer's ready flag carries this call's value (``tileweave.kernels.gemm``, ``ALL_GATHER``)."""

from __future__ import annotations

from tileweave.ops.all_gather.push import run_pushed
from tileweave.ops.workspace import READY


def _kernel(op, plan, ws, pushes, a_shard, b, bias, out, ready: int, ring: bool) -> None:
    backend = plan.backend
    op.launch_kernel(plan, a=a_shard, gathered=pushes.gathered, b=b, c=out, bias=bias, config=plan.config,
                     m_chunk=a_shard.shape[0], rank=backend.rank, world=backend.world_size,
                     programs=op.programs(plan.config, backend), ready=ws.flag_slice(READY), err=ws.err,
                     epoch=ready, max_spin=op.spin_bound(backend), ring=ring)


def _mesh(op, plan, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    _kernel(op, plan, ws, pushes, a_shard, b, bias, out, ready, ring=False)


def _ring(op, plan, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    _kernel(op, plan, ws, pushes, a_shard, b, bias, out, ready, ring=True)


def run_mesh(op, plan, a_shard, b, bias, out, return_gathered, gathered_out):
    """Every rank pushes its shard to every peer (NVSwitch-class nodes: each pair has its own links)."""
    return run_pushed(op, plan, _mesh, a_shard, b, bias, out, return_gathered, gathered_out)


def run_ring(op, plan, a_shard, b, bias, out, return_gathered, gathered_out):
    """Each rank forwards every chunk to rank+1 once it has it (one stream of data per link: PCIe or
    partial meshes)."""
    return run_pushed(op, plan, _ring, a_shard, b, bias, out, return_gathered, gathered_out, ring=True)
