"""GEMM + ReduceScatter, fused: the row-parallel forward of sequence-parallel TP.

==================  ==========================  ==========================================
tensor              shape (per rank)            meaning
==================  ==========================  ==========================================
``a``               ``[M, K_loc]``              activations, this rank's slice of K
``b``               ``[K_loc, N]``              this rank's rows of the weight
                                                (``weight.t()`` of an ``[N, K_loc]`` weight is
                                                read in place)
``bias``            ``[N]``                     optional, added once (not once per rank)
result              ``[M / W, N]``              rows ``[r*M/W, (r+1)*M/W)`` of
                                                ``sum over ranks (a @ b)`` + bias
==================  ==========================  ==========================================

Transports. ``chunked`` (the default) runs cuBLAS per owner and row block and moves each finished
block with the copy engines, overlapping it with the next block's GEMM; ``store`` and ``copy_engine``
are the fused kernel described next. ``policy="auto"`` takes the chunked transport where
``tune.heuristics`` measured it faster than GEMM + NCCL reduce-scatter, the unfused path elsewhere.
``policy="oneshot"`` (opt-in until measured on two GPUs) is an unfused path without NCCL: one cuBLAS
GEMM into a symmetric buffer, then one kernel that sums this rank's rows of every rank's partial
(``GemmReduceScatter._oneshot``): two launches a call, for the small rows, where the host's time to
issue a call bounds both the chunked transport and NCCL + cuBLAS.

The store transport, in one persistent kernel. Each rank computes the rows owned by rank r+1 first, then
r+2, ..., its own rows last. A finished tile of a peer's rows is stored in the output dtype straight
into that peer's receive buffer over NVLink (its slot for this source) and counted in the peer's
counter for this source. The own rows come last: once every peer's tiles of them are in, each own
tile sums the W partials in fp32 in rank order (the own partial straight from registers) and writes
the result, so the output is deterministic: bitwise the same from run to run.

Memory: one receive buffer of ``[W, M/W, N]`` in the output dtype per op, and 3W+1 flag words.
Before writing into a peer's receive buffer for the next call, a rank's stream waits until that peer
has released it (a stream memory op, no barrier, no SM).

Capture in a CUDA graph (``graphable=True``, chunked transport): as for AllGather+GEMM, the flags
hold 0 or 1 so that a replay writes what the capture wrote. A producer waits until its RELEASED word
for an owner is 1, sets it to 0, and after each block's copy sets the owner's arrival word for it to
1; the owner waits for arrival == 1, adds the block, and once all are in sets its arrival words back
to 0 and then each producer's RELEASED word to 1. RELEASED words start at 1.

Concurrency: all ranks must call the op the same number of times in the same order.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from tileweave.ops import _launch
from tileweave.ops._fused import FusedOp, option
from tileweave.ops.workspace import (CE_ARRIVAL, CE_COUNTERS, CE_SENT, COUNTERS, RELEASED, FlagValues, Workspace,
                                     ensure_workspace, oneshot_slots, released_start)
from tileweave.runtime.backend import Backend, TileweaveError
from tileweave.tune import heuristics
from tileweave.tune.configs import GemmConfig

_OP = "gemm_reduce_scatter"
CE_GROUPS = 256  # tileweave.kernels.gemm.CE_GROUPS
TRANSPORTS = ("store", "copy_engine", "chunked")
CHUNK_ROWS = 1024
CHUNK_GFLOP = 48.0
"""The chunked transport's blocks: at least ``CHUNK_ROWS`` rows, doubled until a block's GEMM has
``CHUNK_GFLOP`` (about 75 us on an H200), so that the host's cost per block (a GEMM, an event, a copy
and a flag: tens of microseconds) stays hidden behind the GPU's work. Measured on 2x H200 (NOTES.md,
entry 17): 1024-row blocks at K_loc=2048 were host-bound (1.6x the time of one block per owner);
at K_loc 4096 and 7168 1024-row blocks beat 2048-row ones by 1-4%."""


def chunk_rows_for(mc: int, k: int, n: int) -> int:
    """Rows per block of the chunked transport for ``mc`` rows per owner of a ``[., k] x [k, n]`` GEMM
    (the same on every rank: it depends on the agreed shape alone)."""
    rows = CHUNK_ROWS
    while rows < mc and 2.0 * rows * k * n < CHUNK_GFLOP * 1e9:
        rows *= 2
    return rows


PULL_MAX_BLOCKS = 2
"""The pulling transport's blocks per owner at most. Its caller's stream runs the peer's blocks, then the
own blocks added in place onto the pulled ones, so a pull hides behind the own blocks before it
whenever a block's pull is no slower than its GEMM (K_loc above ~1800 at ~650 TFLOP/s and ~365 GB/s),
and more blocks only cut the GEMMs smaller. On one H200, the caller's stream of a pulling call without
its transfer (``scripts/rs_blocks_probe.py``, NOTES.md entry 77): two blocks per owner were the fastest
or within 0.2% of it on all 15 of the suite's rows with M >= 4096, and 0.4-3.7% faster than the 4 or 8
blocks of :func:`chunk_rows_for` on the 8 rows where it takes them. (The pushing transport keeps those:
its last block's copy is exposed, so smaller blocks pay there.)"""


def blocks_for(mc: int, k: int, n: int, *, pull: bool = False, chunk_rows: int = 0) -> int:
    """Row blocks per owner of a chunked call (the same on every rank: from the agreed shape): blocks of
    ``chunk_rows`` rows, or of :func:`chunk_rows_for`'s, at most ``CE_GROUPS``; a pulling call (two
    ranks) takes at most ``PULL_MAX_BLOCKS`` of the latter."""
    blocks = max(1, min(CE_GROUPS, mc // (chunk_rows or chunk_rows_for(mc, k, n))))
    return min(blocks, PULL_MAX_BLOCKS) if pull and not chunk_rows else blocks


@dataclasses.dataclass(frozen=True)
class _CopyPlan:
    """Views and flag addresses of one shape for the copy-engine transport."""

    steps: tuple
    """Per owner, in kernel order: (our RELEASED flag for it, per row group: (our counter, tiles in
    the group, its receive rows for us, our send rows, its arrival flag for us), our sent flag for
    the step)."""
    releases: tuple


class GemmReduceScatter(FusedOp):
    """A reusable fused GEMM+ReduceScatter bound to one group; keeps its receive buffer.

    ``policy``: ``"auto"`` picks the fused or the unfused path (GEMM, then NCCL reduce-scatter) per
    shape; ``"fused"`` and ``"fallback"`` force one; ``"oneshot"`` takes the one-shot path on every
    call (module docstring; NCCL under CUDA-graph capture, where its epochs would not advance).
    ``transport``: ``"store"`` (the epilogue stores peer tiles into their owners' buffers over NVLink),
    ``"copy_engine"`` (local send buffer, copied by the copy engines per row group; memory
    ``2 (W-1)/W x [M, N]``) or ``"chunked"`` (the default; no fused
    kernel: cuBLAS GEMMs per owner and row block, owners' blocks first, each copied to its owner by the
    copy engines as soon as it is done; the own rows last, each block adding the arrived partials in
    its GEMM; memory ``2 (W-1)/W x [M, N]``: the receive slots and a send buffer).
    """

    op_name = _OP
    policies = ("auto", "fused", "oneshot", "fallback")
    transports = TRANSPORTS
    transport_env = "TILEWEAVE_RS_TRANSPORT"
    default_transport = "chunked"
    graphable_transports = ("chunked",)
    chunk_rows = 0
    """Rows per block of the chunked transport, 0 for :func:`chunk_rows_for` (every rank must use the
    same)."""

    option_envs = {"pull": "TILEWEAVE_RS_PULL", "replay": "TILEWEAVE_REPLAY"}

    def __init__(self, group: dist.ProcessGroup | None = None, *, pull: bool | None = None, **kwargs) -> None:
        """``pull`` (every rank must set it alike; ``TILEWEAVE_RS_PULL`` for the shared op): whether the
        chunked transport in a group of two pulls instead of pushing. Each rank computes the peer's row
        blocks into its symmetric buffer, and the owner's copy stream pulls them straight into the output
        rows, on which the own rows' GEMM then accumulates in place (with one block per owner: into a
        private buffer while the own GEMM runs, then one add; see ``_chunked_pull``). This saves the
        local device-to-device copy that an out-of-place ``addmm`` makes of every received partial (0.2
        ms a call on 8192 x 6144 x 49152, NOTES.md entries 45 and 49): faster than pushing on all 15 of
        the suite's rows with M >= 4096 on 2x H200. None (the default): pull wherever it applies, which
        is not in a graphable op (its flags carry epochs; True there raises); other group sizes, and an
        ``out`` with padded rows, push.
        Other arguments: :class:`FusedOp`."""
        super().__init__(group, **kwargs)
        self.pull = (not self.graphable) if pull is None else pull

    def _check_pull(self, pull) -> None:
        if pull and self.graphable:
            raise TileweaveError("GemmReduceScatter: pull=True is not graphable (its flags carry epochs); "
                                 "use graphable=True without pull")

    pull = option("pull", _check_pull)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if self._graphs and out is None:
            replayed = self._replay_hit(a, b, bias)
            if replayed is not None:
                return replayed
        signature, backend = self._unfused_route(a, b, bias, out)
        if backend is not None:  # the unfused path: captures in a CUDA graph like any NCCL + cuBLAS code
            return self._fallback(backend, a, b, None, a.new_empty((a.shape[0] // backend.world_size, b.shape[1])))
        if self._routes and signature is not None and not _launch.capturing(a):
            route = self._routes.get(signature)
            if route is not None:  # decided before: no checks, no decision (host time is the point)
                path, backend, _ = route
                out = a.new_empty((a.shape[0] // backend.world_size, b.shape[1]))
                if path == "oneshot":
                    self._oneshot(backend, a, b, None, out)
                else:  # "pull": an earlier fused kernel's expired wait is reported first, as below
                    self._check_previous()
                    self._chunked_pull(backend, a, b, None, out, a.shape[0], b.shape[1])
                return out
        _launch.check_matrix("a", a)
        _launch.check_matrix("b", b, dtype=a.dtype, device=a.device)
        _launch.check_runs_dtype(_OP, "a", a)
        m, k = a.shape
        if b.shape[0] != k:
            raise ValueError(f"a is [M={m}, K_loc={k}] but b is {list(b.shape)}: b must be [K_loc={k}, N]")
        n = b.shape[1]
        backend = self._get_backend(a.device)
        w, rank = backend.world_size, backend.rank
        if m % w:
            raise ValueError(f"gemm_reduce_scatter scatters the M={m} rows of a over {w} ranks: M must be "
                             f"divisible by the group size {w} (pad M to {-(-m // w) * w})")
        mc = m // w
        bias = _launch.check_bias(bias, n, a.dtype, a.device)
        out = _launch.check_out(out, (mc, n), a.dtype, a.device)
        if w > 1:
            replayed = self._replayed(a, b, bias, out, 2.0 * m * n * k / 1e9)
            if replayed is not None:
                return replayed
        if out is None:
            out = torch.empty((mc, n), dtype=a.dtype, device=a.device)
        if w == 1:
            from tileweave.ops.matmul import matmul

            matmul(a, b, bias=bias, out=out)
            _launch.record_path(_OP, "local")
            return out

        overrides = {"copy_engine": True} if self.transport == "copy_engine" else {}
        capturing = _launch.capturing(a)
        # The pulling thresholds go by the op's setting: a call into an ``out`` with padded rows, which
        # pushes, is decided as if it pulled (right either way, a little slower on the smallest rows).
        path, config, first = self._decide(backend, m, n, k, a.dtype, a.device,
                                           functools.partial(heuristics.prefer_fused_reduce_scatter,
                                                             transport=self.transport, pull=self.pull),
                                           (m, k, n), bias is not None, capturing,
                                           **overrides)
        if path == "oneshot" and not capturing:  # under capture: NCCL, as every rank does
            if signature is not None:
                self._routes[signature] = ("oneshot", backend, None)
            self._oneshot(backend, a, b, bias, out)
            return out
        if path != "fused":
            if signature is not None and path == "fallback":  # not a one-shot signature met under capture
                self._unfused[signature] = backend
            return self._fallback(backend, a, b, bias, out)

        self._check_previous(capturing)
        if a.stride(1) != 1 and a.stride(0) != 1:
            a = a.contiguous()
        if self.transport == "chunked" and self.pull and w == 2 and out.is_contiguous():  # copies land in out
            if signature is not None:  # no bias, no out: a repeat takes the route above
                self._routes[signature] = ("pull", backend, None)
            self._chunked_pull(backend, a, b, bias, out, m, n)
            return out
        if self.transport == "chunked":
            self._chunked(backend, a, b, bias, out, m, n)
            return out
        if config.copy_engine:
            self._fused_copy_engine(backend, a, b, bias, out, config, m, n, first)
            return out
        self._ws = ensure_workspace(self._ws, backend, m * n * a.element_size())
        ws = self._ws
        ws.epoch += 1
        epoch = ws.epoch
        # Each source adds its tiles of our chunk to our counter for it; the kernel waits for the
        # running total (int32, wrapping, compared cyclically), so counters are never reset.
        ws.count_expected += _launch.tiles_per_chunk(mc, n, config)
        plan = ws.plans.get(("rs", m, n, a.dtype))
        if plan is None:
            peers = [p for p in range(w) if p != rank]
            plan = ws.plans[("rs", m, n, a.dtype)] = (
                ws.data.view(rank, a.dtype, (m, n)),
                tuple(ws.flag_address(rank, RELEASED, p) for p in peers),
                tuple(ws.flag_address(p, RELEASED, rank) for p in peers))
        recv, waits, releases = plan
        # The receive buffers we are about to fill must have been released by their owners.
        for address in waits:
            backend.main_wait(address, epoch - 1)
        self._launch_kernel(backend, first, mode=_launch.MODE_RS, a=a, b=b, c=out, bias=bias, config=config,
                            m_chunk=mc, rank=rank, world=w,
                            programs=self._programs(config, backend, True),
                            buf=recv, peer_offsets=ws.data_offsets(a.element_size()),
                            peer_flags=ws.counter_addresses(), flags=ws.flag_slice(COUNTERS), err=ws.err,
                            epoch=ws.count_expected, max_spin=self.max_spin or backend.default_max_spin)
        for address in releases:
            backend.main_write(address, epoch)
        self._finish(backend, ws)
        _launch.record_path(_OP, "fused")
        return out

    def _oneshot(self, backend: Backend, a, b, bias, out) -> None:
        """The one-shot path (``policy="oneshot"``): one cuBLAS GEMM over all M rows into this call's slot
        of the one-shot buffer, then one kernel (``tileweave.kernels.oneshot``) that signals the peers,
        waits for theirs and sums this rank's rows of every rank's partial, the peers' read over NVLink.
        Two slots, used in turn (``oneshot_slots``): no call waits for anything but the peers' partials
        of the same call. The partials are rounded to the output dtype, as NCCL's are; the sum
        is fp32 in rank order, the same bitwise on every run. An expired wait is reported by the next
        call from a word the kernel writes into pinned host memory (at once in debug mode and on the
        CPU), which costs no driver call, unlike the fused paths' mirrored error word."""
        m, n = a.shape[0], b.shape[1]
        ws, part, reduce_plan, epoch = self._oneshot_start(backend, m, n, a.dtype)
        torch.mm(a, b, out=part)
        _launch.launch_reduce_rows(reduce_plan, part, out, bias, epoch)
        self._oneshot_finish(backend, ws)

    def _oneshot_plan(self, backend: Backend, m: int, n: int, dtype: torch.dtype) -> tuple:
        """The workspace's one-shot buffer sized for two ``[M, N]`` partials, and one shape's two slots
        and launch plan."""
        self._ws = ensure_workspace(self._ws, backend, 0, released=released_start(self.graphable))
        ws, w, rank = self._ws, backend.world_size, backend.rank
        slots = oneshot_slots(ws, (m, n), dtype)
        plan = ws.plans[("oneshot", m, n, dtype)] = (slots, self._oneshot_launch_plan(
            backend, ws, dtype, rows=m // w, cols=n, row0=rank * (m // w)))
        return plan

    def _fused_copy_engine(self, backend: Backend, a, b, bias, out, config: GemmConfig, m: int, n: int,
                           first: bool) -> None:
        """The copy-engine transport: the kernel writes peer partials to a local send buffer and counts
        them per row group; this rank's copy stream moves each finished row group into its owner's
        receive buffer and writes the owner's arrival flag; the owner's tiles wait for those flags."""
        w, rank = backend.world_size, backend.rank
        mc = m // w
        group_rows = config.group_m * config.block_m
        groups = -(-mc // group_rows)
        if groups > CE_GROUPS:
            raise TileweaveError(f"gemm_reduce_scatter: {mc} rows per rank make {groups} row groups of "
                                 f"{group_rows}; the copy-engine transport tracks at most {CE_GROUPS}: raise "
                                 "GemmConfig.group_m or use the store transport")
        self._ws = ensure_workspace(self._ws, backend, 2 * (w - 1) * mc * n * a.element_size())
        ws = self._ws
        flags = ws.ensure_ce_flags(CE_GROUPS)
        key = ("rs-ce", m, n, a.dtype, config)
        plan = ws.plans.get(key)
        if plan is None:
            plan = ws.plans[key] = self._copy_engine_plan(ws, backend, mc, n, a.dtype, config, groups)
        ws.epoch += 1
        epoch = ws.epoch

        def queue_copies() -> None:
            for released, per_group, sent in plan.steps:
                backend.comm_wait(released, epoch - 1)
                for counter, tiles, dst, src, arrival in per_group:
                    ws.ce_counts[counter] = ws.ce_counts.get(counter, 0) + tiles
                    backend.comm_wait(counter, ws.ce_counts[counter])
                    backend.comm_copy(dst, src)
                    backend.comm_write(arrival, epoch)
                backend.comm_write(sent, epoch)

        if backend.launch_blocks:
            queue_copies()
        self._launch_kernel(backend, first, mode=_launch.MODE_RS, a=a, b=b, c=out, bias=bias, config=config,
                            m_chunk=mc, rank=rank, world=w,
                            programs=self._programs(config, backend, True),
                            buf=ws.data.view(rank, a.dtype, (2 * (w - 1) * mc, n)), flags=flags, err=ws.err,
                            epoch=epoch, max_spin=self.max_spin or backend.default_max_spin)
        if not backend.launch_blocks:
            queue_copies()
        for address in plan.releases:
            backend.main_write(address, epoch)
        self._finish(backend, ws)
        _launch.record_path(_OP, "fused")

    def _chunked(self, backend: Backend, a, b, bias, out, m: int, n: int) -> None:
        """The chunked transport (class docstring). Flags: the copy-engine block's arrival words, one
        per (source, row block), and the workspace's RELEASED words for the receive slots. Each block
        is computed into its own slot of the workspace's send buffer, so that no allocation waits on
        the copy stream; the call ends by joining that stream, so the next call may overwrite it."""
        w, rank = backend.world_size, backend.rank
        mc = m // w
        nbytes = (w - 1) * mc * n * a.element_size()
        ws, (sends, owns, arrivals, releases) = self._block_plan(backend, a, m, n, nbytes, "rs-chunked",
                                                                  self._chunked_plan, send_bytes=nbytes)
        ws.epoch += 1
        values = FlagValues(ws.epoch, self.graphable)
        for released, per_block in sends:
            for j, (a_rows, part, dst, arrival) in enumerate(per_block):
                torch.mm(a[a_rows], b, out=part)
                backend.comm_begin()  # the copy stream waits for this block's GEMM
                if j == 0:
                    values.claim(backend, released)
                backend.comm_copy(dst, part)
                backend.comm_write(arrival, values.ready)
        own = a[rank * mc:(rank + 1) * mc]
        for rows, block_arrivals, slots in owns:
            for address in block_arrivals:
                backend.main_wait(address, values.ready)
            if len(slots) == 1 and bias is None:
                partials = slots[0]
            else:  # in rank order: the sum is deterministic
                total = sum(slot.float() for slot in slots)
                partials = (total + bias.float() if bias is not None else total).to(a.dtype)
            torch.addmm(partials, own[rows], b, out=out[rows])
        values.release(backend, arrivals, releases)
        backend.comm_end()
        self._finish_without_kernel(backend)
        _launch.record_path(_OP, "chunked")

    def _block_plan(self, backend: Backend, a, m: int, n: int, nbytes: int, kind: str, build, *,
                    send_bytes: int = 0, blocks: int = 0) -> tuple[Workspace, tuple]:
        """The workspace (``nbytes`` of symmetric data, the copy-engine flag block and ``send_bytes``
        of private send buffer) and the plan of a chunked call of ``kind`` for this shape, built once by
        ``build(ws, backend, rows per owner, n, dtype, blocks per owner)``; ``blocks``: the caller's
        ``_blocks`` of this shape, if it has it."""
        self._ws = ensure_workspace(self._ws, backend, nbytes, released=released_start(self.graphable))
        ws = self._ws
        ws.ensure_ce_flags(CE_GROUPS)
        if send_bytes:
            ws.ensure_local(send_bytes)  # before the plans: growing it drops them
        mc = m // backend.world_size
        blocks = blocks or self._blocks(mc, a.shape[1], n)
        key = (kind, m, n, a.dtype, blocks)
        plan = ws.plans.get(key)
        if plan is None:
            plan = ws.plans[key] = build(ws, backend, mc, n, a.dtype, blocks)
        return ws, plan

    def _blocks(self, mc: int, k: int, n: int, *, pull: bool = False) -> int:
        """Row blocks per owner of a chunked call (:func:`blocks_for`, with this op's ``chunk_rows``)."""
        return blocks_for(mc, k, n, pull=pull, chunk_rows=self.chunk_rows)

    def _chunked_pull(self, backend: Backend, a, b, bias, out, m: int, n: int) -> None:
        """The chunked transport with pulls (``pull``), two ranks. Flags, by epoch: our arrival words
        for the peer's blocks (its caller's stream raises each after the block's GEMM), our landed
        words (our copy stream raises each once the block has landed), and the RELEASED words of the
        two send buffers (each owner's copy stream raises the peer's after its last pull).

        With several blocks per owner (two at most, ``PULL_MAX_BLOCKS``) each pulled block lands in its
        rows of ``out`` and the own rows' GEMM of that block adds onto it in place, while the next block
        is pulled. With one block that would put the whole pull between the two GEMMs, so there the pull
        lands in a private buffer while the own rows' GEMM writes ``out``, and one add follows: the own
        partial is then rounded to the output dtype before the sum, like the peer's (the sum itself is
        in fp32, and the same on every run)."""
        rank = backend.rank
        mc = m // 2
        nbytes = mc * n * a.element_size()
        blocks = self._blocks(mc, a.shape[1], n, pull=True)
        ws, plan = self._block_plan(backend, a, m, n, nbytes, "rs-pull", self._pull_plan,
                                    send_bytes=nbytes if blocks == 1 else 0, blocks=blocks)
        block_rows, send, peer_send, announce, arrivals, landed, release_peer, released, recv = plan
        ws.epoch += 1
        epoch = ws.epoch
        # Issue order matters on the GPU: two streams may share one hardware queue, so a stream wait on
        # the peer's flag is issued only after the work of ours that the peer waits for (each block's
        # GEMM and announcement before the copy stream waits for the peer's same block). Queued before
        # them, the copy stream's first wait deadlocked both ranks on 2x H200 (NOTES.md, entry 48).
        backend.comm_begin()  # the copy stream after out's allocation
        # Our send buffer is free once the peer has pulled the previous call's blocks out of it.
        backend.main_wait(released, epoch - 1)
        peer_rows = a[(1 - rank) * mc:(2 - rank) * mc]
        for r, address, arrival, done in zip(block_rows, announce, arrivals, landed):
            # The bias goes into the peer's rows here, once (the owner's GEMM then adds onto them in place).
            if bias is None:
                torch.mm(peer_rows[r], b, out=send[r])
            else:
                torch.addmm(bias, peer_rows[r], b, out=send[r])
            backend.main_write(address, epoch)
            # The peer's block of our rows, once announced, straight into its rows of out (one block:
            # into recv).
            backend.comm_wait(arrival, epoch)
            backend.comm_copy(out[r] if recv is None else recv, peer_send[r])
            backend.comm_write(done, epoch)
        backend.comm_write(release_peer, epoch)
        own = a[rank * mc:(rank + 1) * mc]
        if recv is None:
            for r, done in zip(block_rows, landed):
                backend.main_wait(done, epoch)
                torch.addmm(out[r], own[r], b, out=out[r])  # in place: C is D, no copy of the partial
        else:
            torch.mm(own, b, out=out)  # while the copy stream pulls
            backend.main_wait(landed[0], epoch)
            out.add_(recv)
        # No closing join of the copy stream (two driver calls): the caller's stream has already waited
        # for every pulled block by its landed word, the copy stream's last write (the peer's release)
        # orders nothing here, and the next call's copies queue behind this call's work on both streams.
        # This path never runs under CUDA-graph capture, which would need the join (it is not graphable).
        self._finish_without_kernel(backend)
        _launch.record_path(_OP, "chunked")

    @staticmethod
    def _pull_plan(ws: Workspace, backend: Backend, mc: int, n: int, dtype: torch.dtype, blocks: int) -> tuple:
        """Per block: its rows; our send buffer and the peer's; our arrival words in the peer's flags
        and the peer's in ours; our landed words; the peer's RELEASED word for us and ours for it; with
        one block, the private buffer the pull lands in (None otherwise)."""
        rank, peer = backend.rank, 1 - backend.rank
        bounds = [mc * j // blocks for j in range(blocks + 1)]
        block_rows = tuple(slice(bounds[j], bounds[j + 1]) for j in range(blocks))
        recv = ws.local[:mc * n * dtype.itemsize].view(dtype).view(mc, n) if blocks == 1 else None
        return (block_rows, ws.data.view(rank, dtype, (mc, n)), ws.data.view(peer, dtype, (mc, n)),
                tuple(ws.ce_flag_address(peer, CE_ARRIVAL, rank * CE_GROUPS + j) for j in range(blocks)),
                tuple(ws.ce_flag_address(rank, CE_ARRIVAL, peer * CE_GROUPS + j) for j in range(blocks)),
                tuple(ws.ce_flag_address(rank, CE_SENT, j) for j in range(blocks)),
                ws.flag_address(peer, RELEASED, rank), ws.flag_address(rank, RELEASED, peer), recv)

    @staticmethod
    def _chunked_plan(ws: Workspace, backend: Backend, mc: int, n: int, dtype: torch.dtype, blocks: int) -> tuple:
        """Views, buffers and flag addresses of the chunked transport for one shape: per owner (its
        RELEASED flag for us, per block: our rows of ``a``, our send slot, its receive rows for us, its
        arrival flag), per own block (rows, arrival flags and receive rows of each source in rank
        order), all our arrival flags, the releases."""
        w, rank = backend.world_size, backend.rank
        bounds = [mc * j // blocks for j in range(blocks + 1)]
        block_rows = [slice(bounds[j], bounds[j + 1]) for j in range(blocks)]
        send = ws.local[:(w - 1) * mc * n * dtype.itemsize].view(dtype).view(w - 1, mc, n)
        sends = []
        for step in range(w - 1):
            owner = (rank + 1 + step) % w
            dst = ws.data.view(owner, dtype, (w - 1, mc, n))[(rank - owner - 1) % w]
            sends.append((ws.flag_address(rank, RELEASED, owner), tuple(
                (slice(owner * mc + r.start, owner * mc + r.stop), send[step, r], dst[r],
                 ws.ce_flag_address(owner, CE_ARRIVAL, rank * CE_GROUPS + j))
                for j, r in enumerate(block_rows))))
        slots = ws.data.view(rank, dtype, (w - 1, mc, n))
        sources = [src for src in range(w) if src != rank]
        owns = tuple((r, tuple(ws.ce_flag_address(rank, CE_ARRIVAL, src * CE_GROUPS + j) for src in sources),
                      tuple(slots[(src - rank - 1) % w, r] for src in sources))
                     for j, r in enumerate(block_rows))
        releases = tuple(ws.flag_address(p, RELEASED, rank) for p in sources)
        return tuple(sends), owns, tuple(address for _, own, _ in owns for address in own), releases

    @staticmethod
    def _copy_engine_plan(ws: Workspace, backend: Backend, mc: int, n: int, dtype: torch.dtype,
                          config: GemmConfig, groups: int) -> "_CopyPlan":
        w, rank = backend.world_size, backend.rank
        group_rows = config.group_m * config.block_m
        tiles_n = -(-n // config.block_n)
        tiles_m = -(-mc // config.block_m)
        steps = []
        for step in range(w - 1):
            owner = (rank + 1 + step) % w
            send = ws.data.view(rank, dtype, (2 * (w - 1), mc, n))[w - 1 + step]
            recv = ws.data.view(owner, dtype, (2 * (w - 1), mc, n))[(rank - owner - 1) % w]
            per_group = []
            for s in range(groups):
                rows = slice(s * group_rows, min((s + 1) * group_rows, mc))
                per_group.append((
                    ws.ce_flag_address(rank, CE_COUNTERS, step * CE_GROUPS + s),  # our tiles-done counter
                    min(config.group_m, tiles_m - s * config.group_m) * tiles_n,  # tiles in the group
                    recv[rows], send[rows],
                    ws.ce_flag_address(owner, CE_ARRIVAL, rank * CE_GROUPS + s),  # its arrival flag for us
                ))
            steps.append((ws.flag_address(rank, RELEASED, owner), tuple(per_group),
                          ws.ce_flag_address(rank, CE_SENT, step)))              # our sent flag

        return _CopyPlan(steps=tuple(steps),
                         releases=tuple(ws.flag_address(p, RELEASED, rank) for p in range(w) if p != rank))

    def _fallback(self, backend: Backend, a, b, bias, out):
        w, rank = backend.world_size, backend.rank
        if a.is_cuda:
            partial = torch.matmul(a, b)
            dist.reduce_scatter_tensor(out, partial, group=backend.group)
        else:
            from tileweave.ops.matmul import matmul

            partial = matmul(a, b).float()
            dist.all_reduce(partial, group=backend.group)
            out.copy_(partial.chunk(w)[rank])
        if bias is not None:
            out += bias
        _launch.record_path(_OP, "fallback")
        return out


def cached_op(group: dist.ProcessGroup, device: torch.device) -> GemmReduceScatter:
    """The op shared by every functional call on ``group`` and ``device``."""
    return GemmReduceScatter.shared(group, device)


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                        bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form of :class:`GemmReduceScatter` (module docstring: shapes and semantics). Under
    ``torch.compile`` this is the custom op ``torch.ops.tileweave.gemm_reduce_scatter``."""
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        from tileweave.ops import registry

        result = registry.gemm_reduce_scatter_op(a, b, bias, group.group_name)
        if out is not None:
            out.copy_(result)
            result = out
        return result
    return cached_op(group, a.device)(a, b, bias=bias, out=out)
