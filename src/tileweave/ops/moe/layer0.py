"""MoE layer 0: AllGather of the tokens + grouped GEMM over the routing plan (the experts' up/gate
projection of tensor-parallel MoE; every rank holds every expert's columns ``[F/W * r, F/W * (r+1))``).

==================  ==========================  ==================================================
tensor              shape (per rank)            meaning
==================  ==========================  ==================================================
``x_shard``         ``[T / W, H]``              this rank's tokens (rank r: tokens
                                                ``[r*T/W, (r+1)*T/W)`` of the group)
``w0``              ``[E, H, F_loc]``           this rank's columns of every expert (the view
                                                ``w.transpose(1, 2)`` of an ``[E, F_loc, H]``
                                                nn.Linear stack is read in place)
``plan``            ``MoEPlan``                 ``moe_plan`` of the group's ``topk_ids``
result ``y``        ``[T * k, F_loc]``          ``y[p] = X[row_token[p]] @ w0[row_expert[p]]``,
                                                rows in plan order (groups by source, expert)
gathered ``x``      ``[T, H]``                  ``X = AllGather(x_shard)`` (``return_gathered``;
                                                backward needs it)
==================  ==========================  ==================================================

fp16, bf16 or fp32 in (one dtype for ``x_shard`` and ``w0``), fp32 accumulation, result in that dtype.

``epilogue=SwiGLU(pre=...)`` (``tileweave.ops.compute.grouped_gemm.SwiGLU``) fuses an expert MLP's SwiGLU
into the grouped GEMM on every path: ``w0 [E, H, 2*F_loc]`` holds the gate columns, then the up
columns, and the result is ``silu(gate) * up [T * k, F_loc]`` (``pre`` receives the pre-activations).

Paths. ``"fused"``: each rank pushes its shard into every peer's symmetric gather buffer on the copy
engines (``gather.ShardGather``) while ONE persistent grouped GEMM runs over the plan's W*E groups
in rotated order, its own source's groups first; a tile of source s's groups waits for s's ready flag
(an epoch) before its first load of A and reads its rows by index straight from the gather buffer, so
no ``[T*k, H]`` copy is made. ``"fallback"``: NCCL all-gather of ``x_shard``, then the same grouped GEMM
ungated. ``policy="auto"`` chooses per shape (``tileweave.ops.moe.paths.choose_path``); a group of
one communicates nothing (``"local"``). ``tileweave.last_path("moe_all_gather_gemm")``
says which ran.

Every call first agrees with the other ranks (``MoEOp``): a bad argument on one rank raises the same
error on every rank. A plan built from ids outside ``[0, E)`` without validation raises ``ValueError``
(at that call on the CPU and with ``TILEWEAVE_DEBUG=1``, else at the next).

Synchronises: nothing with the host (the plan's offsets stay on the device). Concurrency: all ranks
call the op the same number of times in the same order with the same shapes; do not run two calls of
one op object concurrently on different streams.
"""

from __future__ import annotations

import torch

from tileweave.ops import common
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.moe._op import MoEOp, all_gather_rows, check_activation, check_plan, check_weight, plan_signature
from tileweave.ops.moe.gather import ShardGather
from tileweave.ops.moe.plan import MoEPlan
from tileweave.runtime.agreement import describe
from tileweave.runtime.backend import Backend

_OP = "moe_all_gather_gemm"


class MoEAllGatherGemm(MoEOp):
    """A reusable MoE layer 0 bound to one group; keeps its gather buffer between calls (module
    docstring). ``policy``, ``max_spin``: :class:`tileweave.ops.moe._op.MoEOp`."""

    op_name = _OP

    def __call__(self, x_shard: torch.Tensor, w0: torch.Tensor, plan: MoEPlan, *, out: torch.Tensor | None = None,
                 return_gathered: bool = False, epilogue: SwiGLU | None = None):
        """``y`` or ``(y, x)`` (module docstring). ``out``: an optional ``[T*k, F_loc]`` tensor of the
        result's dtype with unit column stride (its width follows ``epilogue``). ``x`` is a fresh
        tensor."""
        if not isinstance(x_shard, torch.Tensor):  # its device says which backend to agree on
            raise TypeError(f"x_shard must be a torch.Tensor [T/W, H], got {type(x_shard).__name__}")

        def check(backend: Backend) -> dict:
            check_activation("x_shard", x_shard, "[T/W, H]")
            common.check_no_grad(_OP, x_shard, w0, names=("x_shard", "w0"))
            common.check_runs_dtype(_OP, "x_shard", x_shard)
            tc, h = x_shard.shape
            experts = check_weight("w0", w0, rows=h, rows_name="H", dtype=x_shard.dtype, device=x_shard.device,
                                   shape_doc="[E, H, F_loc]")
            check_plan(plan, world=backend.world_size, tokens=tc * backend.world_size, experts=experts,
                       device=x_shard.device)
            if epilogue is not None and (not isinstance(epilogue, SwiGLU) or w0.shape[2] % 2):
                raise ValueError(f"epilogue must be None or SwiGLU over w0 [E, H, 2*F_loc] (gate columns, then "
                                 f"up columns), got {type(epilogue).__name__} with w0 {list(w0.shape)}")
            common.check_out(out, (plan.rows, _width(w0, epilogue)), x_shard.dtype, x_shard.device)
            return dict(tokens=plan.tokens, topk=plan.topk, hidden=h, f_loc=w0.shape[2], dtype=x_shard.dtype)

        signature = {"x_shard": describe(x_shard), "w0": describe(w0), "plan (W, T, k, E)": plan_signature(plan),
                     "epilogue": type(epilogue).__name__}
        backend, path = self._agree(x_shard.device, signature, check)
        tc = x_shard.shape[0]
        experts = w0.shape[0]
        out = common.out_or_new(out, (plan.rows, _width(w0, epilogue)), x_shard.dtype, x_shard.device)
        extra = dict(epilogue=epilogue)
        self._mark_ids(plan, x_shard.device)
        if path == "fused" and tc == 0:
            path = "fallback"
        if path == "fused":
            gathered = self._fused(backend, x_shard, w0, plan, out, return_gathered, extra)
        else:
            gathered = x_shard if path == "local" else all_gather_rows(x_shard, backend)
            grouped_gemm(gathered, w0, plan.offsets, a_rows=plan.row_token, experts=experts, out=out, **extra)
        self._finish_ids(backend, plan)
        common.record_path(_OP, path)
        return (out, gathered) if return_gathered else out

    def _fused(self, backend: Backend, x_shard, w0, plan: MoEPlan, out, return_gathered: bool, extra: dict):
        """The fused path: the pushes, one gated grouped GEMM, the release (module docstring)."""
        gather = ShardGather.start(backend, self.memory, x_shard)
        ws = gather.ws
        grouped_gemm(gather.gathered, w0, plan.offsets, a_rows=plan.row_token, experts=plan.num_experts, out=out,
                     gate=(gather.ready_flags, gather.epoch, backend.rank, ws.err, self.spin_bound(backend)), **extra)
        # A copy for the caller before the release lets the peers refill the buffer (the kernel has
        # waited for every shard, so the copy reads them all).
        gathered = gather.gathered.clone() if return_gathered else None
        gather.release(backend)
        self.errors.watch("kernel", ws.err, backend)
        return gathered



def _width(w0: torch.Tensor, epilogue: SwiGLU | None) -> int:
    """Columns of layer 0's result: F_loc, or half of ``w0``'s columns under the SwiGLU."""
    return w0.shape[2] // 2 if epilogue is not None else w0.shape[2]
