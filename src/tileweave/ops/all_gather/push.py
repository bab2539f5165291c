"""AllGather+GEMM's copy-engine transport and its two consumers: each rank's copy stream pushes its
shard into every peer's symmetric gather buffer (mesh) or forwards chunks to rank+1 (ring), and raises
the peer's ready flag after each copy; the consumer waits for those flags; after the GEMM each rank
releases its buffer to the peers for the next call. Also the gather alone (``PendingGather``), of
``AllGatherGemm.all_gather`` and of MoE layer 0, and the fused kernel's launch (``launch_fused``).

Consumers. ``run_mesh`` / ``run_ring`` (path "fused"): the persistent GEMM (``tileweave.kernels.gemm``,
``ALL_GATHER``) computes its own rows straight from ``a_shard`` while the shards travel, then each
peer's rows once that peer's ready flag carries this call's value. ``run_chunked`` (path "chunked"):
cuBLAS, one GEMM for the own rows while the shards travel, then one per peer's rows once the caller's
stream has waited for that peer's ready flag (a stream memory op, no SM spins).

Float8 calls: each copy of a shard's rows is followed by a copy of its a-scales (the gathered form of
``tileweave.ops.dense``, ``[M/W, KB]`` float32) into the scale region of the same gather buffer,
``[M, KB]`` at ``scale_offset`` after the rows, and only then by the ready flag: one flag covers both.
The kernel reads the gathered scales of the peers' rows (``gathered_scales``); the chunked consumer
runs tileweave's scaled ``matmul`` per shard."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tileweave.ops import common
from tileweave.ops.compute.gemm_launch import launch, launch_cached
from tileweave.ops.compute.matmul import matmul
from tileweave.ops.compute.scaling import dense_scales
from tileweave.ops.skeleton import Call, finish_streams, first_launch
from tileweave.ops.workspace import READY, RELEASED, FlagValues, Memory, Workspace
from tileweave.runtime.backend import Backend
from tileweave.tune.configs import GemmConfig

OP_NAME = "all_gather_gemm"


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
    gathered_scales: torch.Tensor | None = None
    """Float8 calls: our ``[M, KB]`` region of gathered a-scales (rows as in ``gathered``)."""
    scale_pushes: tuple = ()
    """Float8 calls, per copy of ``pushes``: (destination rows in a peer's scale region, the source: None
    for our shard's scales, else our rows of the forwarded chunk's)."""


def scale_offset(rows_bytes: int) -> int:
    """Where a gather buffer's scale region starts: after ``rows_bytes`` of rows, 256-byte aligned."""
    return -(-rows_bytes // 256) * 256


def push_plan(ws: Workspace, backend: Backend, mc: int, k: int, dtype: torch.dtype, ring: bool,
              kb: int = 0) -> PushPlan:
    """The plan of ``[mc, k]`` shards on ``ws`` (kept in the workspace's plans), with ``[mc, kb]``
    float32 a-scales beside them when ``kb``."""
    key = ("ag", mc, k, dtype, ring, kb)
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
    gathered_scales, scale_pushes = None, ()
    if kb:
        offset = scale_offset(mc * w * k * dtype.itemsize)

        def scales_of(r: int) -> torch.Tensor:
            return ws.data.view(r, torch.float32, (mc * w, kb), offset=offset)

        gathered_scales = scales_of(rank)
        if ring:
            nxt = (rank + 1) % w
            scale_pushes = tuple((scales_of(nxt)[rows((rank - i + 1) % w)],
                                  None if i == 1 else gathered_scales[rows((rank - i + 1) % w)]) for i in range(1, w))
        else:
            scale_pushes = tuple((scales_of((rank - i) % w)[rows(rank)], None) for i in range(1, w))
    plan = ws.plans[key] = PushPlan(
        gathered=gathered, own_slot=gathered[rows(rank)], pushes=tuple(pushes),
        releases=tuple(ws.flag_address(p, RELEASED, rank) for p in range(w) if p != rank),
        arrivals=tuple(ws.flag_address(rank, READY, src) for src in range(w) if src != rank),
        gathered_scales=gathered_scales, scale_pushes=scale_pushes)
    return plan


def start(memory: Memory, backend: Backend, a_shard: torch.Tensor, ring: bool, constant: bool,
          shard_scales: torch.Tensor | None = None) -> tuple:
    """``(workspace, plan, a_shard, flag values)`` of a new call, its copies queued on the copy stream:
    ``a_shard`` into every peer's gather buffer (``memory``'s workspace, grown to hold ``[M, K]``), or
    forwarded along the ring; ``shard_scales`` (contiguous ``[M/W, KB]`` float32) beside it. ``constant``:
    the graphable protocol's flag values."""
    mc, k = a_shard.shape
    w = backend.world_size
    rows_bytes = mc * w * k * a_shard.element_size()
    kb = 0 if shard_scales is None else shard_scales.shape[1]
    ws = memory.workspace(backend, scale_offset(rows_bytes) + 4 * mc * w * kb if kb else rows_bytes)
    a_shard = a_shard if a_shard.is_contiguous() else a_shard.contiguous()
    plan = push_plan(ws, backend, mc, k, a_shard.dtype, ring, kb)
    ws.epoch += 1
    values = FlagValues(ws.epoch, constant)
    # Each copy waits until its destination was released for this call (``FlagValues.claim``), and is
    # followed by the destination's ready flag; a ring forwards a chunk once it has it.
    backend.comm_begin()
    for i, (slot, released, ready, arrived, source) in enumerate(plan.pushes):
        if released is not None:
            values.claim(backend, released)
        if arrived is not None:
            backend.comm_wait(arrived, values.ready)
        backend.comm_copy(slot, a_shard if source is None else source)
        if kb:
            scale_slot, scale_source = plan.scale_pushes[i]
            backend.comm_copy(scale_slot, shard_scales if scale_source is None else scale_source)
        backend.comm_write(ready, values.ready)
    return ws, plan, a_shard, values


def copy_out(backend: Backend, ws: Workspace, plan: PushPlan, a_shard, gathered_out, ready: int,
             shard_scales=None, scales_out=None) -> None:
    """Queue on the copy stream, after this call's pushes: our shard into ``gathered_out``, then each
    peer's rows once its flag reaches ``ready``; float8 calls also our ``shard_scales`` and the peers'
    gathered scales into ``scales_out``. The call joins the copy stream before it releases the buffer,
    so no peer refills a slot that is still being read."""
    w, rank = backend.world_size, backend.rank
    mc = a_shard.shape[0]
    own = slice(rank * mc, (rank + 1) * mc)
    backend.comm_copy(gathered_out[own], a_shard)
    if scales_out is not None:
        backend.comm_copy(scales_out[own], shard_scales)
    for step in range(1, w):
        src = (rank + step) % w
        rows = slice(src * mc, (src + 1) * mc)
        backend.comm_wait(ws.flag_address(rank, READY, src), ready)
        backend.comm_copy(gathered_out[rows], plan.gathered[rows])
        if scales_out is not None:
            backend.comm_copy(scales_out[rows], plan.gathered_scales[rows])


def programs(config: GemmConfig, backend: Backend) -> int:
    """Persistent programs of a fused launch: the config's count, or one per SM, within what every
    program resident at once allows (``Backend.max_programs``)."""
    return min(config.programs or backend.num_sms, backend.max_programs(False))


def launch_fused(call: Call, **launch_args) -> None:
    """Launch the fused GEMM kernel; a plan's first launch compiles and meets the other ranks first
    (``skeleton.first_launch``)."""
    plan = call.plan
    if plan.first:
        first_launch(call.backend, lambda: launch(**launch_args, compile_only=True))
        plan.first = False
    launch_cached(**launch_args)


def finish_kernel(call: Call, ws: Workspace) -> None:
    """After a fused launch: watch the workspace's error word (``ErrorWords.watch``), so that an expired
    in-kernel wait is reported, at once on the CPU and in debug mode, else by the next call (the outputs
    of a call whose wait expired are wrong, never silently)."""
    call.errors.watch("kernel", ws.err, call.backend)


class PendingGather:
    """A gather in flight on the copy engines, with none of the push's GEMMs (``PendingGather.start``): of
    ``AllGatherGemm.all_gather`` and of MoE layer 0, whose kernels read ``gathered``. ``wait()`` makes
    the caller's stream wait for every shard (for readers that are not gated on ``ready_flags``);
    ``release()``, once the kernels that read the buffer are queued, lets the peers refill it. Made
    without a push (a group of one, NCCL's gather), it holds the gathered rows alone."""

    def __init__(self, backend: Backend, gathered: torch.Tensor, *, ws: Workspace | None = None,
                 plan: PushPlan | None = None, values: FlagValues | None = None,
                 gathered_scales: torch.Tensor | None = None) -> None:
        self.backend, self.gathered, self.ws, self.plan, self.values = backend, gathered, ws, plan, values
        self.gathered_scales = gathered_scales if plan is None else plan.gathered_scales
        """Float8 gathers: the ``[M, KB]`` float32 a-scales of ``gathered``'s rows (None otherwise)."""
        self._sources: tuple = ()
        """What the copy stream reads (the shard, its scales), held until ``release()``: a tensor the caller
        drops would otherwise go back to the allocator, which hands its memory to the next tensor made on
        the caller's stream while the copies still read it."""

    @staticmethod
    def start(backend: Backend, memory: Memory, a_shard: torch.Tensor, *, ring: bool = False,
              constant: bool = False, own_rows: str = "copy",
              shard_scales: torch.Tensor | None = None) -> "PendingGather":
        """Queue this call's pushes of ``a_shard [M/W, K]`` (``start``: ``memory``'s workspace grown or
        replaced here, collectively); the own rows go into the own slot of the buffer on the copy stream
        (``own_rows="copy"``) or on the caller's stream (``"main"``: ahead of a kernel that reads them
        ungated). ``shard_scales``: float8 rows' a-scales in the gathered form (contiguous ``[M/W, KB]``
        float32), pushed beside the rows under the same flag and put in ``gathered_scales`` alike."""
        ws, plan, a_shard, values = start(memory, backend, a_shard, ring, constant, shard_scales)
        own = slice(backend.rank * a_shard.shape[0], (backend.rank + 1) * a_shard.shape[0])
        copies = [(plan.own_slot, a_shard)] if plan.own_slot.data_ptr() != a_shard.data_ptr() else []
        if shard_scales is not None:
            copies.append((plan.gathered_scales[own], shard_scales))
        for dst, src in copies:
            if own_rows == "main":
                dst.copy_(src)
            else:
                backend.comm_copy(dst, src)
        pending = PendingGather(backend, plan.gathered, ws=ws, plan=plan, values=values)
        pending._sources = (a_shard, shard_scales)
        return pending


    @property
    def ready_flags(self) -> torch.Tensor:
        """int32 ``[W]``: word s reaches ``epoch`` once source s's rows are in ``gathered``."""
        return self.ws.flag_slice(READY)

    @property
    def epoch(self) -> int:
        return self.values.ready

    def wait(self) -> torch.Tensor:
        """The ``[M, K]`` gathered tensor, once the caller's stream has waited for every shard."""
        for address in self.plan.arrivals if self.plan is not None else ():
            self.backend.main_wait(address, self.values.ready)
        self.backend.comm_end()  # our own rows, copied on the copy stream
        if common.debug_mode() and not common.capturing(self.gathered):
            self.backend.synchronize()  # bounded: a lost peer raises here instead of hanging
        return self.gathered

    def release(self) -> None:
        """Let the peers fill the buffer for the next call, after the kernels that read it (the copy
        stream joined first: its copies read the buffer too)."""
        if self.plan is not None:
            self.backend.comm_end()
            self.values.release(self.backend, self.plan.arrivals, self.plan.releases)
            self.plan = None
            self._sources = ()  # the caller's stream now runs after every copy that read them


def run_pushed(call: Call, consume: Callable, a_shard, b, bias, out, return_gathered: bool, gathered_out,
               scaled=None, ring: bool = False):
    """One call on the push transport: the pushes, ``consume(call, ws, push_plan, a_shard, b, bias, out,
    ready, scaled)`` (the GEMM that waits for each shard's flag), then the release of the gather buffer
    (or its loan to the caller, for ``return_gathered``). ``scaled``: a float8 call's
    ``dense.Scaled``, whose a-scales travel with the rows; with ``return_gathered`` it returns ``(out,
    gathered, gathered_scales)``, copied out on the copy stream."""
    backend = call.backend
    mc, k = a_shard.shape
    w = backend.world_size
    if out is None:
        dtype = a_shard.dtype if scaled is None else scaled.out_dtype
        out = torch.empty((mc * w, b.shape[1]), dtype=dtype, device=a_shard.device)
    shard_scales = None if scaled is None else scaled.shard_rows(mc)
    scales_out = None
    if scaled is not None and return_gathered:
        # Float8 rows come back fresh with their scales (a lent buffer would have to lend both).
        gathered_out = torch.empty((mc * w, k), dtype=a_shard.dtype, device=a_shard.device)
        scales_out = torch.empty((mc * w, shard_scales.shape[1]), dtype=torch.float32, device=a_shard.device)
    ws, pushes, a_shard, values = start(call.memory, backend, a_shard, ring, call.graphable, shard_scales)
    if gathered_out is not None:
        copy_out(backend, ws, pushes, a_shard, gathered_out, values.ready, shard_scales, scales_out)
    elif return_gathered and pushes.own_slot.data_ptr() != a_shard.data_ptr():
        backend.comm_copy(pushes.own_slot, a_shard)
    consume(call, ws, pushes, a_shard, b, bias, out, values.ready, scaled)
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
    if scales_out is not None:
        return out, gathered_out, scales_out
    if gathered_out is not None:
        return out, gathered_out
    return (out, pushes.gathered) if return_gathered else out


# -- the consumers -------------------------------------------------------------------------------------

def _kernel(call: Call, ws, pushes, a_shard, b, bias, out, ready: int, scaled, ring: bool) -> None:
    backend, config = call.backend, call.plan.config
    fp8 = {}
    if scaled is not None:
        # The own rows' scales as the caller gave them (this rank's a_shard); the peers' gathered.
        mc, k = a_shard.shape
        fp8 = {"scales": dense_scales(OP_NAME, mc, b.shape[1], k, scaled.scale_a, scaled.scale_b,
                                      fast_accum=scaled.fast_accum),
               "gathered_scales": pushes.gathered_scales}
    launch_fused(call, a=a_shard, gathered=pushes.gathered, b=b, c=out, bias=bias, config=config,
                 m_chunk=a_shard.shape[0], rank=backend.rank, world=backend.world_size,
                 programs=programs(config, backend), ready=ws.flag_slice(READY), err=ws.err,
                 epoch=ready, max_spin=call.spin, ring=ring, **fp8)


def _mesh(call: Call, ws, pushes, a_shard, b, bias, out, ready: int, scaled=None) -> None:
    _kernel(call, ws, pushes, a_shard, b, bias, out, ready, scaled, ring=False)


def _ring(call: Call, ws, pushes, a_shard, b, bias, out, ready: int, scaled=None) -> None:
    _kernel(call, ws, pushes, a_shard, b, bias, out, ready, scaled, ring=True)


def _gemms(call: Call, ws, pushes, a_shard, b, bias, out, ready: int, scaled=None) -> None:
    backend = call.backend
    w, rank = backend.world_size, backend.rank
    mc = a_shard.shape[0]
    for step in range(w):
        src = (rank + step) % w
        rows = slice(src * mc, (src + 1) * mc)
        if step:
            backend.main_wait(ws.flag_address(rank, READY, src), ready)
        lhs = a_shard if step == 0 else pushes.gathered[rows]
        if scaled is not None:
            # A peer's rows with its gathered scales; a tensorwise shard's first row holds its scale.
            sa = scaled.scale_a if step == 0 else pushes.gathered_scales[rows]
            if step and scaled.scaling == "tensorwise":
                sa = sa[:1]
            matmul(lhs, b, bias=bias, out=out[rows], **scaled.matmul_args(scale_a=sa))
        elif bias is not None:
            torch.addmm(bias, lhs, b, out=out[rows])
        else:
            torch.mm(lhs, b, out=out[rows])


def run_mesh(call: Call, a_shard, b, bias, out, return_gathered, gathered_out, scaled=None):
    """The fused kernel; every rank pushes its shard to every peer (NVSwitch-class nodes: each pair has
    its own links)."""
    return run_pushed(call, _mesh, a_shard, b, bias, out, return_gathered, gathered_out, scaled)


def run_ring(call: Call, a_shard, b, bias, out, return_gathered, gathered_out, scaled=None):
    """The fused kernel; each rank forwards every chunk to rank+1 once it has it (one stream of data per
    link: PCIe or partial meshes)."""
    return run_pushed(call, _ring, a_shard, b, bias, out, return_gathered, gathered_out, scaled, ring=True)


def run_chunked(call: Call, a_shard, b, bias, out, return_gathered, gathered_out, scaled=None):
    """cuBLAS per shard (tileweave's scaled ``matmul`` for float8), on the mesh push."""
    return run_pushed(call, _gemms, a_shard, b, bias, out, return_gathered, gathered_out, scaled)
