"""Layer 0's transport: the dense AllGather+GEMM's mesh push (``tileweave.ops.all_gather.push``) of
every rank's token shard into every peer's symmetric gather buffer, on the copy engines, each copy
followed by the peer's ready flag (an epoch), and the release of the buffer after the kernel that read it.

The flag protocol is the push's: rank r's producer writes its shard into rows ``[r*T/W, (r+1)*T/W)`` of
peer p's buffer once p has released the buffer for this call (p's RELEASED word for r holds the previous
epoch), nearest consumer first, then sets p's READY word for r to the epoch. The consumer's kernel waits
on READY words per source; after it, the consumer releases its buffer to every producer. No barrier per
call. Unlike the dense kernel, layer 0's grouped GEMM reads its own rows from the gather buffer too, so
they are copied there first, on the caller's stream.
"""

from __future__ import annotations

import torch

from tileweave.ops.all_gather.push import PushPlan, start
from tileweave.ops.workspace import READY, FlagValues, Memory, Workspace
from tileweave.runtime.backend import Backend


class ShardGather:
    """One gather of ``x_shard [T/W, H]`` in flight (``start``), read by a kernel gated on
    ``ready_flags``, then handed back to the peers (``release``)."""

    def __init__(self, ws: Workspace, plan: PushPlan, values: FlagValues) -> None:
        self.ws, self.plan, self.values = ws, plan, values

    @property
    def gathered(self) -> torch.Tensor:
        """This rank's ``[T, H]`` gather buffer."""
        return self.plan.gathered

    @property
    def ready_flags(self) -> torch.Tensor:
        """int32 ``[W]``: word s reaches ``epoch`` once source s's rows are in ``gathered``."""
        return self.ws.flag_slice(READY)

    @property
    def epoch(self) -> int:
        return self.values.ready

    @staticmethod
    def start(backend: Backend, memory: Memory, x_shard: torch.Tensor) -> "ShardGather":
        """Queue this call's pushes on the copy stream (``memory``'s workspace grown or replaced here:
        collective, every rank at the same call) and copy the own shard into the own rows on the
        caller's stream (ahead of the kernel that reads them: no flag guards them)."""
        ws, plan, x_shard, values = start(memory, backend, x_shard, ring=False, constant=False)
        if plan.own_slot.data_ptr() != x_shard.data_ptr():
            plan.own_slot.copy_(x_shard)
        return ShardGather(ws, plan, values)

    def release(self, backend: Backend) -> None:
        """After the kernels that read ``gathered`` are queued: join the copy stream, then let every
        producer refill our buffer for its next call."""
        backend.comm_end()
        self.values.release(backend, self.plan.arrivals, self.plan.releases)
