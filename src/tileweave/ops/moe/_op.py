"""What both MoE ops share: settings, the group's backend, argument checks, and the agreement of
every call: each rank's arguments and checks are exchanged and judged, and rank 0's path taken,
before anything is allocated or launched."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.moe.paths import choose_path
from tileweave.ops.moe.plan import MoEPlan
from tileweave.ops.skeleton import TPOp
from tileweave.ops.workspace import Memory, agree
from tileweave.runtime.backend import Backend


class MoEOp(TPOp):
    """Base of ``MoEAllGatherGemm`` and ``MoEGemmReduceScatter``: one group, one workspace, reused.

    ``policy``: ``"auto"`` takes the fused path or the fallback per shape (``paths.choose_path``),
    ``"fused"`` and ``"fallback"`` force one (every rank alike). ``max_spin``: the polls a flag wait
    may take before it reports a lost peer (None: the backend's default)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto",
                 max_spin: int | None = None) -> None:
        super().__init__(group, policy=policy, max_spin=max_spin)
        self.memory = Memory()
        self._ids_err: torch.Tensor | None = None
        """Device word: nonzero once a call's plan held ids outside [0, E) (``common.BAD_IDS`` + count)."""

    def _agree(self, device: torch.device, signature: dict, check: Callable[[Backend], dict]) -> tuple[Backend, str]:
        """``(backend, path)`` of a call, every rank together: this rank's pending error (an earlier
        call's expired wait or out-of-range ids) and ``check(backend)`` (the op's argument checks, which
        return ``choose_path``'s shape keywords) run, then every rank's outcome and ``signature`` (what
        the ranks must share) are exchanged and judged (``agree``), so that a bad argument on one rank
        raises the same error on every rank. The path is rank 0's choice under this op's policy. Under
        CUDA-graph capture the fused path is not taken (its flags carry epochs that a replay would not
        advance): ``"auto"`` takes the fallback (NCCL captures), ``"fused"`` raises."""
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

        if backend.world_size == 1:
            return backend, propose()
        return backend, agree(backend, self.op_name, {**signature, "policy": self.policy}, propose)

    def _mark_ids(self, plan: MoEPlan, device: torch.device) -> None:
        """Record on the device, without a host sync, whether ``plan`` was built from ids outside
        ``[0, E)`` (``MoEPlan.invalid``); ``_finish_ids`` reports it."""
        if plan.invalid is None:
            return
        if self._ids_err is None or self._ids_err.device != device:
            self._ids_err = torch.zeros(1, dtype=torch.int32, device=device)
        code = torch.where(plan.invalid > 0, plan.invalid + common.BAD_IDS, 0).to(torch.int32)
        torch.maximum(self._ids_err, code, out=self._ids_err)

    def _finish_ids(self, backend: Backend, plan: MoEPlan) -> None:
        """After the call's work: raise for out-of-range ids, as an expired wait is reported (at once on
        the CPU and with ``TILEWEAVE_DEBUG=1``, else at the next call, on every rank alike)."""
        if plan.invalid is not None:
            self.errors.watch("ids", self._ids_err, backend)


def plan_signature(plan: object) -> object:
    """What the ranks compare of a plan: its (W, T, k, E), or the type's name of something else."""
    return plan.signature() if isinstance(plan, MoEPlan) else type(plan).__name__


def check_plan(plan: MoEPlan, *, world: int, tokens: int | None, experts: int, device: torch.device) -> None:
    """The plan was built for this group, these tokens (None: any) and these experts, on this device."""
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"plan must be a tileweave MoEPlan (from moe_plan or build_plan), got {type(plan).__name__}")
    if plan.world_size != world:
        raise ValueError(f"plan was built for world_size={plan.world_size} but the group has {world} ranks: "
                         "build it with moe_plan on this group")
    if tokens is not None and plan.tokens != tokens:
        raise ValueError(f"plan was built for T={plan.tokens} tokens but the inputs hold T={tokens} "
                         f"({tokens // world} per rank): build the plan from this batch's topk_ids")
    if plan.num_experts != experts:
        raise ValueError(f"plan was built for E={plan.num_experts} experts but the weights have {experts}")
    if plan.offsets.device != device:
        raise ValueError(f"plan is on {plan.offsets.device} but the inputs are on {device}")


def check_activation(name: str, t: torch.Tensor, shape_doc: str) -> None:
    if isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} is {t.dtype}: the MoE ops do not take float8 inputs yet (grouped_gemm, "
                        "the dense pair and gemm_all_reduce do); dequantize to bfloat16 first")
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
    if w.dtype != dtype:
        raise TypeError(f"{name} has dtype {w.dtype} but the activations are {dtype}; cast them to one dtype")
    if w.device != device:
        raise ValueError(f"{name} is on {w.device} but the activations are on {device}")
    if w.shape[0] < 1 or w.shape[2] < 1:
        raise ValueError(f"{name} {shape_doc} has an empty dimension: {tuple(w.shape)}")
    return w.shape[0]


def nccl(backend: Backend) -> bool:
    """Whether the group runs NCCL (tensor collectives); else gloo (emulated or GPU-sharing test ranks)."""
    return dist.get_backend(backend.group) == "nccl"


def all_gather_rows(t: torch.Tensor, backend: Backend) -> torch.Tensor:
    """NCCL (or gloo) all-gather of ``t [rows, ...]`` along its first dimension, on the caller's stream."""
    t = t.contiguous()
    out = t.new_empty((t.shape[0] * backend.world_size, *t.shape[1:]))
    if nccl(backend):
        dist.all_gather_into_tensor(out, t, group=backend.group)
    else:
        dist.all_gather(list(out.chunk(backend.world_size)), t, group=backend.group)
    return out
