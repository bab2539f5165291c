"""The dense pair's part of the skeleton (``AllGatherGemm``, ``GemmReduceScatter``): a plan per call
signature (shapes, dtypes, devices, whether there is a bias), decided at its first call, agreed by every
rank and kept, with the kernel config every rank uses; the checks of the GEMM's operands; the float8
arguments (``Scaled``); and the one-shot paths' slots and error word, which both ops' one-shot transports
share.

The dense ops agree at a signature's first call (``_decide``), not at every call as the MoE ops and
``GemmAllReduce`` do: their small shapes are bound by host time, and a repeat call's checks run on this
rank alone (shape, dtype and device are the plan's key, so only values such as a bias or ``out`` are
checked again). A signature's first call runs its argument checks inside that agreement, so that a bad
argument on one rank raises the same error on every rank (the operands being 2-D tensors, which the
agreed shapes need, is checked before, on this rank), and its transport inside ``skeleton.first_call``,
where its kernels compile.

FP8. The semantics are ``matmul``'s (``tileweave.ops.compute.scaling``): float8 ``a`` and ``b`` (e4m3fn
or e5m2), float32 scales of this rank's operands, fp32 accumulation, ``out_dtype`` (bfloat16 by default,
float16, float32). The scales' shapes, ``out_dtype`` and ``use_fast_accum`` are part of the signature
(every rank must pass scales of the same shapes; their values may differ). An all-gather moves each
shard's a-scales beside its rows in one form for the three scalings, ``[rows, KB]`` float32 with a row
per row of ``a`` (``KB`` = 1, or ``K/128`` for blockwise): a tensorwise scale, which differs per rank,
travels as its shard's rows each holding it (``Scaled.shard_rows``), so a gathered row's scale never
depends on which rank sent it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.ops import common
from tileweave.ops.compute import scaling
from tileweave.ops.compute.oneshot_launch import OneshotPlan
from tileweave.ops.skeleton import Call, TPOp, first_call, meeting, option
from tileweave.ops.workspace import Memory, Workspace
from tileweave.runtime.backend import Backend
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import GemmConfig


@dataclasses.dataclass
class Plan:
    """What every call of one signature runs, decided at its first call and agreed by every rank."""

    path: str
    """What ``tileweave.last_path`` reports (``skeleton.PATHS``)."""
    run: Callable
    """The transport's entry point, ``run(call, *args)``."""
    backend: Backend
    config: GemmConfig | None = None
    """The kernel config every rank agreed on (None for paths without a kernel of ours)."""
    epochs: bool = False
    """Whether the transport's flags carry epochs, which a CUDA-graph replay would not advance."""
    first: bool = True
    """The first launch is still to come: every rank compiles, then meets (``push.launch_fused``)."""
    called: bool = False
    """The signature was called before (its first call runs in ``skeleton.first_call``)."""
    scaling: str | None = None
    """Float8 calls: the scaling of the signature's scales (``Scaled.scaling``)."""
    out_dtype: torch.dtype | None = None
    """Float8 calls: the output dtype."""

    def scaled(self, scale_a, scale_b, use_fast_accum) -> Scaled | None:
        """A repeat call's float8 arguments (its signature's checks passed at the first call)."""
        if self.scaling is None:
            return None
        return Scaled(scale_a, scale_b, self.out_dtype, bool(use_fast_accum), self.scaling)


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A float8 call's scales and output dtype, as the dense transports take them."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    out_dtype: torch.dtype
    fast_accum: bool
    scaling: str
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``."""

    def matmul_args(self, rows: slice | None = None, *, scale_a: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> dict:
        """``matmul``'s FP8 keyword arguments for ``rows`` of ``a`` (all rows when None), or for another
        ``a`` whose scales are ``scale_a``; ``out_dtype``: another output dtype (float32 for a partial
        that is summed before it is rounded)."""
        sa = self.scale_a if scale_a is None else scale_a
        if rows is not None and self.scaling != "tensorwise":
            sa = sa[rows]
        return {"scale_a": sa, "scale_b": self.scale_b, "out_dtype": out_dtype or self.out_dtype,
                "use_fast_accum": self.fast_accum}

    def shard_rows(self, rows: int) -> torch.Tensor:
        """``scale_a`` of a shard of ``rows`` rows in the gathered form (module docstring): ``[rows, KB]``,
        contiguous, ready for a copy engine."""
        sa = self.scale_a
        if self.scaling == "tensorwise":
            return sa.reshape(1, 1).expand(rows, 1).contiguous()
        return sa.reshape(rows, -1).contiguous()

    def gathered_args(self, gathered_scales: torch.Tensor, n: int) -> dict:
        """``matmul``'s FP8 keyword arguments for gathered rows whose a-scales are ``gathered_scales`` (the
        gathered form): tensorwise calls become rowwise ones, ``scale_b`` broadcast along N (no copy)."""
        scale_b = self.scale_b
        if self.scaling == "tensorwise":
            scale_b = scale_b.reshape(1, 1).expand(1, n)
        return {"scale_a": gathered_scales, "scale_b": scale_b, "out_dtype": self.out_dtype,
                "use_fast_accum": self.fast_accum}


def wanted(a, b, scale_a, scale_b, out_dtype) -> bool:
    """Whether a call is a float8 one, or meant to be (its checks then decide): float8 operands, scales or
    an ``out_dtype``. A call without any takes no float8 check."""
    return scale_a is not None or scale_b is not None or out_dtype is not None or float8(a) or float8(b)


def float8(t) -> bool:
    """Whether ``t`` is a float8 tensor (e4m3fn or e5m2)."""
    return isinstance(t, torch.Tensor) and t.dtype in scaling.FP8_DTYPES


def fp8_key(scale_a, scale_b, out_dtype, use_fast_accum) -> tuple | None:
    """The float8 part of a dense call's signature: the scales' shapes, dtypes and devices, the output
    dtype and ``use_fast_accum``; ``()`` for a call without them, None for scales that are not tensors."""
    if scale_a is None and scale_b is None and out_dtype is None and not use_fast_accum:
        return ()
    parts = []
    for s in (scale_a, scale_b):
        if s is not None and type(s) is not torch.Tensor:
            return None
        parts.append(None if s is None else (s.shape, s.stride(), s.dtype, s.device))
    return (*parts, out_dtype, bool(use_fast_accum))


def check_fp8(op: str, a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype, use_fast_accum, *,
              m: int, n: int, k: int) -> Scaled | None:
    """The float8 arguments of ``a [m, k] @ b [k, n]`` (this rank's GEMM, before any communication), or
    None for a call on float16/bfloat16/float32 inputs (after refusing scales and an ``out_dtype`` other
    than theirs there). For calls that ``wanted`` says are float8 ones."""
    scaled = scaling.check_operands(op, a, b, scale_a, scale_b)
    dtype = scaling.out_dtype_of(op, a, out_dtype)
    if not scaled:
        return None
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype == torch.bfloat16 and common.interpreting():
        raise TypeError(f"{op}: out_dtype is bfloat16 (the default for float8 inputs), which Triton's interpreter "
                        "(TRITON_INTERPRET=1, the CPU) computes wrongly in the fused kernels; pass "
                        "out_dtype=torch.float16 or torch.float32 on the CPU (bfloat16 runs on GPUs)")
    scales = scaling.dense_scales(op, m, n, k, scale_a, scale_b, fast_accum=use_fast_accum)
    return Scaled(scale_a, scale_b, dtype, bool(use_fast_accum), scales.scaling)


def _check_transport(op: "DenseOp", transport) -> None:
    if transport not in op.transports:
        raise ValueError(f"{type(op).__name__}: transport must be one of {op.transports}, got {transport!r}")


def _check_config(op: "DenseOp", config) -> None:
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"{type(op).__name__}: config must be a tileweave GemmConfig or None (chosen per shape), "
                        f"got {type(config).__name__}")


class DenseOp(TPOp):
    """Base of ``AllGatherGemm`` and ``GemmReduceScatter``: one group, one workspace, one plan cache."""

    policies = ("auto", "fused", "oneshot", "fallback")
    a_name = "a"
    """What the errors call the first operand."""
    transports: tuple[str, ...] = ()
    transport_env = ""
    """The ``tileweave.runtime.settings`` variable that picks the shared op's transport."""
    default_transport = ""
    option_envs: dict[str, str] = {}
    """The subclass's boolean options that the shared op takes from ``tileweave.runtime.settings`` variables
    (option name: variable name)."""

    @classmethod
    def shared_options(cls) -> dict:
        """The shared op's transport, graphability and options from the environment
        (``tileweave.runtime.settings``)."""
        options = {name: settings.optional_flag(env) for name, env in cls.option_envs.items()}
        return dict(transport=settings.text(cls.transport_env) or cls.default_transport,
                    graphable=settings.flag(settings.GRAPHABLE),
                    **{name: value for name, value in options.items() if value is not None})

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto",
                 transport: str | None = None, config: GemmConfig | None = None,
                 max_spin: int | None = None, graphable: bool = False) -> None:
        """``policy``: one of the class's ``policies`` ("auto" picks per shape; ``TILEWEAVE_POLICY``
        overrides "auto" process-wide). ``transport``: one of the class's ``transports``, None for its
        ``default_transport``. ``config``: the kernel config of every shape (None: chosen per shape).
        ``max_spin``: polls a flag wait may take before it reports a lost peer (None: the backend's
        default). ``graphable``: run the fused paths on flags whose values are the same in every call, so
        that the calls can be captured in a CUDA graph and replayed (see the subclass). Every rank must
        construct its op with the same arguments."""
        self._plans: dict[tuple, Plan] = {}
        self.memory = Memory(graphable)
        super().__init__(group, policy=policy, max_spin=max_spin, graphable=graphable)
        # The one-shot kernels write an expired wait into the pinned word and the workspace's word.
        self.errors.host(self.memory.pinned_word, self.memory.kernel_word)
        self.transport = transport or self.default_transport
        self.config = config

    transport = option("transport", _check_transport)
    config = option("config", _check_config)

    def _settings_changed(self, name: str) -> None:
        if name == "max_spin":
            # The spin bound decides no path, so setting it keeps the plans (and needs no other rank); it
            # reaches the one-shot launch plans, which hold it; the other paths read it per call.
            ws = self.memory.ws
            if ws is not None:
                for key, entry in ws.plans.items():
                    if key[0] == "oneshot":
                        entry[1].max_spin = self.max_spin or ws.backend.default_max_spin
        else:
            self._plans.clear()

    @property
    def plans(self) -> types.MappingProxyType:
        """The plan cache, read-only: call signature -> ``Plan``."""
        return types.MappingProxyType(self._plans)

    @property
    def workspace(self) -> Workspace | None:
        """This rank's workspace (None before the first call that needs one)."""
        return self.memory.ws

    def _call(self, plan: Plan, capturing: bool, **options) -> Call:
        """The context a transport receives for one call, after any error an earlier call left."""
        self.errors.raise_pending(plan.backend, capturing)
        return Call(self.op_name, plan.backend, plan, self.memory, self.errors, self.graphable,
                    self.spin_bound(plan.backend), options)

    def _run(self, plan: Plan, capturing: bool, args: tuple, run: Callable | None = None, **options):
        """The call on ``plan``'s transport (or ``run``): ``run(call, *args)`` with this call's context
        (``_call``; ``options``: the op's settings the transport reads); a signature's first call inside
        ``skeleton.first_call``, where its kernels compile."""
        call = self._call(plan, capturing, **options)
        if plan.called:
            return (run or plan.run)(call, *args)
        plan.called = True
        with first_call(plan.backend):
            return (run or plan.run)(call, *args)

    # -- the skeleton ------------------------------------------------------------------------------

    local_run: Callable = staticmethod(lambda call, *args: None)
    """The transport of a group of one (the GEMM alone)."""
    nccl_run: Callable = staticmethod(lambda call, *args: None)
    """The unfused transport: NCCL and cuBLAS (captures in a CUDA graph)."""
    oneshot_run: Callable = staticmethod(lambda call, *args: None)
    """The one-shot transport (``policy="oneshot"``)."""

    def _plan_call(self, a, b, bias, out, fp8: tuple = (None, None, None, False)) -> tuple:
        """``(plan, bias, out, scaled)`` of a call: its signature's plan, decided now if it is the first
        call (collectively, with the checks); the arguments checked unless a plan exists and the call has
        neither bias nor ``out`` (the signature's first call checked them). ``fp8``: the call's
        ``(scale_a, scale_b, out_dtype, use_fast_accum)``; ``scaled``: them checked, None without float8."""
        common.check_no_grad(self.op_name, a, b, bias, names=("a", "b", "bias"))
        key = self.signature(a, b, bias, *fp8)
        plan = self._planned(key, common.capturing(a)) if key is not None else None
        if plan is not None:
            if bias is not None or out is not None:
                bias, out, _ = self._check(a, b, bias, out, fp8)
            return plan, bias, out, plan.scaled(fp8[0], fp8[1], fp8[3])
        if not isinstance(a, torch.Tensor):
            self._check(a, b, bias, out, fp8)  # raises: a's device names the backend to agree on
        plan, (bias, out, scaled) = self._make_plan(a, b, bias, out, fp8)
        if key is not None:
            self._plans[key] = plan
        return plan, bias, out, scaled

    def _make_plan(self, a, b, bias, out, fp8: tuple) -> tuple[Plan, tuple]:
        """``(plan, checked)`` of a new signature: the GEMM alone in a group of one, else the path
        ``_decide`` agrees on and its transport; ``checked``: ``_check``'s result, which ran inside the
        agreement (every rank raises what one rank's checks raised)."""
        backend = self.backend_for(a.device)
        checked = []

        def check() -> Scaled | None:
            checked.append(self._check(a, b, bias, out, fp8))
            return checked[-1][2]

        if backend.world_size == 1:
            scaled = check()
            return self._with_scaling(Plan("local", self.local_run, backend), scaled), checked[0]
        for name, t in ((self.a_name, a), ("b", b)):  # what the agreed shapes are made of (check_matrix's words)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        m, n, k, shape = self._gemm_shape(a, b, backend.world_size)

        def auto() -> str:
            if not backend.peer_access:
                return "fallback"
            return "fallback" if self._auto_route(m, n, k, a.dtype, backend) == "fallback" else "fused"

        fp8_shape = () if not wanted(a, b, *fp8[:3]) else (
            describe_scale(fp8[0]), describe_scale(fp8[1]), str(fp8[2]), bool(fp8[3]))
        path, config = self._decide(backend, m, n, k, a.dtype, shape + fp8_shape, bias is not None, auto, check)
        scaled = checked[0][2]
        if path == "oneshot":
            plan = Plan("oneshot", self.oneshot_run, backend, epochs=True)
        elif path == "fallback":
            plan = self._nccl_plan(backend)
        else:
            plan = self._fused_plan(backend, config, m, n, k, a.dtype)
        return self._with_scaling(plan, scaled), checked[0]

    @staticmethod
    def _with_scaling(plan: Plan, scaled: Scaled | None) -> Plan:
        if scaled is not None:
            plan.scaling, plan.out_dtype = scaled.scaling, scaled.out_dtype
        return plan

    def _nccl_plan(self, backend: Backend) -> Plan:
        return Plan("fallback", self.nccl_run, backend)

    def _check(self, a, b, bias, out, fp8: tuple) -> tuple:
        """``(bias, out, scaled)`` as the transports take them, after checking every argument
        (``scaled``: ``check_fp8``'s)."""
        raise NotImplementedError

    def _check_operands(self, a, b, a_name: str, rows: str, depth: str, cols: str, fp8: tuple) -> tuple:
        """Check the GEMM's operands ``a [rows, depth]`` (called ``a_name``) and ``b [depth, cols]`` and the
        float8 arguments ``fp8``; return the group size and ``check_fp8``'s result."""
        if float8(a) or float8(b):
            for name, t in ((a_name, a), ("b", b)):
                if not isinstance(t, torch.Tensor) or t.dim() != 2:
                    raise ValueError(f"{self.op_name}: {name} must be a 2-D tensor, got {common.describe(t)}")
        else:
            common.check_matrix(a_name, a)
            common.check_matrix("b", b, dtype=a.dtype, device=a.device)
            common.check_runs_dtype(self.op_name, a_name, a)
        if b.shape[0] != a.shape[1]:
            raise ValueError(f"{a_name} is [{rows}={a.shape[0]}, {depth}={a.shape[1]}] but b is {list(b.shape)}: "
                             f"b must be [{depth}={a.shape[1]}, {cols}]")
        scaled = None
        if wanted(a, b, *fp8[:3]):
            scaled = check_fp8(self.op_name, a, b, *fp8, m=a.shape[0], n=b.shape[1], k=a.shape[1])
        return self.backend_for(a.device).world_size, scaled

    def _gemm_shape(self, a, b, world: int) -> tuple[int, int, int, tuple]:
        """``(m, n, k, shape)``: the local GEMM's dims and what every rank must have alike."""
        raise NotImplementedError

    def _auto_route(self, m: int, n: int, k: int, dtype: torch.dtype, backend: Backend) -> str:
        """The route under ``policy="auto"``: "fallback" or a fused transport's name."""
        raise NotImplementedError

    def _fused_plan(self, backend: Backend, config: GemmConfig, m: int, n: int, k: int, dtype: torch.dtype) -> Plan:
        """The plan of the fused path."""
        raise NotImplementedError

    @staticmethod
    def signature(a, b, bias, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False) -> tuple | None:
        """The plan cache's key of a call: shapes, dtypes, devices, whether it has a bias, and for float8
        calls the scales' shapes, strides, dtypes and devices, ``out_dtype`` and ``use_fast_accum``; None
        for arguments that are not tensors (they take the checks, which name what is wrong)."""
        if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
            return None
        fp8 = fp8_key(scale_a, scale_b, out_dtype, use_fast_accum)
        if fp8 is None:
            return None
        return (a.shape, b.shape, a.dtype, b.dtype, a.device, b.device, bias is not None, *fp8)

    def _planned(self, key: tuple | None, capturing: bool) -> Plan | None:
        """The plan of ``key`` if one was decided, checked against CUDA-graph capture: the first call of
        a signature must be eager (its agreement is a collective of Python objects), and a path whose
        flags carry epochs is not captured unless the op is graphable: NCCL runs instead, or under
        ``policy="fused"`` the call raises."""
        plan = self._plans.get(key) if key is not None else None
        if capturing:
            if plan is None and self.policy == "fused" and not self.graphable:
                raise common.capture_refused(self.op_name, graphable_ops=True)
            if plan is None:
                self.require_eager("checks it with the other ranks")
            if plan.epochs and not self.graphable:
                if self.policy == "fused":
                    raise common.capture_refused(self.op_name, graphable_ops=True)
                # Epochs a replay would not advance: NCCL, as every rank does (with the signature's
                # float8 scaling).
                return dataclasses.replace(self._nccl_plan(plan.backend), scaling=plan.scaling,
                                           out_dtype=plan.out_dtype)
        return plan

    def _decide(self, backend: Backend, m: int, n: int, k: int, dtype: torch.dtype, shape: tuple,
                has_bias: bool, auto: Callable[[], str],
                check: Callable[[], Scaled | None]) -> tuple[str, GemmConfig]:
        """``(path, config)`` of a new signature: the policy's path, or under "auto" ``auto()``'s, with
        rank 0's config, after checking with every rank that it was called with the same ``shape``
        (collective: every rank decides the same signature at the same call), and that ``check()`` (this
        rank's argument checks) passed on every rank. ``m, n, k``: the local GEMM's."""

        def propose() -> GemmConfig:
            scaled = check()
            fp8 = {} if scaled is None else {"out_dtype": scaled.out_dtype, "scaling": scaled.scaling}
            proposal = self.config or select_config(m, n, k, dtype, backend.device, num_sms=backend.num_sms,
                                                    interpreter=backend.interpreter, stream_k=False, **fp8)
            # The fused kernel deals out whole tiles (a tile's flags assume one producer), but for a
            # consumer's partial last wave (``_stream_k_tail``).
            proposal = dataclasses.replace(proposal, stream_k=False, block_n2=0)
            return dataclasses.replace(proposal, stream_k=self._stream_k_tail(proposal, m, n, k, backend))

        path = auto() if self.policy == "auto" or not backend.peer_access else self.policy
        # Named fields, so that ranks that differ are told which argument differs.
        names = (f"{self.a_name} rows", "K", "N", "scale_a", "scale_b", "out_dtype", "use_fast_accum")
        signature = {**{name: repr(value) for name, value in zip(names, shape)}, "dtype": str(dtype),
                     "bias": "given" if has_bias else "none", "path": repr(path)}
        config = self._agreed(backend, signature, propose)
        if not (m > 0 and n > 0 and k > 0):
            path = "fallback"
        return path, config

    def _stream_k_tail(self, config: GemmConfig, m: int, n: int, k: int, backend: Backend) -> bool:
        """Whether the fused kernel shares its partial last wave of tiles by K steps (a subclass's
        choice; none by default)."""
        return False


def describe_scale(s) -> object:
    """What the ranks compare of a scale: its shape, dtype and device type (``common.signature_of``)."""
    return None if s is None else common.describe(s) if not isinstance(s, torch.Tensor) else \
        (tuple(s.shape), str(s.dtype), s.device.type)


# -- the one-shot paths' shared part ---------------------------------------------------------------------

def oneshot_start(call: Call, rows: int, cols: int, dtype: torch.dtype, make: Callable[[Workspace], tuple]) -> tuple:
    """``(workspace, this call's slot, launch plan, epoch)`` of a one-shot call whose slots are
    ``[rows, cols]``: ``make(ws)`` makes the slots and launch plan of the op's workspace the first
    time (kept in its plans)."""
    memory = call.memory
    ws = memory.ws
    key = ("oneshot", rows, cols, dtype)
    entry = ws.plans.get(key) if ws is not None else None
    if entry is None:
        ws = memory.workspace(call.backend, 0)
        entry = ws.plans[key] = make(ws)
    ws.oneshot_epoch += 1
    slots, launch_plan = entry
    return ws, slots[ws.oneshot_epoch & 1], launch_plan, ws.oneshot_epoch


def oneshot_launch_plan(call: Call, ws: Workspace, dtype: torch.dtype, **shape) -> OneshotPlan:
    """The launch plan of a one-shot kernel on ``ws``'s one-shot buffer (which must hold the call's
    slots); ``shape``: ``OneshotPlan``'s rows, cols, row0, parts."""
    backend = call.backend
    return OneshotPlan(peer_offsets=ws.oneshot_offsets(dtype.itemsize), signals=ws.oneshot_signals(),
                       ready=ws.oneshot_flags(), err=ws.err, host_err=call.memory.host_word(backend.device).tensor,
                       rank=backend.rank, world=backend.world_size, max_spin=call.spin,
                       programs=backend.num_sms, meet=meeting(backend), **shape)


def oneshot_finish(call: Call) -> None:
    """After a one-shot launch: in debug mode (and on the CPU) wait for it, bounded as its waits are,
    and raise at once if one expired; otherwise the next call reports it (from the pinned host word)."""
    backend = call.backend
    if backend.interpreter or common.debug_mode():
        backend.synchronize()
        call.errors.raise_pending(backend)
    call.record("oneshot")
