"""The MoE pair of tensor-parallel MoE over a routing plan (``tileweave.ops.moe.plan``): layer 0,
AllGather of the tokens + grouped GEMM (the experts' up/gate projection; every rank holds every
expert's columns ``[F/W * r, F/W * (r+1))``), and layer 1, grouped GEMM + weighted top-k sum +
ReduceScatter (the down projection; every rank holds every expert's rows ``[F/W * r, F/W * (r+1))``).
Their checks, their paths and their shared base are here; the rule that picks a path is ``rule.py``.

Layer 0, ``MoEAllGatherGemm``:

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
With ``SwiGLU(cast=...)`` the result is layer 1's float8 ``h`` and ``scale_a`` instead (a ``Quantized``, cast
from the epilogue's float32 values), and ``out`` does not apply.

Paths. ``"fused"``: each rank pushes its shard into every peer's symmetric gather buffer on the copy
engines (``tileweave.ops.all_gather.push.PendingGather``) while ONE persistent grouped GEMM runs over the
plan's W*E groups in rotated order, its own source's groups first; a tile of source s's groups waits
for s's ready flag (an epoch) before its first load of A and reads its rows by index straight from the
gather buffer, so no ``[T*k, H]`` copy is made. ``"fallback"``: NCCL all-gather of ``x_shard``, then the
same grouped GEMM ungated.

Layer 1, ``MoEGemmReduceScatter``:

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
grouped GEMM over every group, the top-k sum, NCCL reduce-scatter. ``Z [T*k, H]`` is materialised on
both paths and read once by the top-k reduce (``tileweave.ops.compute.topk_reduce``), which sums each
token's k rows in fp32 in slot order.

FP8 (both layers; ``grouped_gemm``'s semantics, ``torch._scaled_grouped_mm``'s conventions): float8
``x_shard``/``h`` and ``w0``/``w1`` (e4m3fn or e5m2) with float32 ``scale_a`` (of this rank's rows:
one element, ``[rows, 1]`` or ``[rows, K/128]``) and per-expert ``scale_b`` (``[E]``, ``[E, 1, N]`` or
``[E, K/128, ceil(N/128)]``: tensorwise, rowwise, blockwise), fp32 accumulation, result (and SwiGLU
``pre``) in ``out_dtype`` (bfloat16 by default, float16, float32), ``use_fast_accum`` as ``matmul``'s.
Layer 0's a-scales travel with the rows, ``[T/W, KB]`` per shard (KB = 1, or H/128), a tensorwise scale
repeated on each row of its shard (it may differ per rank), under the rows' flag; ``return_gathered``
then gives ``(y, x, x_scales [T, KB])``. Layer 1's ``Z`` and partials have ``out_dtype``, summed in fp32.

Both layers: ``policy="auto"`` chooses per shape (``rule.choose_path``); a group of one communicates
nothing (``"local"``); ``tileweave.last_path(op)`` says which ran. Every call first agrees with the
other ranks (``MoEOp``): a bad argument on one rank raises the same error on every rank. A plan built
from ids outside ``[0, E)`` without validation raises ``ValueError`` (at that call on the CPU and with
``TILEWEAVE_DEBUG=1``, else at the next). Synchronises: nothing with the host (the plan's offsets stay
on the device). Concurrency: all ranks call the op the same number of times in the same order with
the same shapes; do not run two calls of one op object concurrently on different streams.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.all_gather.push import PendingGather
from tileweave.ops.compute.grouped_gemm import SwiGLU, check_fp8, grouped_gemm
from tileweave.ops.compute.topk_reduce import topk_reduce
from tileweave.ops.moe.plan import MoEPlan, check_plan, plan_signature
from tileweave.ops.moe.rule import choose_path
from tileweave.ops.skeleton import Call, TPOp, finish_streams
from tileweave.ops.workspace import READY, RELEASED, FlagValues, Memory, Workspace
from tileweave.runtime.backend import Backend

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class MoEOp(TPOp):
    """Base of ``MoEAllGatherGemm`` and ``MoEGemmReduceScatter``: one group, one workspace, reused.

    ``policy``: ``"auto"`` takes the fused path or the fallback per shape (``rule.choose_path``),
    ``"fused"`` and ``"fallback"`` force one (every rank alike). ``max_spin``: the polls a flag wait
    may take before it reports a lost peer (None: the backend's default)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto",
                 max_spin: int | None = None) -> None:
        super().__init__(group, policy=policy, max_spin=max_spin)
        self.memory = Memory()
        self._ids_err: torch.Tensor | None = None
        """Device word: nonzero once a call's plan held ids outside [0, E) (``common.BAD_IDS`` + count)."""

    def _path(self, device: torch.device, signature: dict, check: Callable[[Backend], dict]) -> tuple[Backend, str]:
        """``(backend, path)`` of a call, every rank together (``TPOp._agreed``): this rank's pending
        error (an earlier call's expired wait or out-of-range ids) and ``check(backend)`` (the op's
        argument checks, which return ``choose_path``'s shape keywords) run, then every rank's outcome
        and ``signature`` (what the ranks must share) are exchanged and judged, so that a bad argument on
        one rank raises the same error on every rank. The path is rank 0's choice under this op's
        policy. Under CUDA-graph capture the fused path is not taken (its flags carry epochs that a
        replay would not advance): ``"auto"`` takes the fallback (NCCL captures), ``"fused"`` raises."""
        backend = self.backend_for(device)

        def propose() -> str:
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            self.errors.raise_pending(backend, capturing)
            shape = check(backend)
            if backend.world_size == 1:
                return "local"
            if not backend.peer_access:
                return "fallback"
            if capturing:
                if self.policy == "fused":
                    raise common.capture_refused(self.op_name)
                return "fallback"
            if self.policy != "auto":
                return self.policy
            return choose_path(world=backend.world_size, interpreter=backend.interpreter, **shape)

        return backend, self._agreed(backend, {**signature, "policy": self.policy}, propose)

    def _call(self, backend: Backend, path: str) -> Call:
        """The context the path's transport receives."""
        return Call(self.op_name, backend, path, self.memory, self.errors, False, self.spin_bound(backend))

    def _mark_ids(self, plan: MoEPlan, device: torch.device) -> None:
        """Record on the device, without a host sync, whether ``plan`` was built from ids outside
        ``[0, E)`` (``MoEPlan.invalid``); ``_finish`` reports it."""
        if plan.invalid is None:
            return
        if self._ids_err is None or self._ids_err.device != device:
            self._ids_err = torch.zeros(1, dtype=torch.int32, device=device)
        code = torch.where(plan.invalid > 0, plan.invalid + common.BAD_IDS, 0).to(torch.int32)
        torch.maximum(self._ids_err, code, out=self._ids_err)

    def _finish(self, backend: Backend, plan: MoEPlan, path: str) -> None:
        """After the call's work: raise for out-of-range ids, as an expired wait is reported (at once on
        the CPU and with ``TILEWEAVE_DEBUG=1``, else at the next call, on every rank alike); record the
        path."""
        if plan.invalid is not None:
            self.errors.watch("ids", self._ids_err, backend)
        common.record_path(self.op_name, path)


class MoEAllGatherGemm(MoEOp):
    """A reusable MoE layer 0 bound to one group; keeps its gather buffer between calls (module
    docstring). ``policy``, ``max_spin``: :class:`MoEOp`."""

    op_name = "moe_all_gather_gemm"

    def __call__(self, x_shard: torch.Tensor, w0: torch.Tensor, plan: MoEPlan, *, out: torch.Tensor | None = None,
                 return_gathered: bool = False, epilogue: SwiGLU | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 use_fast_accum: bool = False):
        """``y``, ``(y, x)`` or, for float8 inputs, ``(y, x, x_scales)`` (module docstring). ``out``: an
        optional ``[T*k, F_loc]`` tensor of the result's dtype with unit column stride (its width follows
        ``epilogue``). ``x`` and ``x_scales`` are fresh tensors."""
        if not isinstance(x_shard, torch.Tensor):  # its device says which backend to agree on
            raise TypeError(f"x_shard must be a torch.Tensor [T/W, H], got {type(x_shard).__name__}")
        op = self.op_name
        fp8 = []

        def check(backend: Backend) -> dict:
            check_activation("x_shard", x_shard, "[T/W, H]")
            common.check_no_grad(op, x_shard, w0, scale_a, scale_b, names=("x_shard", "w0", "scale_a", "scale_b"))
            common.check_runs_dtype(op, "x_shard", x_shard)
            tc, h = x_shard.shape
            experts = check_weight("w0", w0, rows=h, rows_name="H", dtype=x_shard.dtype, device=x_shard.device,
                                   shape_doc="[E, H, F_loc]")
            fp8.extend(check_fp8(op, x_shard, w0, scale_a, scale_b, out_dtype, use_fast_accum))
            check_plan(plan, world=backend.world_size, tokens=tc * backend.world_size, experts=experts,
                       device=x_shard.device)
            if epilogue is not None and (not isinstance(epilogue, SwiGLU) or w0.shape[2] % 2):
                raise ValueError(f"epilogue must be None or SwiGLU over w0 [E, H, 2*F_loc] (gate columns, then "
                                 f"up columns), got {type(epilogue).__name__} with w0 {list(w0.shape)}")
            if _casts(epilogue) and out is not None:
                raise ValueError("out does not apply with SwiGLU(cast=...) (the result is the float8 h); pass None")
            common.check_out(out, (plan.rows, _width(w0, epilogue)), fp8[1], x_shard.device)
            return dict(tokens=plan.tokens, topk=plan.topk, hidden=h, f_loc=w0.shape[2], dtype=x_shard.dtype)

        describe = common.signature_of
        signature = {"x_shard": describe(x_shard), "w0": describe(w0), "plan (W, T, k, E)": plan_signature(plan),
                     "epilogue": _casts(epilogue) or type(epilogue).__name__,
                     **_fp8_signature(scale_a, scale_b, out_dtype, use_fast_accum)}
        backend, path = self._path(x_shard.device, signature, check)
        scales, dtype = fp8
        if not _casts(epilogue):
            out = common.out_or_new(out, (plan.rows, _width(w0, epilogue)), dtype, x_shard.device)
        self._mark_ids(plan, x_shard.device)
        if path == "fused" and x_shard.shape[0] == 0:
            path = "fallback"
        shard_scales = None if scales is None else _scale_rows(scales, x_shard.shape[0])
        with self._first_call(backend, (path, *signature.items())):
            if path == "fused":
                out, gathered = _gather_gemm(self._call(backend, path), x_shard, w0, plan, out, return_gathered,
                                             epilogue, scales, shard_scales, dtype)
            else:
                local = path == "local"
                gathered = x_shard if local else common.all_gather_rows(x_shard, backend)
                if scales is not None:
                    gathered = (gathered, shard_scales if local else common.all_gather_rows(shard_scales, backend))
                out = grouped_gemm(gathered[0] if scales is not None else gathered, w0, plan.offsets,
                                   a_rows=plan.row_token, experts=w0.shape[0], out=out, epilogue=epilogue,
                                   **_fp8_args(scales, gathered, w0, dtype))
        self._finish(backend, plan, path)
        if not return_gathered:
            return out
        return (out, *gathered) if scales is not None else (out, gathered)


def _gather_gemm(call: Call, x_shard, w0, plan: MoEPlan, out, return_gathered: bool, epilogue, scales,
                 shard_scales, dtype):
    """Layer 0's fused path: the pushes, one gated grouped GEMM, the release (module docstring). The
    grouped GEMM reads its own rows from the gather buffer too, so they are copied there first, on the
    caller's stream (no flag guards them); float8 rows' a-scales travel beside them under the same flag.
    Returns the grouped GEMM's result and a copy of the gathered input (and its scales) for
    ``return_gathered``."""
    backend = call.backend
    gather = PendingGather.start(backend, call.memory, x_shard, own_rows="main", shard_scales=shard_scales)
    err = gather.ws.err
    rows = gather.gathered if scales is None else (gather.gathered, gather.gathered_scales)
    out = grouped_gemm(gather.gathered, w0, plan.offsets, a_rows=plan.row_token, experts=plan.num_experts, out=out,
                       gate=(gather.ready_flags, gather.epoch, backend.rank, err, call.spin), epilogue=epilogue,
                       **_fp8_args(scales, rows, w0, dtype))
    # A copy for the caller before the release lets the peers refill the buffer (the kernel has waited
    # for every shard, so the copy reads them all).
    gathered = None
    if return_gathered:
        gathered = gather.gathered.clone() if scales is None else tuple(t.clone() for t in rows)
    gather.release()
    call.errors.watch("kernel", err, backend)
    return out, gathered


def _scale_rows(scales, rows: int) -> torch.Tensor:
    """A float8 shard's a-scales in the form that travels with its rows: ``[rows, KB]`` float32,
    contiguous, one row per row (KB = 1, or K/128 blockwise); a tensorwise scale, which differs per rank,
    repeated on every row of its shard."""
    if scales.scaling == "tensorwise":
        return scales.a.reshape(1, 1).expand(rows, 1).contiguous()
    return scales.a.reshape(rows, -1).contiguous()


def _fp8_args(scales, gathered, w0, dtype: torch.dtype) -> dict:
    """``grouped_gemm``'s float8 keywords for gathered rows ``gathered = (rows, scales in _scale_rows's
    form)``: a tensorwise call runs as a rowwise one, its per-expert ``scale_b`` broadcast along N."""
    if scales is None:
        return {}
    scale_b = scales.b
    if scales.scaling == "tensorwise":
        scale_b = scale_b.reshape(-1, 1).expand(w0.shape[0], w0.shape[2])
    return {"scale_a": gathered[1], "scale_b": scale_b, "out_dtype": dtype, "use_fast_accum": scales.fast_accum}


def _fp8_signature(scale_a, scale_b, out_dtype, use_fast_accum) -> dict:
    """The float8 part of a call's signature (every rank passes scales of the same shapes)."""
    if scale_a is None and scale_b is None and out_dtype is None and not use_fast_accum:
        return {}
    describe = common.signature_of
    return {"scale_a": describe(scale_a), "scale_b": describe(scale_b), "out_dtype": describe(str(out_dtype)),
            "use_fast_accum": describe(use_fast_accum)}


def _casts(epilogue) -> str | None:
    """``SwiGLU(cast=...)``'s form as the ranks compare it (layer 0 then writes h's float8 cast), or None."""
    return f"SwiGLU(cast={epilogue.cast!r}, {epilogue.cast_dtype}, power_of_two={epilogue.power_of_two})" \
        if getattr(epilogue, "cast", None) else None


def _width(w0: torch.Tensor, epilogue: SwiGLU | None) -> int:
    """Columns of layer 0's result: F_loc, or half of ``w0``'s columns under the SwiGLU."""
    return w0.shape[2] // 2 if epilogue is not None else w0.shape[2]


class MoEGemmReduceScatter(MoEOp):
    """A reusable MoE layer 1 bound to one group; keeps its receive slots between calls (module
    docstring). ``policy``, ``max_spin``: :class:`MoEOp`."""

    op_name = "moe_gemm_reduce_scatter"

    def __call__(self, h: torch.Tensor, w1: torch.Tensor, plan: MoEPlan, topk_weights_shard: torch.Tensor | None, *,
                 out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 use_fast_accum: bool = False) -> torch.Tensor:
        """``out_shard [T/W, H]`` (module docstring); ``out``: an optional tensor of that shape and the
        result's dtype with unit column stride."""
        if not isinstance(h, torch.Tensor):  # its device says which backend to agree on
            raise TypeError(f"h must be a torch.Tensor [T*k, F_loc], got {type(h).__name__}")
        op = self.op_name
        fp8 = []

        def check(backend: Backend) -> dict:
            check_activation("h", h, "[T*k, F_loc]")
            common.check_no_grad(op, h, w1, topk_weights_shard, scale_a, scale_b,
                                 names=("h", "w1", "topk_weights_shard", "scale_a", "scale_b"))
            common.check_runs_dtype(op, "h", h)
            rows, f_loc = h.shape
            experts = check_weight("w1", w1, rows=f_loc, rows_name="F_loc", dtype=h.dtype, device=h.device,
                                   shape_doc="[E, F_loc, H]")
            fp8.extend(check_fp8(op, h, w1, scale_a, scale_b, out_dtype, use_fast_accum))
            check_plan(plan, world=backend.world_size, tokens=None, experts=experts, device=h.device)
            if rows != plan.rows:
                raise ValueError(f"h has {rows} rows but the plan has T*k = {plan.tokens}*{plan.topk} = "
                                 f"{plan.rows}: h must be layer 0's output for this plan")
            tc = plan.tokens // backend.world_size
            if topk_weights_shard is not None:
                _check_weights(topk_weights_shard, (tc, plan.topk), h.device)
            common.check_out(out, (tc, w1.shape[2]), fp8[1], h.device)
            return dict(tokens=plan.tokens, topk=plan.topk, hidden=w1.shape[2], f_loc=f_loc, dtype=h.dtype)

        describe = common.signature_of
        signature = {"h": describe(h), "w1": describe(w1), "plan (W, T, k, E)": plan_signature(plan),
                     "topk_weights_shard": describe(topk_weights_shard),
                     **_fp8_signature(scale_a, scale_b, out_dtype, use_fast_accum)}
        backend, path = self._path(h.device, signature, check)
        scales, dtype = fp8
        fp8_args = {} if scales is None else {"scale_a": scale_a, "scale_b": scale_b, "out_dtype": dtype,
                                              "use_fast_accum": use_fast_accum}
        gemm = functools.partial(grouped_gemm, h, w1, plan.offsets, experts=plan.num_experts, **fp8_args)
        tc = plan.tokens // backend.world_size
        out = common.out_or_new(out, (tc, w1.shape[2]), dtype, h.device)
        self._mark_ids(plan, h.device)
        if path != "local":
            path = "chunked" if path == "fused" and tc > 0 else "fallback"
        with self._first_call(backend, (path, *signature.items())):
            if path == "local":
                topk_reduce(gemm(), plan.pair_row, topk_weights_shard, out=out)
            else:
                weights = None if topk_weights_shard is None else common.all_gather_rows(topk_weights_shard,
                                                                                          backend)
                if path == "chunked":
                    _reduce_scatter_chunked(self._call(backend, path), gemm, plan, weights, out)
                else:
                    _reduce_scatter_nccl(backend, gemm, plan, weights, out)
        self._finish(backend, plan, path)
        return out


def _reduce_scatter_nccl(backend: Backend, gemm, plan: MoEPlan, weights, out) -> None:
    """Layer 1's unfused path: the grouped GEMM over every group (``gemm()``), the top-k sum, NCCL's
    reduce-scatter (gloo, which has none: an all-reduce and this rank's rows)."""
    z = gemm()
    if dist.get_backend(backend.group) == "nccl":
        partial = topk_reduce(z, plan.pair_row, weights, out_dtype=out.dtype)
        dist.reduce_scatter_tensor(out, partial, group=backend.group)
    else:
        partial = topk_reduce(z, plan.pair_row, weights)
        dist.all_reduce(partial, group=backend.group)
        out.copy_(partial.chunk(backend.world_size)[backend.rank])


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


def _reduce_scatter_chunked(call: Call, gemm, plan: MoEPlan, weights, out) -> None:
    """Layer 1's overlapped path (module docstring); ``gemm(out=, group_range=)``: the grouped GEMM of
    the call's operands. Flags, by epoch: the workspace's READY words as arrival words (one per source),
    its RELEASED words for the receive slots."""
    backend = call.backend
    w, rank, e = backend.world_size, backend.rank, plan.num_experts
    tc, hidden = out.shape
    nbytes = (w - 1) * tc * hidden * out.element_size()
    ws = call.memory.workspace(backend, nbytes)
    ws.ensure_local(nbytes)
    cplan = _chunk_plan(ws, backend, tc, hidden, out.dtype)
    ws.epoch += 1
    values = FlagValues(ws.epoch, False)
    z = torch.empty((plan.rows, hidden), dtype=out.dtype, device=out.device)

    def block(source: int, into: torch.Tensor | None = None) -> torch.Tensor:
        gemm(out=z, group_range=(source * e, (source + 1) * e))
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


# -- the checks of the pair's arguments ----------------------------------------------------------------

def check_activation(name: str, t: torch.Tensor, shape_doc: str) -> None:
    if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:  # check_matrix takes no float8
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")
    else:
        common.check_matrix(name, t)
    if t.stride(1) != 1:
        raise ValueError(f"{name} {shape_doc} must have unit stride along its last dimension, got strides "
                         f"{t.stride()} (pass .contiguous())")


def check_weight(name: str, w: torch.Tensor, *, rows: int, rows_name: str, dtype: torch.dtype,
                 device: torch.device, shape_doc: str) -> int:
    """A stacked expert weight ``[E, rows, N]`` (any strides): checks it and returns E."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(w).__name__}")
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D {shape_doc}, got shape {tuple(w.shape)}")
    if w.shape[1] != rows:
        raise ValueError(f"{name} is {list(w.shape)} but must be {shape_doc} with {rows_name}={rows} "
                         f"(for an nn.Linear-stacked weight pass its .transpose(1, 2))")
    if w.dtype != dtype and not (w.dtype in FP8_DTYPES and dtype in FP8_DTYPES):
        raise TypeError(f"{name} has dtype {w.dtype} but the activations are {dtype}; cast them to one dtype")
    if w.device != device:
        raise ValueError(f"{name} is on {w.device} but the activations are on {device}")
    if w.shape[0] < 1 or w.shape[2] < 1:
        raise ValueError(f"{name} {shape_doc} has an empty dimension: {tuple(w.shape)}")
    return w.shape[0]


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
