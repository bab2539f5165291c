"""AllGather+GEMM's copy-engine transport and its two consumers: each rank's copy stream pushes its
shard into every peer's symmetric gather buffer (mesh) or forwards chunks to rank+1 (ring), and raises
the peer's ready flag after each copy; the consumer waits for those flags; after the GEMM each rank
releases its buffer to the peers for the next call. Also the gather of ``AllGatherGemm.all_gather`` and
of MoE layer 0 (``tileweave.ops.moe.gather``).

Consumers. ``run_mesh`` / ``run_ring`` (path "fused"): the persistent GEMM (``tileweave.kernels.gemm``,
``ALL_GATHER``) computes its own rows straight from ``a_shard`` while the shards travel, then each
peer's rows once that peer's ready flag carries this call's value. ``run_chunked`` (path "chunked"):
cuBLAS, one GEMM for the own rows while the shards travel, then one per peer's rows once the caller's
stream has waited for that peer's ready flag (a stream memory op, no SM spins)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tileweave.ops.dense import finish_kernel, launch_fused, programs
from tileweave.ops.skeleton import Call, finish_streams
from tileweave.ops.workspace import READY, RELEASED, FlagValues, Memory, Workspace
from tileweave.runtime.backend import Backend


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """Views and flag addresses of one shape, computed once: the per-call host work stays small."""

    gathered: torch.Tensor
    own_slot: torch.Tensor
    pushes: tuple
    """Per copy: (destination slot in a peer's buffer, our RELEASED flag for that peer or None, the
    peer's READY flag for the chunk, our READY flag to wait for before forwarding or None, the source:
    None for our shard, else our slot of the forwarded chunk)."""
    releases: tuple
    """Each peer's RELEASED flag for us."""
    arrivals: tuple
    """Our READY flags, one per peer."""


def push_plan(ws: Workspace, backend: Backend, mc: int, k: int, dtype: torch.dtype, ring: bool) -> PushPlan:
    """The plan of ``[mc, k]`` shards on ``ws`` (kept in the workspace's plans)."""
    key = ("ag", mc, k, dtype, ring)
    plan = ws.plans.get(key)
    if plan is not None:
        return plan
    w, rank = backend.world_size, backend.rank

    def rows(r: int) -> slice:
        return slice(r * mc, (r + 1) * mc)

    gathered = ws.data.view(rank, dtype, (mc * w, k))
    pushes = []
    if ring:
        nxt = (rank + 1) % w
        peer_buf = ws.data.view(nxt, dtype, (mc * w, k))
        for i in range(1, w):
            chunk = (rank - i + 1) % w  # ours first, then what rank-1 forwarded to us
            pushes.append((peer_buf[rows(chunk)], ws.flag_address(rank, RELEASED, nxt) if i == 1 else None,
                           ws.flag_address(nxt, READY, chunk),
                           None if i == 1 else ws.flag_address(rank, READY, chunk),
                           None if i == 1 else gathered[rows(chunk)]))
    else:
        for i in range(1, w):
            peer = (rank - i) % w  # nearest consumer first: rank r - i computes our rows at its step i
            pushes.append((ws.data.view(peer, dtype, (mc * w, k))[rows(rank)], ws.flag_address(rank, RELEASED, peer),
                           ws.flag_address(peer, READY, rank), None, None))
    plan = ws.plans[key] = PushPlan(
        gathered=gathered, own_slot=gathered[rows(rank)], pushes=tuple(pushes),
        releases=tuple(ws.flag_address(p, RELEASED, rank) for p in range(w) if p != rank),
        arrivals=tuple(ws.flag_address(rank, READY, src) for src in range(w) if src != rank))
    return plan


def start(memory: Memory, backend: Backend, a_shard: torch.Tensor, ring: bool, constant: bool) -> tuple:
    """``(workspace, plan, a_shard, flag values)`` of a new call, its copies queued on the copy stream:
    ``a_shard`` into every peer's gather buffer (``memory``'s workspace, grown to hold ``[M, K]``), or
    forwarded along the ring. ``constant``: the graphable protocol's flag values."""
    mc, k = a_shard.shape
    ws = memory.workspace(backend, mc * backend.world_size * k * a_shard.element_size())
    a_shard = a_shard if a_shard.is_contiguous() else a_shard.contiguous()
    plan = push_plan(ws, backend, mc, k, a_shard.dtype, ring)
    ws.epoch += 1
    values = FlagValues(ws.epoch, constant)
    # Each copy waits until its destination was released for this call (``FlagValues.claim``), and is
    # followed by the destination's ready flag; a ring forwards a chunk once it has it.
    backend.comm_begin()
    for slot, released, ready, arrived, source in plan.pushes:
        if released is not None:
            values.claim(backend, released)
        if arrived is not None:
            backend.comm_wait(arrived, values.ready)
        backend.comm_copy(slot, a_shard if source is None else source)
        backend.comm_write(ready, values.ready)
    return ws, plan, a_shard, values


def copy_out(backend: Backend, ws: Workspace, plan: PushPlan, a_shard, gathered_out, ready: int) -> None:
    """Queue on the copy stream, after this call's pushes: our shard into ``gathered_out``, then each
    peer's rows once its flag reaches ``ready``. The call joins the copy stream before it releases
    the buffer, so no peer refills a slot that is still being read."""
    w, rank = backend.world_size, backend.rank
    mc = a_shard.shape[0]
    backend.comm_copy(gathered_out[rank * mc:(rank + 1) * mc], a_shard)
    for step in range(1, w):
        src = (rank + step) % w
        rows = slice(src * mc, (src + 1) * mc)
        backend.comm_wait(ws.flag_address(rank, READY, src), ready)
        backend.comm_copy(gathered_out[rows], plan.gathered[rows])


def run_pushed(call: Call, consume: Callable, a_shard, b, bias, out, return_gathered: bool, gathered_out,
               ring: bool = False):
    """One call on the push transport: the pushes, ``consume(call, ws, push_plan, a_shard, b, bias, out,
    ready)`` (the GEMM that waits for each shard's flag), then the release of the gather buffer (or its
    loan to the caller, for ``return_gathered``)."""
    backend = call.backend
    mc, k = a_shard.shape
    w = backend.world_size
    if out is None:
        out = torch.empty((mc * w, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    ws, pushes, a_shard, values = start(call.memory, backend, a_shard, ring, call.graphable)
    if gathered_out is not None:
        copy_out(backend, ws, pushes, a_shard, gathered_out, values.ready)
    elif return_gathered and pushes.own_slot.data_ptr() != a_shard.data_ptr():
        backend.comm_copy(pushes.own_slot, a_shard)
    consume(call, ws, pushes, a_shard, b, bias, out, values.ready)
    # Released only once our copy stream is done too: a ring forwards chunks out of this buffer, and a
    # peer must not refill it while a forward still reads it. A gathered view returned to the caller is
    # released by this rank's next call instead.
    backend.comm_end()
    if return_gathered and gathered_out is None:
        call.memory.lend(backend, values, pushes.arrivals, pushes.releases)
    else:
        values.release(backend, pushes.arrivals, pushes.releases)
    if call.plan.path == "fused":
        finish_kernel(call, ws)
    else:
        finish_streams(call.backend)
    call.record(call.plan.path)
    if gathered_out is not None:
        return out, gathered_out
    return (out, pushes.gathered) if return_gathered else out


# -- the consumers -------------------------------------------------------------------------------------

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


def _gemms(call: Call, ws, pushes, a_shard, b, bias, out, ready: int) -> None:
    backend = call.backend
    w, rank = backend.world_size, backend.rank
    mc = a_shard.shape[0]
    for step in range(w):
        src = (rank + step) % w
        rows = slice(src * mc, (src + 1) * mc)
        if step:
            backend.main_wait(ws.flag_address(rank, READY, src), ready)
        lhs = a_shard if step == 0 else pushes.gathered[rows]
        if bias is not None:
            torch.addmm(bias, lhs, b, out=out[rows])
        else:
            torch.mm(lhs, b, out=out[rows])


def run_mesh(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    """The fused kernel; every rank pushes its shard to every peer (NVSwitch-class nodes: each pair has
    its own links)."""
    return run_pushed(call, _mesh, a_shard, b, bias, out, return_gathered, gathered_out)


def run_ring(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    """The fused kernel; each rank forwards every chunk to rank+1 once it has it (one stream of data per
    link: PCIe or partial meshes)."""
    return run_pushed(call, _ring, a_shard, b, bias, out, return_gathered, gathered_out, ring=True)


def run_chunked(call: Call, a_shard, b, bias, out, return_gathered, gathered_out):
    """cuBLAS per shard, on the mesh push."""
    return run_pushed(call, _gemms, a_shard, b, bias, out, return_gathered, gathered_out)
