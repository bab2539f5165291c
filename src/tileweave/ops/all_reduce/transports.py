"""The fused transports of GEMM + AllReduce, one-shot and two-shot (``tileweave.kernels.gemm_all_reduce``):
the rank's GEMM writes its partial straight into its slot of a symmetric buffer, then one kernel signals
the peers, sums every rank's partial in rank order and applies the epilogue.

Slots. Epoch protocol: two slots at the two halves of the data buffer, used in turn by the op's calls
(one-shot and two-shot alike, whatever the shape: a slot packed by the shape's size would overlap the
previous call's, which a slower peer may still read). A rank writes a slot again two calls later, after
its previous call's kernel has seen every peer's ``ready`` of that call, which each peer set only after
its own kernel that read the slot had finished (one stream). So a call waits only for the peers' data
of the same call. Constant protocol (graphable): a CUDA graph replays one call's slot, so there is one
slot, and before its GEMM a call waits on its stream (a stream memory op, captured with the call) until
every peer has set its ``free`` word here (the peer's kernel has finished reading this rank's slot), and
sets it back to 0.

Flag buffer (int32 words, symmetric, allocated once per op): ``READY`` [W) per source; ``FREE`` [W) per
reader (start at 1 under the constant protocol); ``SYNC`` [2) (first-signal claim, finished-program
count); ``ERR`` [1]; ``DONE`` [W x MAX_BLOCKS) per source and block of rows (two-shot).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import triton

from tileweave.kernels.gemm_all_reduce import MAX_BLOCKS, oneshot_kernel, twoshot_kernel
from tileweave.ops import common
from tileweave.ops.compute.gemm_launch import wrap_int32
from tileweave.ops.all_reduce.rule import rows_per_program
from tileweave.ops.all_reduce.local import partial
from tileweave.ops.skeleton import ErrorWords, first_launch
from tileweave.runtime.backend import Backend, HostWord, SymmetricBuffer, TileweaveError

SLOT_ALIGN = 256
"""Bytes: alignment of the two slots."""
BN = 256
"""Columns a program handles at a time (on GPUs: 16 B per thread and row at 4 warps in bf16)."""
BN_INTERPRETED = 64
WARPS = 4


def tiles(path: str, m: int, world: int, sms: int, *, interpreter: bool) -> tuple[int, int, int]:
    """(programs, rows per block, columns per step) of a fused call of ``m`` rows on ``world`` ranks:
    blocks of all rows (one-shot) or of this rank's share (two-shot), at most one program per SM."""
    rows = m if path == "oneshot" else -(-m // world)
    if interpreter:
        # The interpreter runs programs one after another and pays ~10 ms per helper call, not per
        # element: two programs (the protocol's first-signal and last-reader roles still fall to
        # different ones) of up to 64 rows (a few hundred rows still loop over several blocks).
        sms = 2
        bm = min(64, max(2, triton.next_power_of_2(-(-rows // sms))))
    else:
        bm = rows_per_program(rows, sms)
    return max(1, min(sms, -(-rows // bm))), bm, BN_INTERPRETED if interpreter else BN


def _words(world: int) -> tuple[int, int, int, int, int, int]:
    """Offsets in int32 words of READY, FREE, SYNC, ERR, DONE, and the total."""
    ready, free, sync = 0, world, 2 * world
    err = sync + 2
    done = err + 2
    return ready, free, sync, err, done, done + world * MAX_BLOCKS


class FusedTransport:
    """One op's symmetric buffers and the two fused transports on them. Created collectively, at the
    first call that takes a fused path (every rank takes it at the same call)."""

    def __init__(self, backend: Backend, errors: ErrorWords, *, graphable: bool, max_spin: int) -> None:
        """``errors``: the op's error words, where this transport's pinned word is read before each call."""
        self.backend = backend
        self.graphable = graphable
        self.max_spin = max_spin
        self.errors = errors
        w, rank = backend.world_size, backend.rank
        ready, free, sync, err, done, total = _words(w)
        self.flags = backend.allocate(4 * total)
        local = self.flags.view(rank, torch.int32, (total,))
        self.ready, self.sync, self.err, self.done = (local[ready:ready + w], local[sync:sync + 2],
                                                      local[err:err + 1], local[done:])
        if graphable:
            # Read by this rank's stream before its first GEMM; a peer writes it only after reading this
            # rank's slot, which needs this rank's first call.
            local[free:free + w].fill_(1)
        self.free_words = tuple(self.flags.address(rank, 4 * (free + p)) for p in range(w) if p != rank)
        device = backend.device
        table = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        self.ready_sig = table([self.flags.address(p, 4 * (ready + rank)) for p in range(w)])
        self.free_sig = table([self.flags.address(p, 4 * (free + rank)) for p in range(w)])
        self.done_sig = table([self.flags.address(p, 4 * (done + rank * MAX_BLOCKS)) for p in range(w)])
        self.data: SymmetricBuffer | None = None
        self._offsets: dict[int, torch.Tensor] = {}
        self.epoch = 0
        self.host_err = HostWord(device)
        errors.host(lambda: self.host_err, lambda: self.err)
        self._meet = False

    def prepare(self, path: str, m: int, n: int, dtype: torch.dtype, norm: bool) -> None:
        """Before a signature's first call (collective, every rank at the same call): size the data
        buffer for its two slots, and meet the peers before its first launch (after compiling it)."""
        if path == "twoshot":
            rows = -(-m // self.backend.world_size)
            if -(-rows // rows_per_program(rows, self.backend.num_sms)) > MAX_BLOCKS:
                raise TileweaveError(f"gemm_all_reduce: the two-shot transport flags at most {MAX_BLOCKS} row blocks "
                                     f"per rank; M={m} makes more: use policy='auto', 'oneshot' or 'fallback'")
        need = 2 * self._slot_bytes(path, m, n, dtype, norm)
        if self.data is None or self.data.nbytes < need:
            if self.data is not None:
                # Peers may still read the old buffer: every rank's earlier calls finish first.
                self.backend.synchronize()
                dist.barrier(group=self.backend.group)
                need = max(need, 2 * self.data.nbytes)
            self.data = self.backend.allocate(need)
            self._offsets.clear()
        self._meet = True

    @staticmethod
    def _slot_bytes(path: str, m: int, n: int, dtype: torch.dtype, norm: bool) -> int:
        elems = m * n * (2 if norm and path == "twoshot" else 1)
        return -(-elems * dtype.itemsize // SLOT_ALIGN) * SLOT_ALIGN

    def _slot(self, index: int, dtype: torch.dtype, elems: int) -> torch.Tensor:
        half = self.data.nbytes // 2 // SLOT_ALIGN * SLOT_ALIGN
        return self.data.view(self.backend.rank, dtype, (elems,), offset=index * half)

    def _peer_offsets(self, itemsize: int) -> torch.Tensor:
        """Every rank's data buffer as an element offset from this rank's (the kernel addresses peers
        from its own slot's pointer)."""
        table = self._offsets.get(itemsize)
        if table is None:
            local = self.data.address(self.backend.rank)
            deltas = [self.data.address(p) - local for p in range(self.backend.world_size)]
            if any(d % itemsize for d in deltas):
                raise TileweaveError(f"symmetric buffers are not aligned relative to each other: {deltas}")
            table = self._offsets[itemsize] = torch.tensor([d // itemsize for d in deltas], dtype=torch.int64,
                                                           device=self.backend.device)
        return table

    def run(self, path: str, a, b, bias, residual, norm_weight, eps: float, y: torch.Tensor,
            resid: torch.Tensor | None, scales: tuple | None = None) -> None:
        """One call: its GEMM into this call's slot (in ``y``'s dtype; scaled FP8 with ``scales``, the
        pair ``(scale_a, scale_b)``; ``b`` None: ``a`` is the partial, copied in), then the path's kernel;
        ``y`` (and ``resid``)."""
        self.errors.raise_pending(self.backend)
        backend = self.backend
        m, n = y.shape
        norm = norm_weight is not None
        if self.graphable:
            index, value = 0, 1
            for address in self.free_words:
                backend.main_wait(address, 1)
                backend.main_write(address, 0)
        else:
            self.epoch += 1
            index, value = self.epoch & 1, self.epoch
        slot = self._slot(index, y.dtype, m * n * (2 if norm and path == "twoshot" else 1))
        part = slot[:m * n].view(m, n)
        if b is None:
            part.copy_(a)
        elif backend.interpreter and scales is None:
            # torch's GEMM, not tileweave's: interpreted, tileweave.matmul (tested on its own) costs about a
            # second a call, which the emulated ranks' tests of this protocol cannot afford.
            torch.mm(a, b, out=part)
        else:
            partial(a, b, part, scales)
        programs, bm, bn = tiles(path, m, backend.world_size, backend.num_sms, interpreter=backend.interpreter)
        dummy = y
        constexprs = dict(WORLD=backend.world_size, BM=bm, BN=bn, P=programs,
                          HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, HAS_NORM=norm,
                          CONSTANT=self.graphable)
        head = (part, self._peer_offsets(y.element_size()), self.ready_sig, self.ready, self.sync, self.free_sig)
        tail = (y, resid if norm else dummy, bias if bias is not None else dummy,
                residual if residual is not None else dummy, norm_weight if norm else dummy, self.err,
                self.host_err.tensor)
        ints = (wrap_int32(value), self.max_spin, backend.rank, m, n, n)
        strides = (n, n, n, eps)  # y, resid, residual are contiguous [m, n]
        if path == "oneshot":
            self._launch(oneshot_kernel, programs, head + tail, ints + strides, constexprs)
        else:
            self._launch(twoshot_kernel, programs, head + (self.done_sig, self.done) + tail, ints + (m * n,) + strides,
                         dict(constexprs, MAX_BLOCKS=MAX_BLOCKS))
        if backend.interpreter or common.debug_mode():
            backend.synchronize()
            self.errors.raise_pending(backend)

    def _launch(self, kernel, programs: int, tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        device = self.backend.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if self._meet:
                # A signature's first launch: compile, then meet the peers (``skeleton.first_launch``).
                self._meet = False
                first_launch(self.backend, lambda: kernel.warmup(*tensors, *scalars, grid=(programs,),
                                                                 num_warps=WARPS, **constexprs))
            kernel[(programs,)](*tensors, *scalars, num_warps=WARPS, **constexprs)
