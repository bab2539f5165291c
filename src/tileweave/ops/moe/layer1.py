"""MoE layer 1: grouped GEMM over the routing plan + weighted top-k sum + ReduceScatter (the experts'
down projection of tensor-parallel MoE; every rank holds every expert's rows ``[F/W * r, F/W * (r+1))``).

=======================  ==========================  ==============================================
tensor                   shape (per rank)            meaning
=======================  ==========================  ==============================================
``h``                    ``[T * k, F_loc]``          layer 0's activations, rows in plan order
``w1``                   ``[E, F_loc, H]``           this rank's rows of every expert (the view
                                                     ``w.transpose(1, 2)`` of an ``[E, H, F_loc]``
                                                     nn.Linear stack is read in place)
``plan``                 ``MoEPlan``                 the plan layer 0 ran with
``topk_weights_shard``   ``[T / W, k]`` or None      routing weights of this rank's tokens
                                                     (fp32, fp16 or bf16; gathered inside); None:
                                                     every weight 1 (nothing gathered)
result ``out_shard``     ``[T / W, H]``              tokens ``[r*T/W, (r+1)*T/W)`` of
                                                     ``sum over ranks of O``, where
                                                     ``O[t] = sum_j wt[t, j] * Z[pair_row[t, j]]``
                                                     and ``Z[p] = h[p] @ w1[row_expert[p]]``
=======================  ==========================  ==============================================

``h`` and ``w1`` share one dtype (fp16, bf16, fp32), the result has it. Deterministic: ``O`` sums
over j in slot order in fp32, and the owner sums the ranks' partials in rank order in fp32, so a call
is bitwise the same from run to run.

Paths. ``"chunked"`` (the overlapped path): each rank runs the grouped GEMM over the groups of
source q = rank+1, rank+2, ... (one launch per block of E groups: the rows of q's tokens), reduces
q's tokens over top-k into a partial ``[T/W, H]`` (output dtype) and hands it to the copy engines,
which move it into q's symmetric receive slot and raise q's flag while the next block computes; its
own block comes last, in fp32, and then the W partials are summed in rank order. ``"fallback"``: the
grouped GEMM over every group, the top-k sum, NCCL reduce-scatter. ``policy="auto"`` chooses per shape
(``tileweave.ops.moe.paths.choose_path``); a group of one communicates nothing (``"local"``).
``Z [T*k, H]`` is materialised on both paths and read once by the top-k reduce
(``tileweave.ops.compute.topk_reduce``), which sums each token's k rows in fp32 in slot order.

Agreement with the other ranks, bad routing ids, synchronisation and concurrency: as
``moe_all_gather_gemm``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.compute.grouped_gemm import grouped_gemm
from tileweave.ops.moe._op import (MoEOp, all_gather_rows, check_activation, check_plan, check_weight, nccl,
                                   plan_signature)
from tileweave.ops.moe.plan import MoEPlan
from tileweave.ops.skeleton import finish_streams
from tileweave.ops.compute.topk_reduce import topk_reduce
from tileweave.ops.workspace import READY, RELEASED, FlagValues, Workspace
from tileweave.runtime.agreement import describe
from tileweave.runtime.backend import Backend

_OP = "moe_gemm_reduce_scatter"
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class _ChunkPlan:
    sends: tuple
    """Per owner q = rank+1, rank+2, ...: (q, our RELEASED word for q, our send slot, q's receive slot
    for us, q's arrival (READY) word for us)."""
    receives: tuple
    """Per source in rank order: (source, our arrival word for it, our receive slot for it), None for
    this rank."""
    arrivals: tuple
    releases: tuple


class MoEGemmReduceScatter(MoEOp):
    """A reusable MoE layer 1 bound to one group; keeps its receive slots between calls (module
    docstring). ``policy``, ``max_spin``: :class:`tileweave.ops.moe._op.MoEOp`."""

    op_name = _OP

    def __call__(self, h: torch.Tensor, w1: torch.Tensor, plan: MoEPlan, topk_weights_shard: torch.Tensor | None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out_shard [T/W, H]`` (module docstring); ``out``: an optional tensor of that shape and the
        result's dtype with unit column stride."""
        if not isinstance(h, torch.Tensor):  # its device says which backend to agree on
            raise TypeError(f"h must be a torch.Tensor [T*k, F_loc], got {type(h).__name__}")

        def check(backend: Backend) -> dict:
            check_activation("h", h, "[T*k, F_loc]")
            common.check_no_grad(_OP, h, w1, topk_weights_shard, names=("h", "w1", "topk_weights_shard"))
            common.check_runs_dtype(_OP, "h", h)
            rows, f_loc = h.shape
            experts = check_weight("w1", w1, rows=f_loc, rows_name="F_loc", dtype=h.dtype, device=h.device,
                                   shape_doc="[E, F_loc, H]")
            check_plan(plan, world=backend.world_size, tokens=None, experts=experts, device=h.device)
            if rows != plan.rows:
                raise ValueError(f"h has {rows} rows but the plan has T*k = {plan.tokens}*{plan.topk} = "
                                 f"{plan.rows}: h must be layer 0's output for this plan")
            tc = plan.tokens // backend.world_size
            if topk_weights_shard is not None:
                _check_weights(topk_weights_shard, (tc, plan.topk), h.device)
            common.check_out(out, (tc, w1.shape[2]), h.dtype, h.device)
            return dict(tokens=plan.tokens, topk=plan.topk, hidden=w1.shape[2], f_loc=f_loc, dtype=h.dtype)

        signature = {"h": describe(h), "w1": describe(w1), "plan (W, T, k, E)": plan_signature(plan),
                     "topk_weights_shard": describe(topk_weights_shard)}
        backend, path = self._agree(h.device, signature, check)
        experts, hidden = w1.shape[0], w1.shape[2]
        tc = plan.tokens // backend.world_size
        out = common.out_or_new(out, (tc, hidden), h.dtype, h.device)
        self._mark_ids(plan, h.device)
        if path == "local":
            z = grouped_gemm(h, w1, plan.offsets, experts=experts)
            topk_reduce(z, plan.pair_row, topk_weights_shard, out=out)
        else:
            weights = None if topk_weights_shard is None else all_gather_rows(topk_weights_shard, backend)
            if path == "fused" and tc > 0:
                self._chunked(backend, h, w1, plan, weights, out)
                path = "chunked"
            else:
                path = "fallback"
                self._fallback(backend, h, w1, plan, weights, out)
        self._finish_ids(backend, plan)
        common.record_path(_OP, path)
        return out

    def _fallback(self, backend: Backend, h, w1, plan: MoEPlan, weights, out) -> None:
        z = grouped_gemm(h, w1, plan.offsets, experts=plan.num_experts)
        if nccl(backend):
            partial = topk_reduce(z, plan.pair_row, weights, out_dtype=h.dtype)
            dist.reduce_scatter_tensor(out, partial, group=backend.group)
        else:  # gloo has no reduce-scatter
            partial = topk_reduce(z, plan.pair_row, weights)
            dist.all_reduce(partial, group=backend.group)
            out.copy_(partial.chunk(backend.world_size)[backend.rank])

    def _chunked(self, backend: Backend, h, w1, plan: MoEPlan, weights, out) -> None:
        """The overlapped path (module docstring). Flags, by epoch: the workspace's READY words as
        arrival words (one per source), its RELEASED words for the receive slots."""
        w, rank, e = backend.world_size, backend.rank, plan.num_experts
        tc, hidden = out.shape
        nbytes = (w - 1) * tc * hidden * h.element_size()
        ws = self.memory.workspace(backend, nbytes)
        ws.ensure_local(nbytes)
        cplan = _chunk_plan(ws, backend, tc, hidden, h.dtype)
        ws.epoch += 1
        values = FlagValues(ws.epoch, False)
        z = torch.empty((plan.rows, hidden), dtype=h.dtype, device=h.device)

        def block(source: int, into: torch.Tensor | None = None) -> torch.Tensor:
            grouped_gemm(h, w1, plan.offsets, experts=e, out=z, group_range=(source * e, (source + 1) * e))
            tokens = slice(source * tc, (source + 1) * tc)
            return topk_reduce(z, plan.pair_row[tokens], None if weights is None else weights[tokens], out=into)

        for owner, released, send, dst, arrival in cplan.sends:
            block(owner, send)
            backend.comm_begin()  # the copy stream after this block's reduce
            values.claim(backend, released)
            backend.comm_copy(dst, send)
            backend.comm_write(arrival, values.ready)
        own = block(rank)
        total = torch.zeros_like(own)
        for entry in cplan.receives:  # rank order: the sum is deterministic
            if entry is None:
                total += own
            else:
                _, arrival, slot = entry
                backend.main_wait(arrival, values.ready)
                total += slot.float()
        out.copy_(total)
        values.release(backend, cplan.arrivals, cplan.releases)
        backend.comm_end()  # the send slots are free for the next call
        finish_streams(backend)


def _chunk_plan(ws: Workspace, backend: Backend, tc: int, hidden: int, dtype: torch.dtype) -> _ChunkPlan:
    key = ("moe-rs", tc, hidden, dtype)
    plan = ws.plans.get(key)
    if plan is None:
        w, rank = backend.world_size, backend.rank
        send = ws.local[:(w - 1) * tc * hidden * dtype.itemsize].view(dtype).view(w - 1, tc, hidden)
        slots = lambda p: ws.data.view(p, dtype, (w - 1, tc, hidden))  # noqa: E731
        sends = []
        for step in range(1, w):
            owner = (rank + step) % w
            sends.append((owner, ws.flag_address(rank, RELEASED, owner), send[step - 1],
                          slots(owner)[(rank - owner - 1) % w], ws.flag_address(owner, READY, rank)))
        receives = tuple(None if src == rank else
                         (src, ws.flag_address(rank, READY, src), slots(rank)[(src - rank - 1) % w])
                         for src in range(w))
        plan = ws.plans[key] = _ChunkPlan(
            sends=tuple(sends), receives=receives,
            arrivals=tuple(ws.flag_address(rank, READY, s) for s in range(w) if s != rank),
            releases=tuple(ws.flag_address(p, RELEASED, rank) for p in range(w) if p != rank))
    return plan


def _check_weights(weights: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"topk_weights_shard must be a torch.Tensor [T/W, k], got {type(weights).__name__}")
    if tuple(weights.shape) != shape:
        raise ValueError(f"topk_weights_shard must be [T/W, k] = {list(shape)} (this rank's tokens of the plan), "
                         f"got {list(weights.shape)}")
    if weights.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"topk_weights_shard has dtype {weights.dtype}; routing weights must be float32, "
                        "float16 or bfloat16")
    if weights.device != device:
        raise ValueError(f"topk_weights_shard is on {weights.device} but h is on {device}")

