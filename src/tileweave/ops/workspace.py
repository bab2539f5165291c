"""Per-op symmetric workspaces: a data buffer, a flag array, the epoch, and cross-rank agreement."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tileweave.runtime.agreement import exchange, judge
from tileweave.runtime.backend import Backend, HostWord, SymmetricBuffer, TileweaveError

# Flag array layout, in int32 words, for a group of W ranks:
#   [0, W)      READY:    ready[src] = epoch at which src's data for this rank is complete (all-gather)
#   [W, 2W)     RELEASED: released[p] = epoch whose use of p's own buffer p has finished, so that
#                         writers may fill it for the next epoch
#   [2W, 3W)    COUNTERS: a word per source kept free for transports that count arrivals
#   3W          ERR:      nonzero when a bounded in-kernel wait expired
READY, RELEASED, COUNTERS = 0, 1, 2
ONESHOT_HEADER = 256
"""Bytes at the start of the one-shot buffer (``Workspace.ensure_oneshot``) for its flag words: word
``src`` holds the one-shot epoch at which src's data for this rank is complete. Its data follows."""
ONESHOT_ALIGN = 256
"""Alignment in bytes of the one-shot buffer's two slots (``oneshot_slots``)."""
# The chunked transports' block flags (``Workspace.ensure_block_flags``), W x blocks words per region:
# ARRIVAL[src * blocks + j]: source src's block j has arrived (or is announced, for a pull); LANDED[j]:
# this rank's pull of block j has landed.
BLOCK_ARRIVAL, BLOCK_LANDED = 0, 1


class Workspace:
    """One op's memory on every rank of its group. Allocated collectively, grown on demand, reused."""

    def __init__(self, backend: Backend, data_bytes: int, *, released: int = 0) -> None:
        """``released``: the start value of this rank's RELEASED words (1 for the constant-valued
        protocol of graphable ops, where 1 means "free"; epochs start at 0)."""
        self.backend = backend
        w = backend.world_size
        self.data = backend.allocate(max(data_bytes, 256))
        self.flags = backend.allocate(4 * (3 * w + 1))
        self.local_flags = self.flags.view(backend.rank, torch.int32, (3 * w + 1,))
        self.err = self.local_flags[3 * w:]
        if released:
            # Only this rank's producer reads these words before its first push, after this fill in
            # stream order; a peer writes them only after a call that needed that push.
            self.flag_slice(RELEASED).fill_(released)
        self.epoch = 0
        self.count_expected = 0
        self.block_flags = None
        self.blocks = 0
        self.plans: dict[tuple, object] = {}
        self.local: torch.Tensor | None = None
        self.oneshot: SymmetricBuffer | None = None
        self.oneshot_epoch = 0
        """The one-shot paths' own call count, which their flag words carry (the transports' waits
        expect ``epoch`` to advance only with their own calls); restarts with each new buffer."""
        self._ptr_tables: dict[str, torch.Tensor] = {}

    def ensure_local(self, nbytes: int) -> torch.Tensor:
        """This rank's private buffer (not symmetric) of at least ``nbytes``, grown on demand like the
        data buffer: one for every shape, not one per shape. Growing it drops the plans, whose views
        may point into the old one (they are rebuilt on their next call)."""
        if self.local is None or self.local.numel() < nbytes:
            if self.backend.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise TileweaveError(f"the op's send buffer must grow to {nbytes} bytes, which a CUDA graph "
                                     "must not do: call the op eagerly with the largest shapes first, then "
                                     "capture")
            if self.local is not None:
                nbytes = max(nbytes, 2 * self.local.numel())
            self.local = torch.empty(nbytes, dtype=torch.uint8, device=self.backend.device)
            self.plans.clear()
        return self.local

    def ensure_oneshot(self, nbytes: int) -> SymmetricBuffer:
        """The one-shot paths' symmetric buffer: ``ONESHOT_HEADER`` bytes of flag words, then at least
        ``nbytes`` of data (two slots, see the ops), allocated on first use and grown on demand. Growing
        is collective and first waits for every rank's earlier calls, since peers may still be reading
        the old one; it drops the plans and tables that point into it, and the epoch restarts with the
        new buffer's zeroed flags."""
        if self.oneshot is None or self.oneshot.nbytes < ONESHOT_HEADER + nbytes:
            current = None if self.oneshot is None else self.oneshot.nbytes - ONESHOT_HEADER
            nbytes = _grow(self.backend, "one-shot buffer", current, nbytes)
            self.oneshot = self.backend.allocate(ONESHOT_HEADER + nbytes)
            self.oneshot_epoch = 0
            self.plans = {key: plan for key, plan in self.plans.items() if key[0] != "oneshot"}
            self._ptr_tables = {key: t for key, t in self._ptr_tables.items() if not key.startswith("oneshot")}
        return self.oneshot

    def oneshot_flags(self) -> torch.Tensor:
        """This rank's one-shot flag words, one per source rank."""
        return self.oneshot.view(self.backend.rank, torch.int32, (self.backend.world_size,))

    def oneshot_signals(self) -> torch.Tensor:
        """Every rank's one-shot flag word for this rank, as int64 addresses (where this rank signals)."""
        return self._table("oneshot-signals", [self.oneshot.address(p, 4 * self.backend.rank)
                                               for p in range(self.backend.world_size)])

    def flag_address(self, rank: int, kind: int, index: int) -> int:
        return self.flags.address(rank, 4 * (kind * self.backend.world_size + index))

    def flag_slice(self, kind: int) -> torch.Tensor:
        w = self.backend.world_size
        return self.local_flags[kind * w:(kind + 1) * w]

    def ensure_block_flags(self, blocks: int) -> torch.Tensor:
        """The chunked transports' block flags (2 x W x ``blocks`` int32: ``BLOCK_ARRIVAL``,
        ``BLOCK_LANDED``), allocated on first use; returns this rank's view."""
        if self.block_flags is None:
            self.block_flags = self.backend.allocate(4 * 2 * self.backend.world_size * blocks)
            self.blocks = blocks
        return self.block_flags.view(self.backend.rank, torch.int32, (2 * self.backend.world_size * blocks,))

    def block_flag_address(self, rank: int, region: int, index: int) -> int:
        """Address of word ``index`` of ``region`` (``BLOCK_ARRIVAL``, ``BLOCK_LANDED``) in ``rank``'s
        block flags."""
        return self.block_flags.address(rank, 4 * (region * self.backend.world_size * self.blocks + index))

    def oneshot_offsets(self, itemsize: int) -> torch.Tensor:
        """Every rank's one-shot buffer (``ensure_oneshot``, which must have run) as an int64 offset, in
        elements of ``itemsize`` bytes, from this rank's own: the kernel addresses peers from its own
        aligned pointer, which keeps its accesses vectorised."""
        return self._offsets(self.oneshot, itemsize, "oneshot")

    def _offsets(self, buffer: SymmetricBuffer, itemsize: int, name: str) -> torch.Tensor:
        local = buffer.address(self.backend.rank)
        deltas = [buffer.address(p) - local for p in range(self.backend.world_size)]
        if any(d % 16 for d in deltas):
            raise TileweaveError(f"symmetric buffers are not 16-byte aligned relative to each other: {deltas}")
        return self._table(f"{name}{itemsize}", [d // itemsize for d in deltas])

    def _table(self, key: str, values: list[int]) -> torch.Tensor:
        table = self._ptr_tables.get(key)
        if table is None:
            table = torch.tensor(values, dtype=torch.int64, device=self.backend.device)
            self._ptr_tables[key] = table
        return table


@dataclasses.dataclass(frozen=True)
class FlagValues:
    """The values one call writes to its flags and waits for: its epoch, or, for graphable ops
    (``constant``), 0 and 1 in every call, reset by the reader, so that a CUDA-graph replay repeats what
    the capture wrote. RELEASED words start at 1 under the constant protocol (``released_start``)."""

    epoch: int
    constant: bool

    @property
    def ready(self) -> int:
        """What a producer writes once the data is in, and its reader waits for."""
        return 1 if self.constant else self.epoch

    def claim(self, backend: Backend, released: int) -> None:
        """On the copy stream, before writing into a peer's buffer: wait until the peer released it for
        this call, and with constant flags take the release (set it back to 0)."""
        backend.comm_wait(released, 1 if self.constant else self.epoch - 1)
        if self.constant:
            backend.comm_write(released, 0)

    def release(self, backend: Backend, arrivals: tuple, releases: tuple) -> None:
        """On the caller's stream, after the work that read our buffer: each producer's RELEASED word
        for us; with constant flags our arrival words back to 0 first (the same stream and fenced
        writes: the reset lands before the release that lets the next write in)."""
        if self.constant:
            for address in arrivals:
                backend.main_write(address, 0)
        for address in releases:
            backend.main_write(address, self.ready)


class Memory:
    """An op's symmetric memory: its workspace, made and grown on demand (collectively: every rank at
    the same call), and the gather buffer that a call lends to its caller until the op's next call.
    Held by the op, handed to its transports in each call's ``Call``."""

    def __init__(self, graphable: bool = False) -> None:
        self.ws: Workspace | None = None
        self.graphable = graphable
        self._lent: tuple | None = None
        self.host_err: HostWord | None = None
        """The one-shot kernels' error word in pinned host memory (``HostWord``), made at first use."""

    def workspace(self, backend: Backend, nbytes: int) -> Workspace:
        """The workspace, grown to ``nbytes`` of symmetric data (collective when it grows). A gathered
        view lent by the last call is released first (and before a new workspace frees the flags it
        names). A graphable op's RELEASED words start at 1 ("free"), an epoch op's at epoch 0."""
        self.return_lent()
        self.ws = ensure_workspace(self.ws, backend, nbytes, released=released_start(self.graphable))
        return self.ws

    def lend(self, backend: Backend, values: "FlagValues", arrivals: tuple, releases: tuple) -> None:
        """Keep the gather buffer from the peers until this op's next call: the caller reads it."""
        self._lent = (backend, values, arrivals, releases)

    def return_lent(self) -> None:
        """Release a gather buffer lent to the caller by the last call."""
        lent = self._lent
        if lent is not None:
            self._lent = None
            backend, values, arrivals, releases = lent
            values.release(backend, arrivals, releases)

    def host_word(self, device: torch.device) -> HostWord:
        if self.host_err is None:
            self.host_err = HostWord(device)
        return self.host_err

    def pinned_word(self) -> HostWord | None:
        """The one-shot kernels' pinned error word, None before the first one-shot call."""
        return self.host_err

    def kernel_word(self) -> torch.Tensor | None:
        """The workspace's error word (which the one-shot kernels set together with the pinned one), None
        before the workspace exists."""
        return self.ws.err if self.ws is not None else None


def oneshot_slots(ws: Workspace, shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's two slots of ``shape`` in the one-shot buffer (grown to hold them), used in turn by
    a one-shot path's calls: a rank writes a slot again two calls later, when its previous call's
    kernel has seen every peer's signal of that call, which each peer sent only after its own kernel
    that read the slot (two calls back) was done. So a call waits only for the peers' data of the same
    call, on the same stream as all of this op's calls.

    Slot ``s`` starts at the same place for every shape, at the start of half ``s`` of the data: calls
    of different shapes alternate slots too, and a call must never write where the previous call's
    slot lies, which peers may still be reading (slots packed by the shape's size would overlap
    there when the shape shrinks)."""
    nbytes = -(-shape[0] * shape[1] * dtype.itemsize // ONESHOT_ALIGN) * ONESHOT_ALIGN
    buffer = ws.ensure_oneshot(2 * nbytes)
    half = (buffer.nbytes - ONESHOT_HEADER) // 2 // ONESHOT_ALIGN * ONESHOT_ALIGN
    return tuple(buffer.view(ws.backend.rank, dtype, shape, offset=ONESHOT_HEADER + s * half) for s in range(2))


def released_start(constant: bool) -> int:
    return 1 if constant else 0


def ensure_workspace(current: Workspace | None, backend: Backend, data_bytes: int, *,
                     released: int = 0) -> Workspace:
    """``current`` if it is large enough, else a new one. Replacing is collective and waits for every
    rank's earlier calls to finish, because peers may still be writing into the old buffers. Neither can
    happen under CUDA-graph capture."""
    if current is not None and current.data.nbytes >= data_bytes:
        return current
    data_bytes = _grow(backend, "workspace", None if current is None else current.data.nbytes, data_bytes)
    return Workspace(backend, data_bytes, released=released)


def _grow(backend: Backend, what: str, current: int | None, nbytes: int) -> int:
    """The size to allocate for a symmetric ``what`` of ``current`` bytes (None: none yet) that must hold
    ``nbytes``: at least double, so that a slowly growing M does not reallocate on every call. Replacing
    one first waits for every rank's earlier calls, since peers may still use the old one (collective);
    neither can happen under CUDA-graph capture."""
    if backend.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise TileweaveError(f"the op's {what} must grow to {nbytes} bytes, a collective allocation that a "
                             "CUDA graph cannot hold: call the op eagerly with the largest shapes first, then "
                             "capture")
    if current is None:
        return nbytes
    backend.synchronize()
    dist.barrier(group=backend.group)
    return max(nbytes, 2 * current)


def agree(backend: Backend, op: str, signature: object, proposal: object, *, failure: Exception | None = None,
          hint: str = "") -> object:
    """Exchange with every rank, at every call, what it was called with, and return rank 0's proposal
    (a path, a kernel config) so that all ranks use the same one. Collective: every rank of the group
    calls it at the same call of ``op``; none may skip it (say, because it met ``signature`` before).

    ``signature``: what every rank must share (shapes, dtypes, which optional arguments are given), best
    a dict of argument name to ``tileweave.ops.common.signature_of``'s text, which makes the error of
    differing signatures name the arguments that differ. ``proposal``: this rank's proposal, or a
    function that checks this rank's arguments and returns it (an op evaluates its own, as
    ``TPOp._agreed`` does, and passes the value). ``failure``: what this rank's checks raised
    (``TypeError``, ``ValueError``, ``TileweaveError``; a raising ``proposal`` function gives it too),
    exchanged instead of raised, so that every rank raises it, after the exchange: checks that can
    differ between ranks run before, never instead of, the exchange. Differing signatures raise
    ``TileweaveError`` on every rank (``hint`` ends its message); a rank that does not come within the
    backend's ``timeout_s``, ``CollectiveTimeout`` naming it.

    Runs before any symmetric allocation or communication of the call: ranks that disagree fail
    together, here, rather than allocate different sizes or wait on each other's flags.
    """
    if callable(proposal):
        try:
            proposal = proposal()
        except (TypeError, ValueError, TileweaveError) as exc:
            failure, proposal = exc, None
    reported = None if failure is None else (type(failure).__name__, str(failure))
    everyone = exchange(backend.group, backend.rank, backend.world_size, op, (signature, reported, proposal),
                        timeout_s=backend.timeout_s, one_host=backend.one_host)
    judge(op, everyone, hint=hint)
    return everyone[0][2]
