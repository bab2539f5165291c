"""AllGather + GEMM, fused: the column-parallel forward of sequence-parallel TP.

==================  ==========================  ==========================================
tensor              shape (per rank)            meaning
==================  ==========================  ==========================================
``a_shard``         ``[M / W, K]``              this rank's rows of the activations
``b``               ``[K, N_loc]``              this rank's columns of the weight
                                                (``weight.t()`` of an ``[N_loc, K]`` weight is
                                                read in place)
``bias``            ``[N_loc]``                 optional
result              ``[M, N_loc]``              ``AllGather_M(a_shard) @ b + bias``
gathered            ``[M, K]``                  ``AllGather_M(a_shard)`` (backward needs it)
==================  ==========================  ==========================================

How it runs. Each rank's producer pushes its shard into every peer's symmetric gather buffer on the
copy engines (high-priority stream, no SMs), nearest consumer first, and then writes the peer's ready
flag with a stream memory op (``transport="mesh"``, for NVSwitch-class nodes where every pair has its
own links). With ``transport="ring"`` each rank instead forwards every chunk to rank+1 once it has
it, so each link carries one stream of data (for PCIe or partial meshes). The consumer is the persistent GEMM: it computes its own rows straight
from ``a_shard`` while the shards travel, then each peer's rows once that peer's flag carries this
call's epoch. After the GEMM each rank tells every peer that its gather buffer may be refilled
(``released``), and a producer waits for that before pushing the next call's shard, so no barrier is
needed between calls. A call that returns the buffer itself as the gathered input releases it at this
rank's next call instead, so the caller can read it until then.

Capture in a CUDA graph (``graphable=True``, every transport): a replay repeats the flag
values written at capture, so a graphable op never writes an epoch. Its flags hold 0 or 1 instead: a
producer waits until its RELEASED word for a consumer is 1, sets it to 0, pushes, and sets the
consumer's READY word for it to 1; the consumer's kernel (or stream) waits for READY == 1, and after
the GEMM the consumer sets its READY words back to 0 and then each producer's RELEASED word to 1 (the
same stream, fenced writes: a reset always lands before the release that lets the next push in).
RELEASED words start at 1. A ring's forward waits for its own READY word == 1, and the reset comes
after the copy stream is joined, so no forward reads a reset word. Eager calls of a graphable op run
the same protocol.

Concurrency: all ranks must call the op the same number of times in the same order. Do not launch
two calls on one workspace concurrently from different streams.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tileweave.ops import _launch
from tileweave.ops._fused import FusedOp, option
from tileweave.ops.workspace import (COUNTERS, READY, RELEASED, FlagValues, Workspace, agree, ensure_workspace,
                                     oneshot_slots, released_start)
from tileweave.runtime.backend import Backend
from tileweave.tune import heuristics
from tileweave.tune.configs import GemmConfig

_OP = "all_gather_gemm"
TRANSPORTS = ("auto", "mesh", "ring", "chunked")


@dataclasses.dataclass(frozen=True)
class _Plan:
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


class AllGatherGemm(FusedOp):
    """A reusable fused AllGather+GEMM bound to one group; keeps its gather buffer between calls.

    ``policy``: ``"auto"`` picks the fused or the unfused path (NCCL all-gather, then GEMM) per shape,
    ``"fused"`` and ``"fallback"`` force one; ``"oneshot"`` (opt-in until measured on two GPUs) takes
    the one-shot path on every call: the shard into a symmetric gather buffer, one kernel that copies
    the peers' shards out of theirs over NVLink, one cuBLAS GEMM (``_oneshot``; NCCL under CUDA-graph
    capture, where its epochs would not advance). ``transport``: ``"mesh"`` or ``"ring"`` (module
    docstring), or ``"chunked"``: the mesh transport with cuBLAS instead of the fused kernel, one GEMM
    for the own rows (while the shards travel), then one per peer's rows as its flag arrives (a stream
    wait).
    ``"auto"`` (default): chunked or mesh per shape (``heuristics.all_gather_transport``).
    ``graphable=True``: constant-valued flags (module docstring), so that calls on the fused paths can
    be captured in a CUDA graph.
    """

    op_name = _OP
    policies = ("auto", "fused", "oneshot", "fallback")
    transports = TRANSPORTS
    transport_env = "TILEWEAVE_AG_TRANSPORT"
    default_transport = "auto"
    graphable_transports = TRANSPORTS
    _lent: tuple | None = None
    """``(backend, flag values, arrivals, releases)`` of a call whose gathered view the caller holds:
    released by this rank's next call."""

    option_envs = {"head_split": "TILEWEAVE_AG_HEAD_SPLIT", "replay": "TILEWEAVE_REPLAY",
                   "stream_k": "TILEWEAVE_AG_STREAM_K"}

    def __init__(self, group: dist.ProcessGroup | None = None, *, head_split: bool = False,
                 stream_k: bool | None = None, **kwargs) -> None:
        """``head_split`` (opt-in, every rank alike; ``TILEWEAVE_AG_HEAD_SPLIT=1`` for the shared op): the
        chunked transport at two ranks runs a first GEMM on only enough of the own rows to hide
        the shard's transfer (``heuristics.all_gather_head_rows``) and a second over all the other
        rows, which lie contiguous in the gather buffer, instead of one GEMM per shard (two GEMMs of
        half the rows cost 2-7% over one, NOTES.md entry 37). Not for graphable ops. Measured on 2x H200
        over the suite's rows with M 2048-8192, chunked transport: no faster than one GEMM per shard
        (within 1% on the rows with a head, NOTES.md entry 50); kept for other GPUs and shapes. Other
        arguments: :class:`FusedOp`.

        ``stream_k`` (every rank alike; ``TILEWEAVE_AG_STREAM_K`` for the shared op): whether the fused
        kernel shares the tiles of its last, partial wave out by K steps over every program, as the plain
        GEMM's stream-K does, instead of leaving the programs without a whole tile idle. None (default):
        where ``heuristics.all_gather_stream_k`` says so (from 20 full waves; on 2x H200 1.023x on
        gpt3-175b fc1 M=4096, 1.012x on llama3-70b gate_up M=8192, slower with fewer waves: NOTES.md,
        entry 61); with a ``config`` given, as that config says. Only where the partial wave's tiles all
        lie in the last chunk (``_launch.ag_stream_k_tail``); elsewhere whole tiles."""
        super().__init__(group, **kwargs)
        self.head_split = head_split
        self.stream_k = stream_k

    stream_k = option("stream_k")

    def _stream_k_tail(self, config: GemmConfig, m: int, n: int, k: int, backend: Backend) -> bool:
        """The ``stream_k`` option (``__init__``), where the kernel can take the tail at all."""
        w = backend.world_size
        programs = self._programs(config, backend, False)
        if not _launch.ag_stream_k_tail(m // w, n, config, w, programs):
            return False
        if self.stream_k is not None:
            return self.stream_k
        if self.config is not None:
            return self.config.stream_k
        return heuristics.all_gather_stream_k(m // w, n, k, w, config.block_m, config.block_n, programs)

    def gather_buffer(self, m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's ``[M, K]`` gather buffer. A producer that writes its output straight into rows
        ``[r*M/W, (r+1)*M/W)`` of it and passes that view as ``a_shard`` saves the copy that
        ``return_gathered`` otherwise makes."""
        backend = self._get_backend(device)
        return self._workspace(backend, m * k * _itemsize(dtype)).data.view(backend.rank, dtype, (m, k))

    def _workspace(self, backend: Backend, nbytes: int) -> Workspace:
        # The caller is done with a gathered view lent by the last call: release it first (and before a
        # growing workspace frees the flags it names).
        self._return_lent()
        # A graphable op's RELEASED words start at 1 ("free"), an epoch op's at epoch 0.
        self._ws = ensure_workspace(self._ws, backend, nbytes, released=released_start(self.graphable))
        return self._ws

    def _return_lent(self) -> None:
        lent = self._lent
        if lent is not None:
            self._lent = None
            backend, values, arrivals, releases = lent
            values.release(backend, arrivals, releases)

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, return_gathered: bool = False,
                 gathered_out: torch.Tensor | None = None):
        """See the module docstring. Returns ``out`` or ``(out, gathered)``; ``gathered`` is a view of
        the workspace, valid until the next call of this object (or of ``gather_buffer``) on this rank:
        the call lends the buffer to the caller and releases it to the peers only then, so a peer that
        runs ahead cannot refill it while the caller's kernels still read it. Read it on the stream of
        the call. A graphable op returns a fresh tensor instead (a release deferred to the next call
        would not replay in a CUDA graph). With ``gathered_out`` (a contiguous ``[M, K]`` tensor) the
        copy stream writes the gathered input there, each shard once it has arrived, and that tensor is
        returned. With the chunked transport those copies run between the GEMMs; next to the fused
        kernel they wait for it (a local device-to-device copy needs SMs, DESIGN.md), which still costs
        less than copying the workspace afterwards."""
        if self._graphs and out is None and not return_gathered and gathered_out is None:
            replayed = self._replay_hit(a_shard, b, bias)
            if replayed is not None:
                return replayed
        if gathered_out is not None:
            return_gathered = True
        elif return_gathered and self.graphable:
            gathered_out = gathered_like(a_shard, self._get_backend(a_shard.device).world_size)
        signature, backend = self._unfused_route(a_shard, b, bias, out)
        if backend is not None:  # the unfused path: captures in a CUDA graph like any NCCL + cuBLAS code
            if gathered_out is not None:
                _check_gathered_out(gathered_out, a_shard, backend.world_size)
            return self._fallback(backend, a_shard, b, None, None, return_gathered, gathered_out)
        if self._routes and signature is not None and not _launch.capturing(a_shard):
            route = self._routes.get(signature)
            if route is not None:  # decided before: no checks, no decision (host time is the point)
                path, backend, config = route
                if gathered_out is not None:
                    _check_gathered_out(gathered_out, a_shard, backend.world_size)
                if path == "oneshot":
                    return self._oneshot(backend, a_shard, b, None, None, return_gathered, gathered_out)
                return self._fused(backend, a_shard, b, None, None, return_gathered, gathered_out, config, False)
        _launch.check_matrix("a_shard", a_shard)
        _launch.check_matrix("b", b, dtype=a_shard.dtype, device=a_shard.device)
        _launch.check_runs_dtype(_OP, "a_shard", a_shard)
        mc, k = a_shard.shape
        if b.shape[0] != k:
            raise ValueError(f"a_shard is [M/W={mc}, K={k}] but b is {list(b.shape)}: b must be [K={k}, N_loc]")
        n = b.shape[1]
        backend = self._get_backend(a_shard.device)
        w = backend.world_size
        m = mc * w
        bias = _launch.check_bias(bias, n, a_shard.dtype, a_shard.device)
        out = _launch.check_out(out, (m, n), a_shard.dtype, a_shard.device)
        if gathered_out is not None:
            _check_gathered_out(gathered_out, a_shard, w)
        if w == 1:
            from tileweave.ops.matmul import matmul

            out = matmul(a_shard, b, bias=bias, out=out)
            _launch.record_path(_OP, "local")
            if gathered_out is not None:
                return out, gathered_out.copy_(a_shard)
            return (out, a_shard) if return_gathered else out
        if not return_gathered:
            replayed = self._replayed(a_shard, b, bias, out, 2.0 * m * n * k / 1e9)
            if replayed is not None:
                return replayed

        capturing = _launch.capturing(a_shard)
        path, config, first = self._decide(backend, m, n, k, a_shard.dtype, a_shard.device,
                                           heuristics.prefer_fused_all_gather, (mc, k, n), bias is not None,
                                           capturing)
        if path == "oneshot" and not capturing:  # under capture: NCCL, as every rank does
            if signature is not None:
                self._routes[signature] = ("oneshot", backend, None)
            return self._oneshot(backend, a_shard, b, bias, out, return_gathered, gathered_out)
        if path != "fused":
            if signature is not None and path == "fallback":  # not a one-shot signature met under capture
                self._unfused[signature] = backend
            return self._fallback(backend, a_shard, b, bias, out, return_gathered, gathered_out)
        if signature is not None and not self.replay and not capturing:
            # A repeat takes the route above (with replay, a repeat without return_gathered may replay).
            self._routes[signature] = ("fused", backend, config)
        return self._fused(backend, a_shard, b, bias, out, return_gathered, gathered_out, config, first)

    def _fused(self, backend: Backend, a_shard, b, bias, out, return_gathered: bool, gathered_out, config,
               first: bool):
        """The fused path (a transport of ``self.transport``), for a decided call of ``config``."""
        mc, k = a_shard.shape
        n = b.shape[1]
        w, rank = backend.world_size, backend.rank
        m = mc * w
        if out is None:
            out = torch.empty((m, n), dtype=a_shard.dtype, device=a_shard.device)
        transport = self.transport
        if transport == "auto":  # a function of the shapes, which every rank has just agreed on
            transport = heuristics.all_gather_transport(m, n, k, w, a_shard.dtype, interpreter=backend.interpreter)

        chunked, ring = transport == "chunked", transport == "ring"
        head = 0
        if chunked and w == 2 and self.head_split and not self.graphable:
            head = heuristics.all_gather_head_rows(mc, n, k, a_shard.element_size(),
                                                   local_copies=2 if gathered_out is not None else 1)
        ws, plan, a_shard, values = self._start(backend, a_shard, ring)
        gathered = plan.gathered
        if gathered_out is not None:
            self._copy_out(backend, ws, plan, a_shard, gathered_out, values.ready)
        elif (return_gathered or head) and plan.own_slot.data_ptr() != a_shard.data_ptr():
            backend.comm_copy(plan.own_slot, a_shard)
        if head:
            # The second GEMM reads rows that the copy stream has just written: it says when.
            landed = ws.flag_address(rank, COUNTERS, 0)
            backend.comm_write(landed, values.ready)
            self._head_split_gemms(backend, ws, a_shard, gathered if gathered_out is None else gathered_out, b,
                                   bias, out, values.ready, landed, head, wait_peer=gathered_out is None)
        elif chunked:
            self._chunked_gemms(backend, ws, a_shard, gathered, b, bias, out, values.ready)
        else:
            self._launch_kernel(backend, first, mode=_launch.MODE_AG, a=a_shard, buf=gathered, b=b, c=out,
                                bias=bias, config=config, m_chunk=mc, rank=rank, world=w,
                                programs=self._programs(config, backend, False),
                                flags=ws.flag_slice(READY), err=ws.err, epoch=values.ready,
                                max_spin=self.max_spin or backend.default_max_spin, ring=ring)
        # Released only once our copy stream is done too: a ring forwards chunks out of this buffer, and
        # a peer must not refill it while a forward still reads it. A gathered view returned to the
        # caller is released by this rank's next call instead.
        backend.comm_end()
        if return_gathered and gathered_out is None:
            self._lent = (backend, values, plan.arrivals, plan.releases)
        else:
            values.release(backend, plan.arrivals, plan.releases)
        if chunked:
            self._finish_without_kernel(backend)
        else:
            self._finish(backend, ws)
        _launch.record_path(_OP, "chunked" if chunked else "fused")
        if gathered_out is not None:
            return out, gathered_out
        return (out, gathered) if return_gathered else out

    def _oneshot(self, backend: Backend, a_shard, b, bias, out, return_gathered: bool, gathered_out):
        """The one-shot path (``policy="oneshot"``): the shard into its rows of this call's slot of the
        one-shot buffer (a symmetric ``[M, K]`` gather buffer), then one kernel
        (``tileweave.kernels.oneshot``) that signals the peers, waits for theirs and copies their rows
        of their slots into ours over NVLink, then one cuBLAS GEMM over the whole slot. Two slots, used
        in turn (``oneshot_slots``): no call waits for anything but the peers' shards of the same call,
        and a returned gathered view stays intact until this rank's call after next (more than the op
        promises: until its next call)."""
        self._return_lent()
        mc, k = a_shard.shape
        rank = backend.rank
        m = mc * backend.world_size
        ws, gathered, gather_plan, epoch = self._oneshot_start(backend, m, k, a_shard.dtype)
        # Tensor.copy_: one driver copy was no cheaper on the host (NOTES.md, entry 82).
        gathered[rank * mc:(rank + 1) * mc].copy_(a_shard)
        _launch.launch_gather_rows(gather_plan, gathered, epoch)
        if out is None:  # cuBLAS allocating its output costs the host less than writing into one (_fallback)
            out = torch.mm(gathered, b) if bias is None else torch.addmm(bias, gathered, b)
        elif bias is None:
            torch.mm(gathered, b, out=out)
        else:
            torch.addmm(bias, gathered, b, out=out)
        self._oneshot_finish(backend, ws)
        if gathered_out is not None:
            return out, gathered_out.copy_(gathered)
        return (out, gathered) if return_gathered else out

    def _oneshot_plan(self, backend: Backend, m: int, k: int, dtype: torch.dtype) -> tuple:
        """The workspace's one-shot buffer sized for two ``[M, K]`` gather buffers, and one shape's two
        slots and launch plan."""
        ws = self._workspace(backend, 0)
        slots = oneshot_slots(ws, (m, k), dtype)
        w = backend.world_size
        plan = ws.plans[("oneshot", m, k, dtype)] = (slots, self._oneshot_launch_plan(
            backend, ws, dtype, rows=m // w, cols=k, parts=w - 1))
        return plan

    @staticmethod
    def _copy_out(backend: Backend, ws: Workspace, plan: "_Plan", a_shard, gathered_out, ready: int) -> None:
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

    @staticmethod
    def _chunked_gemms(backend: Backend, ws: Workspace, a_shard, gathered, b, bias, out, ready: int) -> None:
        """cuBLAS in the fused kernel's order: the own rows from the caller's shard, then each peer's
        rows once the caller's stream has waited for that peer's flag to reach ``ready``."""
        w, rank = backend.world_size, backend.rank
        mc = a_shard.shape[0]
        for step in range(w):
            src = (rank + step) % w
            rows = slice(src * mc, (src + 1) * mc)
            if step:
                backend.main_wait(ws.flag_address(rank, READY, src), ready)
            lhs = a_shard if step == 0 else gathered[rows]
            if bias is not None:
                torch.addmm(bias, lhs, b, out=out[rows])
            else:
                torch.mm(lhs, b, out=out[rows])

    @staticmethod
    def _head_split_gemms(backend: Backend, ws: Workspace, a_shard, source, b, bias, out, ready: int, landed: int,
                          head: int, *, wait_peer: bool) -> None:
        """Two ranks: cuBLAS on ``head`` own rows from the caller's shard while the shards travel, then
        on every other row at once from ``source`` (the gather buffer, or the caller's gathered tensor
        that the copy stream fills), once the copy stream has raised ``landed``. Rank 0's head is the
        start of its rows and rank 1's the end, so that the rest is one contiguous block of rows."""
        rank = backend.rank
        mc = a_shard.shape[0]
        if rank == 0:
            first, lhs, rest = slice(0, head), a_shard[:head], slice(head, 2 * mc)
        else:
            first, lhs, rest = slice(2 * mc - head, 2 * mc), a_shard[mc - head:], slice(0, 2 * mc - head)
        for rows, a_rows in ((first, lhs), (rest, None)):
            if a_rows is None:
                if wait_peer:  # a caller's tensor is filled only after the peer's flag: landed says it all
                    backend.main_wait(ws.flag_address(rank, READY, 1 - rank), ready)
                backend.main_wait(landed, ready)
                a_rows = source[rows]
            if bias is not None:
                torch.addmm(bias, a_rows, b, out=out[rows])
            else:
                torch.mm(a_rows, b, out=out[rows])

    def all_gather(self, a_shard: torch.Tensor) -> "PendingGather":
        """Start gathering ``a_shard [M/W, K]`` into this op's ``[M, K]`` buffer, without a GEMM: the
        same copy-engine transport, so it needs no SM and can run next to kernels that spin on their
        peers. ``wait()`` on the result makes the caller's stream wait for every shard and returns the
        buffer; ``release()``, once the kernels that read it are enqueued, lets the peers refill it.
        Collective like a call of the op: every rank, in the same order; no other call of this object
        between the start and ``release()``."""
        _launch.check_matrix("a_shard", a_shard)
        _launch.check_runs_dtype(_OP, "a_shard", a_shard)
        backend = self._get_backend(a_shard.device)
        w = backend.world_size
        mc, k = a_shard.shape
        if w == 1:
            return PendingGather(backend, a_shard, ())
        if self.policy == "fallback":
            gathered = a_shard.new_empty((mc * w, k))
            dist.all_gather_into_tensor(gathered, a_shard.contiguous(), group=backend.group)
            return PendingGather(backend, gathered, ())
        if not self.graphable:
            _launch.check_not_capturing(_OP, a_shard)
        agree(backend, self._agreed, self.op_name, ("all_gather", mc, k, str(a_shard.dtype)), None)
        ws, plan, a_shard, values = self._start(backend, a_shard, self.transport == "ring")
        if plan.own_slot.data_ptr() != a_shard.data_ptr():
            backend.comm_copy(plan.own_slot, a_shard)
        return PendingGather(backend, plan.gathered, plan.releases, values=values, arrivals=plan.arrivals)

    def _start(self, backend: Backend, a_shard: torch.Tensor, ring: bool) -> tuple:
        """``(workspace, plan, a_shard, flag values)`` of a new call, its copies queued: the part a call
        of the op and a gather alone share."""
        self._check_previous(_launch.capturing(a_shard))
        mc, k = a_shard.shape
        ws = self._workspace(backend, mc * backend.world_size * k * a_shard.element_size())
        a_shard = a_shard if a_shard.is_contiguous() else a_shard.contiguous()
        plan = self._plan(ws, backend, mc, k, a_shard.dtype, ring)
        ws.epoch += 1
        values = FlagValues(ws.epoch, self.graphable)
        self._push(backend, plan, a_shard, values)
        return ws, plan, a_shard, values

    @staticmethod
    def _push(backend: Backend, plan: "_Plan", a_shard: torch.Tensor, values: FlagValues) -> None:
        """Queue this call's copies on the copy stream. Mesh: our shard to every peer, nearest consumer
        first (rank r - i computes our rows at its step i). Ring: our shard, then each chunk from rank-1
        as it arrives, all to rank+1. Each copy waits until its destination was released for this
        call (``FlagValues.claim``), and is followed by the destination's ready flag."""
        backend.comm_begin()
        for slot, released, ready, arrived, source in plan.pushes:
            if released is not None:
                values.claim(backend, released)
            if arrived is not None:  # a ring forwards a chunk once it has it
                backend.comm_wait(arrived, values.ready)
            backend.comm_copy(slot, a_shard if source is None else source)
            backend.comm_write(ready, values.ready)

    @staticmethod
    def _plan(ws: Workspace, backend: Backend, mc: int, k: int, dtype: torch.dtype, ring: bool) -> "_Plan":
        key = ("ag", mc, k, dtype, ring)
        plan = ws.plans.get(key)
        if plan is None:
            w, rank = backend.world_size, backend.rank
            rows = lambda r: slice(r * mc, (r + 1) * mc)  # noqa: E731
            gathered = ws.data.view(rank, dtype, (mc * w, k))
            pushes = []
            if ring:
                nxt = (rank + 1) % w
                peer_buf = ws.data.view(nxt, dtype, (mc * w, k))
                for i in range(1, w):
                    chunk = (rank - i + 1) % w  # ours first, then what rank-1 forwarded to us
                    pushes.append((peer_buf[rows(chunk)],
                                   ws.flag_address(rank, RELEASED, nxt) if i == 1 else None,
                                   ws.flag_address(nxt, READY, chunk),
                                   None if i == 1 else ws.flag_address(rank, READY, chunk),
                                   None if i == 1 else gathered[rows(chunk)]))
            else:
                for i in range(1, w):
                    peer = (rank - i) % w
                    pushes.append((ws.data.view(peer, dtype, (mc * w, k))[rows(rank)],
                                   ws.flag_address(rank, RELEASED, peer), ws.flag_address(peer, READY, rank),
                                   None, None))
            plan = ws.plans[key] = _Plan(gathered=gathered, own_slot=gathered[rows(rank)], pushes=tuple(pushes),
                                         releases=tuple(ws.flag_address(p, RELEASED, rank)
                                                        for p in range(w) if p != rank),
                                         arrivals=tuple(ws.flag_address(rank, READY, src)
                                                        for src in range(w) if src != rank))
        return plan

    def _fallback(self, backend: Backend, a_shard, b, bias, out, return_gathered, gathered=None):
        if gathered is None:
            gathered = torch.empty((a_shard.shape[0] * backend.world_size, a_shard.shape[1]),
                                   dtype=a_shard.dtype, device=a_shard.device)
        a_shard = a_shard.contiguous()
        if a_shard.is_cuda:
            dist.all_gather_into_tensor(gathered, a_shard, group=backend.group)
        else:
            dist.all_gather(list(gathered.chunk(backend.world_size)), a_shard, group=backend.group)
        if a_shard.is_cuda:
            # cuBLAS allocating its own output costs the host about half of writing into a given one
            # (torch.matmul or torch.mm with out=: ~40 us against ~20 us a call on the GPU hosts, NOTES.md
            # entries 28 and 44).
            if out is None:
                out = torch.matmul(gathered, b) if bias is None else torch.addmm(bias, gathered, b)
            elif bias is None:
                torch.mm(gathered, b, out=out)
            else:
                torch.addmm(bias, gathered, b, out=out)
        else:
            from tileweave.ops.matmul import matmul

            out = matmul(gathered, b, bias=bias, out=out)
        _launch.record_path(_OP, "fallback")
        return (out, gathered) if return_gathered else out


class PendingGather:
    """An all-gather in flight on the copy engines (``AllGatherGemm.all_gather``)."""

    def __init__(self, backend: Backend, gathered: torch.Tensor, releases: tuple, *,
                 values: FlagValues | None = None, arrivals: tuple = ()) -> None:
        self._backend, self._gathered, self._releases = backend, gathered, releases
        self._values, self._arrivals = values, arrivals

    def wait(self) -> torch.Tensor:
        """The ``[M, K]`` gathered tensor, once the caller's stream has waited for every shard."""
        for address in self._arrivals:
            self._backend.main_wait(address, self._values.ready)
        self._backend.comm_end()  # our own rows, copied on the copy stream
        if _launch.debug_mode() and not _launch.capturing(self._gathered):
            self._backend.synchronize()  # bounded: a lost peer raises here instead of hanging
        return self._gathered

    def release(self) -> None:
        """Let the peers fill the buffer for the next call (after the kernels that read it)."""
        if self._values is not None:
            self._values.release(self._backend, self._arrivals, self._releases)
        self._releases = self._arrivals = ()


def cached_op(group: dist.ProcessGroup, device: torch.device) -> AllGatherGemm:
    """The op shared by every functional call on ``group`` and ``device``."""
    return AllGatherGemm.shared(group, device)


def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    return_gathered: bool = False):
    """Functional form of :class:`AllGatherGemm` (module docstring: shapes and semantics).

    Uses one cached op per (group, device); ``gathered``, when returned, is a fresh tensor here (the
    workspace is shared by every caller of this function), so it stays valid; the op's copy stream
    fills it (``gathered_out``). Under ``torch.compile`` this is the custom op
    ``torch.ops.tileweave.all_gather_gemm``.
    """
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        from tileweave.ops import registry

        if return_gathered:
            result, gathered = registry.all_gather_gemm_gathered_op(a_shard, b, bias, group.group_name)
        else:
            result = registry.all_gather_gemm_op(a_shard, b, bias, group.group_name)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, gathered) if return_gathered else result
    op = cached_op(group, a_shard.device)
    if not return_gathered:
        return op(a_shard, b, bias=bias, out=out)
    return op(a_shard, b, bias=bias, out=out, gathered_out=gathered_like(a_shard, dist.get_world_size(group)))


def _check_gathered_out(gathered_out: torch.Tensor, a_shard: torch.Tensor, world: int) -> None:
    mc, k = a_shard.shape
    _launch.check_out(gathered_out, (mc * world, k), a_shard.dtype, a_shard.device, name="gathered_out")
    if not gathered_out.is_contiguous():
        raise ValueError(f"gathered_out must be contiguous, got strides {gathered_out.stride()}")


def gathered_like(a_shard: torch.Tensor, world: int) -> torch.Tensor:
    """A fresh contiguous ``[M, K]`` tensor for the gathered ``a_shard``."""
    return torch.empty((a_shard.shape[0] * world, a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
