"""Layer 0's transport: every rank's token shard into every peer's symmetric gather buffer, on the
copy engines, each followed by the peer's ready flag (an epoch).

The mesh push of the dense AllGather+GEMM (``tileweave.ops.all_gather``), with its flag
protocol: rank r's producer writes its shard into rows ``[r*T/W, (r+1)*T/W)`` of peer p's buffer once
p has released the buffer for this call (p's RELEASED word for r holds the previous epoch), nearest
consumer first, then sets p's READY word for r to the epoch. The consumer's kernel waits on READY
words per source; after it, the consumer releases its buffer to every producer. No barrier per call.
"""

from __future__ import annotations

import dataclasses

import torch

from tileweave.ops.workspace import READY, RELEASED, FlagValues, Workspace, ensure_workspace
from tileweave.runtime.backend import Backend


@dataclasses.dataclass(frozen=True)
class _GatherPlan:
    gathered: torch.Tensor
    """This rank's ``[T, H]`` gather buffer."""
    own_rows: torch.Tensor
    """Its rows of this rank's shard."""
    pushes: tuple
    """Per peer, nearest consumer first: (its buffer's rows for our shard, our RELEASED word for it,
    its READY word for us)."""
    arrivals: tuple
    """Our READY words, one per peer."""
    releases: tuple
    """Each peer's RELEASED word for us."""


class ShardGather:
    """One gather of ``x_shard [T/W, H]`` in flight (``start``), read by a kernel gated on
    ``ready_flags``, then handed back to the peers (``release``)."""

    def __init__(self, ws: Workspace, plan: _GatherPlan, values: FlagValues) -> None:
        self.ws, self.plan, self.values = ws, plan, values

    @property
    def gathered(self) -> torch.Tensor:
        return self.plan.gathered

    @property
    def ready_flags(self) -> torch.Tensor:
        """int32 ``[W]``: word s reaches ``epoch`` once source s's rows are in ``gathered``."""
        return self.ws.flag_slice(READY)

    @property
    def epoch(self) -> int:
        return self.values.ready

    @staticmethod
    def start(backend: Backend, ws: Workspace | None, x_shard: torch.Tensor) -> "ShardGather":
        """Queue this call's pushes on the copy stream and copy the own shard into the own rows on the
        caller's stream (ahead of the kernel that reads them: no flag guards them). ``ws``: the op's
        workspace so far (grown or replaced here: collective, every rank at the same call)."""
        tc, h = x_shard.shape
        w = backend.world_size
        ws = ensure_workspace(ws, backend, tc * w * h * x_shard.element_size())
        plan = _plan(ws, backend, tc, h, x_shard.dtype)
        x_shard = x_shard.contiguous()
        ws.epoch += 1
        values = FlagValues(ws.epoch, False)
        backend.comm_begin()  # the copy stream after x_shard is written
        for rows, released, ready in plan.pushes:
            values.claim(backend, released)
            backend.comm_copy(rows, x_shard)
            backend.comm_write(ready, values.ready)
        if plan.own_rows.data_ptr() != x_shard.data_ptr():
            plan.own_rows.copy_(x_shard)
        return ShardGather(ws, plan, values)

    def release(self, backend: Backend) -> None:
        """After the kernels that read ``gathered`` are queued: join the copy stream, then let every
        producer refill our buffer for its next call."""
        backend.comm_end()
        self.values.release(backend, self.plan.arrivals, self.plan.releases)


def _plan(ws: Workspace, backend: Backend, tc: int, h: int, dtype: torch.dtype) -> _GatherPlan:
    key = ("moe-gather", tc, h, dtype)
    plan = ws.plans.get(key)
    if plan is None:
        w, rank = backend.world_size, backend.rank
        rows = slice(rank * tc, (rank + 1) * tc)
        gathered = ws.data.view(rank, dtype, (tc * w, h))
        pushes = tuple((ws.data.view(peer, dtype, (tc * w, h))[rows], ws.flag_address(rank, RELEASED, peer),
                        ws.flag_address(peer, READY, rank))
                       for peer in ((rank - i) % w for i in range(1, w)))
        plan = ws.plans[key] = _GatherPlan(
            gathered=gathered, own_rows=gathered[rows], pushes=pushes,
            arrivals=tuple(ws.flag_address(rank, READY, s) for s in range(w) if s != rank),
            releases=tuple(ws.flag_address(p, RELEASED, rank) for p in range(w) if p != rank))
    return plan
