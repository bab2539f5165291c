"""The skeleton every fused op follows: check the arguments, look up the plan of the call's signature
(decided once, agreed by every rank, kept in one cache), and let the plan's transport run the call.

A subclass supplies the checks (``__call__``) and ``_make_plan``, which picks a transport for a
signature; transports are functions ``run(op, plan, *args)`` in the op's folder. This module holds what
they share: the settings, the group's backend, the plan cache, the kernel config agreed per signature,
and the error reporting of bounded waits.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import types
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.compute.gemm_launch import launch, launch_cached
from tileweave.ops.compute.oneshot_launch import OneshotPlan
from tileweave.ops.workspace import Workspace, agree
from tileweave.runtime.backend import Backend, HostWord, TileweaveError, get_backend
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import GemmConfig

POLICIES = ("auto", "fused", "oneshot", "fallback")
"""The ops' policies: "auto" picks per shape, the others force a path; an op with other paths lists its
own in ``policies``."""


@dataclasses.dataclass
class Plan:
    """What every call of one signature (shapes, dtypes, devices, whether there is a bias) runs,
    decided at its first call and agreed by every rank."""

    path: str
    """What ``tileweave.last_path`` reports: "fused", "chunked", "oneshot", "fallback" or "local"."""
    run: Callable
    """The transport's entry point, ``run(op, plan, *args)``."""
    backend: Backend
    config: GemmConfig | None = None
    """The kernel config every rank agreed on (None for paths without a kernel of ours)."""
    epochs: bool = False
    """Whether the transport's flags carry epochs, which a CUDA-graph replay would not advance."""
    first: bool = True
    """The first launch is still to come: every rank compiles, then meets (``FusedOp.launch_kernel``)."""


def option(name: str, check: Callable[["FusedOp", object], None] | None = None) -> property:
    """An op setting that decides which path a call takes: read as a plain attribute; set (on every
    rank alike, as the constructor's arguments), it is checked by ``check`` and empties the plan cache,
    so that each signature's next call decides again (collectively, as at its first)."""
    slot = "_option_" + name

    def set_option(op: "FusedOp", value) -> None:
        if check is not None:
            check(op, value)
        op.__dict__[slot] = value
        op._plans.clear()

    return property(operator.attrgetter(slot), set_option)


def _check_policy(op: "FusedOp", policy) -> None:
    if policy not in op.policies:
        from_env = os.environ.get("TILEWEAVE_POLICY") == policy
        raise ValueError(f"{type(op).__name__}: policy must be one of {op.policies}, got {policy!r}"
                         + (" (from TILEWEAVE_POLICY)" if from_env else ""))


def _check_transport(op: "FusedOp", transport) -> None:
    if transport not in op.transports:
        raise ValueError(f"{type(op).__name__}: transport must be one of {op.transports}, got {transport!r}")


def _check_config(op: "FusedOp", config) -> None:
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"{type(op).__name__}: config must be a tileweave GemmConfig or None (chosen per shape), "
                        f"got {type(config).__name__}")


def _check_max_spin(op: "FusedOp", max_spin) -> None:
    if max_spin is not None and (isinstance(max_spin, bool) or not isinstance(max_spin, int)
                                 or not 0 < max_spin < 1 << 31):
        raise ValueError(f"{type(op).__name__}: max_spin is the polls a flag wait may take before it reports "
                         f"a lost peer: None (the backend's default) or an int in [1, 2**31), got {max_spin!r}")


class FusedOp:
    """Base of ``AllGatherGemm`` and ``GemmReduceScatter``: one group, one workspace, one plan cache."""

    op_name = ""
    policies: tuple[str, ...] = POLICIES
    transports: tuple[str, ...] = ()
    transport_env = ""
    """Environment variable that picks the transport of the ops the functional API shares."""
    default_transport = ""
    option_envs: dict[str, str] = {}
    """The subclass's boolean constructor options that the shared op takes from environment variables
    (option name: variable name)."""
    _shared: dict[tuple, "FusedOp"]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._shared = {}

    @classmethod
    def shared(cls, group: dist.ProcessGroup, device: torch.device) -> "FusedOp":
        """The op shared by every functional call on ``group`` and ``device`` (and so by the TP layers).
        ``TILEWEAVE_GRAPHABLE=1`` makes it graphable, so that a model's TP layers can be captured in a
        CUDA graph on the fused paths; ``option_envs`` name the variables of the subclass's options."""
        key = (id(group), device)  # the op holds the group, so its id is not reused while cached
        op = cls._shared.get(key)
        if op is None:
            op = cls._shared[key] = cls(group, transport=os.environ.get(cls.transport_env, cls.default_transport),
                                        graphable=common.env_flag("TILEWEAVE_GRAPHABLE"), **cls.env_options())
        return op

    @classmethod
    def env_options(cls) -> dict[str, bool]:
        """The subclass's options that the environment sets (``option_envs``; an unset or empty variable
        leaves the constructor's default)."""
        return {name: common.env_flag(env) for name, env in cls.option_envs.items() if os.environ.get(env)}

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
        self.graphable = graphable
        self.group = group if group is not None else dist.group.WORLD
        self._ws: Workspace | None = None
        self._backend: Backend | None = None
        self._err_mirror = None
        self._host_err: HostWord | None = None
        self._plans: dict[tuple, Plan] = {}
        self.policy = os.environ.get("TILEWEAVE_POLICY", "auto") if policy == "auto" else policy
        self.transport = transport or self.default_transport
        self.config = config
        self.max_spin = max_spin

    policy = option("policy", _check_policy)
    transport = option("transport", _check_transport)
    config = option("config", _check_config)

    def _set_max_spin(self, max_spin) -> None:
        # The spin bound decides no path, so setting it keeps the plans (and needs no other rank); it
        # reaches the one-shot launch plans, which hold it; the other paths read it per call.
        _check_max_spin(self, max_spin)
        self.__dict__["_option_max_spin"] = max_spin
        if self._ws is not None:
            for key, plan in self._ws.plans.items():
                if key[0] == "oneshot":
                    plan[1].max_spin = max_spin or self._ws.backend.default_max_spin

    max_spin = property(operator.attrgetter("_option_max_spin"), _set_max_spin)

    @property
    def plans(self) -> types.MappingProxyType:
        """The plan cache, read-only: call signature -> ``Plan``."""
        return types.MappingProxyType(self._plans)

    @property
    def workspace(self) -> Workspace | None:
        """This rank's workspace (None before the first call that needs one)."""
        return self._ws

    # -- the skeleton ------------------------------------------------------------------------------

    local_run: Callable = staticmethod(lambda op, plan, *args: None)
    """The transport of a group of one (the GEMM alone)."""
    nccl_run: Callable = staticmethod(lambda op, plan, *args: None)
    """The unfused transport: NCCL and cuBLAS (captures in a CUDA graph)."""
    oneshot_run: Callable = staticmethod(lambda op, plan, *args: None)
    """The one-shot transport (``policy="oneshot"``)."""

    def _plan_call(self, a, b, bias, out) -> tuple[Plan, torch.Tensor | None, torch.Tensor | None]:
        """``(plan, bias, out)`` of a call: its signature's plan, decided now if it is the first call
        (collectively); the arguments checked unless a plan exists and the call has neither bias nor
        ``out`` (the signature's first call checked them)."""
        common.check_no_grad(self.op_name, a, b, bias, names=("a", "b", "bias"))
        key = self.signature(a, b, bias)
        plan = self._planned(key, common.capturing(a)) if key is not None else None
        if plan is None or bias is not None or out is not None:
            bias, out = self._check(a, b, bias, out)
        if plan is None:
            plan = self._plans[key] = self._make_plan(a, b, bias)
        return plan, bias, out

    def _make_plan(self, a, b, bias) -> Plan:
        """The plan of a new signature: the GEMM alone in a group of one, else the path ``_decide``
        agrees on and its transport."""
        backend = self._get_backend(a.device)
        if backend.world_size == 1:
            return Plan("local", self.local_run, backend)
        m, n, k, shape = self._gemm_shape(a, b, backend.world_size)

        def auto() -> str:
            if not backend.peer_access:
                return "fallback"
            return "fallback" if self._auto_route(m, n, k, a.dtype, backend) == "fallback" else "fused"

        path, config = self._decide(backend, m, n, k, a.dtype, shape, bias is not None, auto)
        if path == "oneshot":
            return Plan("oneshot", self.oneshot_run, backend, epochs=True)
        if path == "fallback":
            return self._nccl_plan(backend)
        return self._fused_plan(backend, config, m, n, k, a.dtype)

    def _nccl_plan(self, backend: Backend) -> Plan:
        return Plan("fallback", self.nccl_run, backend)

    def _check(self, a, b, bias, out) -> tuple:
        """``(bias, out)`` as the transports take them, after checking every argument."""
        raise NotImplementedError

    def _check_operands(self, a, b, a_name: str, rows: str, depth: str, cols: str) -> int:
        """Check the GEMM's operands ``a [rows, depth]`` (called ``a_name``) and ``b [depth, cols]``, and
        return the group size."""
        common.check_matrix(a_name, a)
        common.check_matrix("b", b, dtype=a.dtype, device=a.device)
        common.check_runs_dtype(self.op_name, a_name, a)
        if b.shape[0] != a.shape[1]:
            raise ValueError(f"{a_name} is [{rows}={a.shape[0]}, {depth}={a.shape[1]}] but b is {list(b.shape)}: "
                             f"b must be [{depth}={a.shape[1]}, {cols}]")
        return self._get_backend(a.device).world_size

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
    def signature(a, b, bias) -> tuple | None:
        """The plan cache's key of a call: shapes, dtypes, devices and whether it has a bias; None for
        arguments that are not tensors (they take the checks, which name what is wrong)."""
        if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
            return None
        return (a.shape, b.shape, a.dtype, b.dtype, a.device, b.device, bias is not None)

    def _planned(self, key: tuple | None, capturing: bool) -> Plan | None:
        """The plan of ``key`` if one was decided, checked against CUDA-graph capture: the first call of
        a signature must be eager (its agreement is a collective of Python objects), and a path whose
        flags carry epochs cannot be captured unless the op is graphable."""
        plan = self._plans.get(key) if key is not None else None
        if capturing:
            if plan is None and self.policy == "fused" and not self.graphable:
                raise TileweaveError(f"{self.op_name}: {common.CAPTURE_FUSED}")
            if plan is None:
                raise TileweaveError(f"{self.op_name}: the first call of each shape checks it with the other "
                                     "ranks (a collective that a CUDA graph cannot hold): call it once with "
                                     "these shapes before capturing")
            if plan.epochs and not self.graphable:
                if plan.path != "oneshot":
                    raise TileweaveError(f"{self.op_name}: {common.CAPTURE_FUSED}")
                return self._nccl_plan(plan.backend)  # the one-shot path's epochs: NCCL, as every rank does
        return plan

    def _decide(self, backend: Backend, m: int, n: int, k: int, dtype: torch.dtype, shape: tuple,
                has_bias: bool, auto: Callable[[], str]) -> tuple[str, GemmConfig]:
        """``(path, config)`` of a new signature: the policy's path, or under "auto" ``auto()``'s, with
        rank 0's config, after checking with every rank that it was called with the same ``shape``
        (collective: every rank decides the same signature at the same call). ``m, n, k``: the local
        GEMM's."""
        proposal = self.config or select_config(m, n, k, dtype, backend.device, num_sms=backend.num_sms,
                                                interpreter=backend.interpreter, stream_k=False)
        # The fused kernel deals out whole tiles (a tile's flags assume one producer), but for a
        # consumer's partial last wave (``_stream_k_tail``).
        proposal = dataclasses.replace(proposal, stream_k=False, block_n2=0)
        proposal = dataclasses.replace(proposal, stream_k=self._stream_k_tail(proposal, m, n, k, backend))
        path = auto() if self.policy == "auto" or not backend.peer_access else self.policy
        config = agree(backend, self.op_name, (self.op_name, *shape, str(dtype), has_bias, path), proposal)
        if not (m > 0 and n > 0 and k > 0):
            path = "fallback"
        return path, config

    def _stream_k_tail(self, config: GemmConfig, m: int, n: int, k: int, backend: Backend) -> bool:
        """Whether the fused kernel shares its partial last wave of tiles by K steps (a subclass's
        choice; none by default)."""
        return False

    def _get_backend(self, device: torch.device) -> Backend:
        if self._backend is None or self._backend.device != device:
            self._backend = get_backend(self.group, device)
        return self._backend

    # -- what the transports share -------------------------------------------------------------------

    def programs(self, config: GemmConfig, backend: Backend) -> int:
        """Persistent programs of a fused launch: the config's count, or one per SM, within what every
        program resident at once allows (``Backend.max_programs``)."""
        return min(config.programs or backend.num_sms, backend.max_programs(False))

    def spin_bound(self, backend: Backend) -> int:
        return self.max_spin or backend.default_max_spin

    def launch_kernel(self, plan: Plan, **launch_args) -> None:
        """Launch the fused kernel. On a plan's first launch every rank compiles it first and then meets
        the others: a kernel spinning on a peer that is still compiling would spend its bounded wait on
        the compiler (seconds for a cold cache) and could report a lost peer."""
        backend = plan.backend
        if plan.first and not backend.interpreter:
            try:
                launch(**launch_args, compile_only=True)
            except Exception:  # noqa: BLE001 - the launch below compiles again and raises the error itself
                pass
            meeting(backend)()
        plan.first = False
        launch_cached(**launch_args)

    def check_previous(self, capturing: bool = False) -> None:
        """Raise if an earlier fused kernel's bounded wait expired (its mirrored error word is set)."""
        # Not while capturing: an event query there could invalidate the capture.
        code = self._err_mirror.read() if self._err_mirror is not None and not capturing else 0
        if code:
            self._err_mirror.clear()
            self._ws.err.zero_()
            common.raise_on_timeout(torch.tensor([code], dtype=torch.int32), self.op_name,
                                    self._backend.rank if self._backend else -1)

    def finish_kernel(self, backend: Backend, ws: Workspace) -> None:
        """After a fused launch: surface an expired in-kernel wait. In debug mode (and on the CPU) by
        synchronising now; otherwise without a sync, from a copy of the error word that the next call
        reads once the GPU has written it, so a lost peer is reported one call late but never silently
        (the outputs of a call whose wait expired are wrong). Under CUDA-graph capture (graphable ops)
        neither: the host cannot wait inside a capture, and a captured copy would be read without an
        event to say it landed; the kernel's waits stay bounded and record their error word on the GPU."""
        if common.capturing(ws.err):
            return
        self._err_mirror = common.surface_timeout(ws.err, self.op_name, backend, self._err_mirror)

    @staticmethod
    def finish_streams(backend: Backend) -> None:
        """After a call that launched no kernel of ours (the chunked transports): its stream waits are
        bounded on the host, in debug mode (and on the CPU); not under CUDA-graph capture, where the
        host cannot wait."""
        if backend.interpreter or (common.debug_mode() and not torch.cuda.is_current_stream_capturing()):
            backend.synchronize()

    # -- the one-shot paths' shared part -------------------------------------------------------------

    def oneshot_start(self, backend: Backend, rows: int, cols: int, dtype: torch.dtype,
                      make: Callable[[], tuple]) -> tuple:
        """``(workspace, this call's slot, launch plan, epoch)`` of a one-shot call whose slots are
        ``[rows, cols]``: ``make()`` makes and keeps the slots and launch plan the first time; an
        earlier call's expired wait is reported first."""
        ws = self._ws
        entry = ws.plans.get(("oneshot", rows, cols, dtype)) if ws is not None else None
        if entry is None:
            entry = make()
            ws = self._ws
        self._oneshot_check(ws, backend.rank)
        ws.oneshot_epoch += 1
        slots, launch_plan = entry
        return ws, slots[ws.oneshot_epoch & 1], launch_plan, ws.oneshot_epoch

    def oneshot_launch_plan(self, backend: Backend, ws: Workspace, dtype: torch.dtype, **shape) -> OneshotPlan:
        """The launch plan of a one-shot kernel on ``ws``'s one-shot buffer (which must hold the call's
        slots); ``shape``: ``OneshotPlan``'s rows, cols, row0, parts."""
        if self._host_err is None:
            self._host_err = HostWord(backend.device)
        return OneshotPlan(peer_offsets=ws.oneshot_offsets(dtype.itemsize), signals=ws.oneshot_signals(),
                           ready=ws.oneshot_flags(), err=ws.err, host_err=self._host_err.tensor,
                           rank=backend.rank, world=backend.world_size, max_spin=self.spin_bound(backend),
                           programs=backend.num_sms, meet=meeting(backend), **shape)

    def _oneshot_check(self, ws: Workspace, rank: int) -> None:
        """Raise if an earlier one-shot kernel's wait expired: its word in pinned host memory is set (no
        driver call, unlike ``check_previous``'s mirror)."""
        code = self._host_err.read()
        if code:
            self._host_err.clear()
            ws.err.zero_()  # the device word too, which the fused paths' check would report again
            common.raise_on_timeout(torch.tensor([code], dtype=torch.int32), self.op_name, rank)

    def oneshot_finish(self, backend: Backend, ws: Workspace) -> None:
        """After a one-shot launch: in debug mode (and on the CPU) wait for it, bounded as its waits
        are, and raise at once if one expired; otherwise the next call reports it."""
        if backend.interpreter or common.debug_mode():
            backend.synchronize()
            self._oneshot_check(ws, backend.rank)
        common.record_path(self.op_name, "oneshot")


def meeting(backend: Backend) -> Callable[[], None]:
    """The barrier that follows a first launch's compile (``FusedOp.launch_kernel``, ``OneshotPlan.meet``)."""
    device_ids = [backend.device.index] if backend.device.type == "cuda" else None
    return lambda: dist.barrier(group=backend.group, device_ids=device_ids)
