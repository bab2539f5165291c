"""What the two fused ops share: their settings, their group's backend, and the per-shape decision of
path and kernel config that every rank must agree on before anything is allocated or launched."""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops import _launch
from tileweave.ops.workspace import Workspace, agree
from tileweave.runtime.backend import Backend, HostWord, TileweaveError, get_backend
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import GemmConfig

POLICIES = ("auto", "fused", "fallback")
"""Every op's policies; an op with more paths lists them in its ``policies``."""

REPLAY_BELOW_GFLOP = 128.0
"""With ``replay``: calls of less local GEMM work than this replay a CUDA graph of the chunked path. On
the benchmark hosts issuing a chunked call costs the host ~120-190 us, more than the GPU's work on the
suite's rows under ~100 GFLOP (NOTES.md, entries 26, 39 and 52); a graph's replay costs one launch."""
REPLAY_GRAPHS = 32
"""Graphs one op keeps (one per shape, weight and bias address); calls beyond run the chunked path eagerly."""


def _workspace_token(op: "FusedOp") -> tuple:
    """What a graph of ``op``'s calls has baked in of its buffers: the workspace and its send buffer."""
    ws = op._ws
    return (id(ws), ws.local.data_ptr() if ws is not None and ws.local is not None else 0)


def option(name: str, check: Callable[["FusedOp", object], None] | None = None) -> property:
    """An op setting that decides which path a call takes (or what a decided path bakes in): read as a
    plain attribute; set (on every rank alike, as the constructor's arguments), it is checked by
    ``check`` and forgets what the op decided under the old value (``FusedOp._forget_paths``), so that
    each signature's next call decides again."""
    slot = "_option_" + name

    def set_option(op: "FusedOp", value) -> None:
        if check is not None:
            check(op, value)
        op.__dict__[slot] = value
        op._forget_paths()

    return property(operator.attrgetter(slot), set_option)


def _check_policy(op: "FusedOp", policy) -> None:
    if policy not in op.policies:
        from_env = os.environ.get("TILEWEAVE_POLICY") == policy
        raise ValueError(f"{type(op).__name__}: policy must be one of {op.policies}, got {policy!r}"
                         + (" (from TILEWEAVE_POLICY)" if from_env else ""))


def _check_transport(op: "FusedOp", transport) -> None:
    if transport not in op.transports:
        raise ValueError(f"{type(op).__name__}: transport must be one of {op.transports}, got {transport!r}")
    if op.graphable and transport not in op.graphable_transports:
        offered = ", ".join(op.graphable_transports) or "none"
        raise ValueError(f"{type(op).__name__}(graphable=True) needs a transport with replayable flags "
                         f"({offered}), got {transport!r}")


def _check_max_spin(op: "FusedOp", max_spin) -> None:
    if max_spin is not None and (isinstance(max_spin, bool) or not isinstance(max_spin, int)
                                 or not 0 < max_spin < 1 << 31):
        raise ValueError(f"{type(op).__name__}: max_spin is the polls a flag wait may take before it reports "
                         f"a lost peer: None (the backend's default) or an int in [1, 2**31), got {max_spin!r}")


def _check_config(op: "FusedOp", config) -> None:
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"{type(op).__name__}: config must be a tileweave GemmConfig or None (chosen per shape), "
                        f"got {type(config).__name__}")


class _HostGraph:
    """Where there are no CUDA graphs (emulated ranks): a replay runs the captured call again, so that
    the replay logic around it (keys, static inputs, copies out) runs in the CPU tests."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self._fn = fn
        self.out: torch.Tensor | None = None

    def replay(self) -> None:
        self.out = self._fn()


class FusedOp:
    """Base of ``AllGatherGemm`` and ``GemmReduceScatter``: one group, one workspace, reused."""

    op_name = ""
    policies: tuple[str, ...] = POLICIES
    transports: tuple[str, ...] = ()
    transport_env = ""
    """Environment variable that picks the transport of the ops the functional API shares."""
    default_transport = ""
    graphable_transports: tuple[str, ...] = ()
    """Transports that have the constant-valued (CUDA-graph replayable) protocol; none: not offered."""
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
                                        graphable=_launch.env_flag("TILEWEAVE_GRAPHABLE"), **cls.env_options())
        return op

    @classmethod
    def env_options(cls) -> dict[str, bool]:
        """The subclass's options that the environment sets (``option_envs``; an unset or empty variable
        leaves the constructor's default)."""
        return {name: _launch.env_flag(env) for name, env in cls.option_envs.items() if os.environ.get(env)}

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto",
                 transport: str | None = None, config: GemmConfig | None = None,
                 max_spin: int | None = None, graphable: bool = False, replay: bool = False) -> None:
        """``transport``: one of the class's ``transports``, None for its ``default_transport``.
        ``graphable``: run the fused paths on flags whose values are the same in every call, so that
        the calls can be captured in a CUDA graph and replayed (see the subclass).
        ``replay`` (opt-in, every rank alike; ``TILEWEAVE_REPLAY=1`` for the shared op; not with
        ``graphable``): calls of under ``REPLAY_BELOW_GFLOP`` of local GEMM work, under the policies
        "auto" and "fused", run the chunked transport by replaying a CUDA graph of it, captured per
        shape and weight address: the host issues a copy of the input, one launch and a copy of the
        output instead of the chunked call's dozen operations, and a repeat skips the argument
        checks. Graphs are captured from a shape's second call on (its first runs eagerly); bias and
        weight are read at their addresses, so they must stay where they are (parameters do). Not
        for calls that return the gathered input. Measured on 2x H200 (NOTES.md, entry 54): faster
        only where the host bounds the call (AllGather+GEMM llama3-8b qkv M=2048 1.18x the eager
        path); where the eager call keeps the GPU busy, the graph's copies in and out and the
        graphable protocol's resets cost more than the host saves (0.85-0.90x on three rows,
        GEMM+ReduceScatter 0.77-0.92x NCCL+cuBLAS on its small rows), hence opt-in."""
        if graphable and replay:
            raise ValueError(f"{type(self).__name__}: replay=True captures its own graphs; a graphable op is "
                             "for graphs of the caller's")
        self.graphable = graphable
        self.group = group if group is not None else dist.group.WORLD
        self._ws: Workspace | None = None
        self._backend: Backend | None = None
        self._err_mirror = None
        self._replay_op: FusedOp | None = None
        self._replay_warm: set[tuple] = set()
        self._graphs: dict[tuple, tuple] = {}
        self._graphs_workspace: tuple = ()
        self._agreed: dict[tuple, object] = {}
        self._decisions: dict[tuple, tuple[bool, GemmConfig]] = {}
        self._unfused: dict[tuple, Backend] = {}
        """Signatures (shapes, dtypes, devices; no bias, no ``out``) already decided for the unfused
        path, with their backend: a repeat call skips the checks and the decision, whose Python costs
        tens of microseconds on the host, as much as a small GEMM and its collective on the GPU."""
        self._routes: dict[tuple, tuple[str, Backend, GemmConfig | None]] = {}
        """The same for other paths that need no per-call decision once taken, with their backend and
        config: ``"oneshot"`` (the subclasses that have it), ``"pull"`` (GEMM+ReduceScatter's pulling
        call) and ``"fused"`` (AllGather+GEMM's fused transports)."""
        # TILEWEAVE_POLICY overrides "auto" process-wide (the benchmark uses it to time one path).
        self.policy = os.environ.get("TILEWEAVE_POLICY", "auto") if policy == "auto" else policy
        self.transport = transport or self.default_transport
        self.replay = replay
        self.config = config
        self.max_spin = max_spin
        self._host_err: HostWord | None = None

    policy = option("policy", _check_policy)
    transport = option("transport", _check_transport)
    replay = option("replay")
    config = option("config", _check_config)

    def _set_max_spin(self, max_spin) -> None:
        """The spin bound decides no path, so setting it forgets nothing (and needs no other rank): it
        reaches the one-shot plans, which hold it, and ``replay``'s inner op; the other paths read it per
        call."""
        _check_max_spin(self, max_spin)
        self.__dict__["_option_max_spin"] = max_spin
        if self._replay_op is not None:
            self._replay_op.max_spin = max_spin
        if self._ws is not None:
            for key, plan in self._ws.plans.items():
                if key[0] == "oneshot":
                    plan[1].max_spin = max_spin or self._ws.backend.default_max_spin

    max_spin = property(operator.attrgetter("_option_max_spin"), _set_max_spin)

    def _forget_paths(self) -> None:
        """Forget what the op decided under its settings before one changed (``option``): the agreed
        configs, the paths and routes, and ``replay``'s graphs with the inner op that ran them (each
        made again at its signature's next call, collectively as at the first)."""
        for decided in (self._agreed, self._decisions, self._unfused, self._routes, self._graphs, self._replay_warm):
            decided.clear()
        self._replay_op = None

    @staticmethod
    def _replay_key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """What a graph of a call bakes in: shapes, layouts, dtypes, device, and the weight's and bias's
        addresses (the graph reads them there)."""
        return (tuple(a.shape), a.dtype, a.device, tuple(b.shape), tuple(b.stride()), b.dtype, b.data_ptr(),
                None if bias is None else (tuple(bias.shape), bias.dtype, bias.data_ptr()))

    def _replay_hit(self, a, b, bias) -> torch.Tensor | None:
        """A repeat of a call already captured (``replay``), run at once, before the argument checks,
        which the call passed when it was captured; None otherwise (no graph, an ``out``, capture)."""
        if not self._graphs or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
                or (bias is not None and not isinstance(bias, torch.Tensor)) or _launch.capturing(a):
            return None
        entry = self._graphs.get(self._replay_key(a, b, bias))
        if entry is None or self._graphs_workspace != _workspace_token(self._replay_op):
            return None
        return self._replay_graph(entry, a).clone()

    def _replay_graph(self, entry: tuple, a: torch.Tensor) -> torch.Tensor:
        graph, static_a, static_out = entry
        static_a.copy_(a)
        graph.replay()
        _launch.record_path(self.op_name, "replay")
        return static_out if static_out is not None else graph.out

    def _replayed(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
                  gflop: float) -> torch.Tensor | None:
        """This call's output from a graph of the chunked path (``replay``), or None where it does not
        apply. The graphs belong to an inner graphable op with its own workspace. Collective like any
        call: every rank replays (or, for a shape's first call, runs eagerly) exactly once per call;
        a rank that meets a new weight address captures first, which runs nothing on the GPU."""
        if (not self.replay or self.policy not in ("auto", "fused") or gflop >= REPLAY_BELOW_GFLOP
                or _launch.capturing(a)):
            return None
        if self._replay_op is None:
            self._replay_op = type(self)(self.group, policy="fused", transport="chunked", config=self.config,
                                         max_spin=self.max_spin, graphable=True)
        inner = self._replay_op
        key = self._replay_key(a, b, bias)
        if self._graphs and self._graphs_workspace != _workspace_token(inner):
            # A larger shape's first call replaced or grew the inner op's buffers (every rank at the same
            # call): the graphs still point at the old ones.
            self._graphs.clear()
        entry = self._graphs.get(key)
        if entry is None:
            shape = key[:6] + (bias is not None,)
            if shape not in self._replay_warm or len(self._graphs) >= REPLAY_GRAPHS:
                # Eagerly: a shape's first call (it agrees on the shape with the other ranks, sizes the
                # workspace and warms cuBLAS, none of which a graph can hold), and any call once the
                # cache is full.
                self._replay_warm.add(shape)
                result = inner(a, b, bias=bias)  # records its own path
                return result if out is None else out.copy_(result)
            static_a = a.clone()
            if a.is_cuda:
                graph = torch.cuda.CUDAGraph()
                # Only this thread's calls are checked during the capture: a user's other threads (a data
                # loader pinning memory, say) may go on.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    static_out = inner(static_a, b, bias=bias)
            else:
                graph, static_out = _HostGraph(lambda: inner(static_a, b, bias=bias)), None
            entry = self._graphs[key] = (graph, static_a, static_out)
            self._graphs_workspace = _workspace_token(inner)
        result = self._replay_graph(entry, a)
        return result.clone() if out is None else out.copy_(result)

    def _unfused_route(self, a, b, bias, out) -> tuple[tuple | None, Backend | None]:
        """``(signature, backend)`` for a call whose signature (shapes, dtypes, devices) an earlier call
        decided for the unfused path, which a repeat takes at once; ``(signature, None)`` if not decided
        yet; ``(None, None)`` for calls that always take the checked path (a bias, an ``out``, or
        arguments that are not tensors)."""
        if bias is not None or out is not None or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return None, None
        signature = (a.shape, b.shape, a.dtype, b.dtype, a.device, b.device)
        return signature, self._unfused.get(signature)

    def _finish(self, backend: Backend, ws: Workspace) -> None:
        """After a fused launch: surface an expired in-kernel wait. In debug mode (and on the CPU) by
        synchronising now; otherwise without a sync, from a copy of the error word that the next call
        reads once the GPU has written it, so a lost peer is reported one call late but never silently
        (the outputs of a call whose wait expired are wrong). Under CUDA-graph capture (graphable ops)
        neither: the host cannot wait inside a capture, and a captured copy would be read without an
        event to say it landed; the kernel's waits stay bounded and record their error word on the GPU."""
        if _launch.capturing(ws.err):
            return
        if backend.interpreter or _launch.debug_mode():
            backend.synchronize()
            _launch.raise_on_timeout(ws.err, self.op_name, backend.rank)
            return
        if self._err_mirror is None:
            self._err_mirror = backend.host_mirror()
        self._err_mirror.refresh(ws.err)

    def _oneshot_start(self, backend: Backend, rows: int, cols: int, dtype: torch.dtype) -> tuple:
        """``(workspace, this call's slot, launch plan, epoch)`` of a one-shot call whose slots are
        ``[rows, cols]``: the subclass's ``_oneshot_plan`` makes and keeps the plan the first time (the
        slots, then the launch plan); an earlier call's expired wait is reported first."""
        ws = self._ws
        plan = ws.plans.get(("oneshot", rows, cols, dtype)) if ws is not None else None
        if plan is None:
            plan = self._oneshot_plan(backend, rows, cols, dtype)
            ws = self._ws
        self._oneshot_check(ws, backend.rank)
        ws.oneshot_epoch += 1
        slots, launch_plan = plan
        return ws, slots[ws.oneshot_epoch & 1], launch_plan, ws.oneshot_epoch

    def _oneshot_launch_plan(self, backend: Backend, ws: Workspace, dtype: torch.dtype,
                             **shape) -> _launch.OneshotPlan:
        """The launch plan of a one-shot kernel on ``ws``'s one-shot buffer (which must hold the call's
        slots); ``shape``: ``OneshotPlan``'s rows, cols, row0, parts."""
        if self._host_err is None:
            self._host_err = HostWord(backend.device)
        return _launch.OneshotPlan(peer_offsets=ws.oneshot_offsets(dtype.itemsize), signals=ws.oneshot_signals(),
                                   ready=ws.oneshot_flags(), err=ws.err, host_err=self._host_err.tensor,
                                   rank=backend.rank, world=backend.world_size,
                                   max_spin=self.max_spin or backend.default_max_spin, programs=backend.num_sms,
                                   meet=self._meeting(backend), **shape)

    def _oneshot_check(self, ws: Workspace, rank: int) -> None:
        """Raise if an earlier one-shot kernel's wait expired: its word in pinned host memory is set (no
        driver call, unlike ``_check_previous``'s mirror)."""
        code = self._host_err.read()
        if code:
            self._host_err.clear()
            ws.err.zero_()  # the device word too, which the fused paths' check would report again
            _launch.raise_on_timeout(torch.tensor([code], dtype=torch.int32), self.op_name, rank)

    def _oneshot_finish(self, backend: Backend, ws: Workspace) -> None:
        """After a one-shot launch: in debug mode (and on the CPU) wait for it, bounded as its waits
        are, and raise at once if one expired; otherwise the next call reports it."""
        if backend.interpreter or _launch.debug_mode():
            backend.synchronize()
            self._oneshot_check(ws, backend.rank)
        _launch.record_path(self.op_name, "oneshot")

    @staticmethod
    def _programs(config: GemmConfig, backend: Backend, reducing: bool) -> int:
        """Persistent programs of a fused launch: the config's count, or one per SM, within what every
        program resident at once allows (``Backend.max_programs``)."""
        return min(config.programs or backend.num_sms, backend.max_programs(reducing))

    def _stream_k_tail(self, config: GemmConfig, m: int, n: int, k: int, backend: Backend) -> bool:
        """Whether the fused kernel shares its partial last wave of tiles by K steps (a subclass's
        choice; none by default)."""
        return False

    @staticmethod
    def _finish_without_kernel(backend: Backend) -> None:
        """After a call that launched no fused kernel (the chunked transports): there is no error word
        to read, and its stream waits are bounded on the host, in debug mode (and on the CPU); not under
        CUDA-graph capture, where the host cannot wait."""
        if backend.interpreter or (_launch.debug_mode() and not torch.cuda.is_current_stream_capturing()):
            backend.synchronize()

    def _check_previous(self, capturing: bool = False) -> None:
        # Not while capturing: an event query there could invalidate the capture.
        code = self._err_mirror.read() if self._err_mirror is not None and not capturing else 0
        if code:
            self._err_mirror.clear()
            self._ws.err.zero_()
            _launch.raise_on_timeout(torch.tensor([code], dtype=torch.int32), self.op_name,
                                     self._backend.rank if self._backend else -1)

    def _get_backend(self, device: torch.device) -> Backend:
        if self._backend is None or self._backend.device != device:
            self._backend = get_backend(self.group, device)
        return self._backend

    def _decide(self, backend: Backend, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                prefer_fused: Callable[..., bool], shape: tuple, has_bias: bool, capturing: bool = False,
                **config_overrides) -> tuple[str, GemmConfig, bool]:
        """The path (the policy's, or under "auto" "fused" where ``prefer_fused`` says so, else
        "fallback"), with which config, and whether this is the first call of its signature: rank 0's
        choice, checked against every rank's shapes.

        ``m, n, k`` are the local GEMM's; ``shape`` is what must match across ranks. Under CUDA-graph
        capture only the unfused path runs (NCCL and cuBLAS capture; the fused paths' host-side epochs
        would not advance on replay) unless the op is graphable (constant-valued flags), and only for a
        signature already agreed on by an eager call (the
        agreement is a collective of Python objects, which a graph cannot hold). A repeat of a
        decided call is one dictionary lookup.
        """
        memo = (m, n, k, dtype, device, shape, has_bias, self.policy, self.config,
                tuple(sorted(config_overrides.items())))
        decided = self._decisions.get(memo)
        if decided is not None:
            if capturing and decided[0] == "fused" and not self.graphable:
                raise TileweaveError(f"{self.op_name}: {_launch.CAPTURE_FUSED}")
            return decided[0], decided[1], False
        proposal = self.config or select_config(m, n, k, dtype, device, num_sms=backend.num_sms,
                                                interpreter=backend.interpreter, stream_k=False)
        # The fused kernels deal out whole tiles (a tile's flags and counts assume one producer), but for
        # a consumer's partial last wave (``_stream_k_tail``).
        proposal = dataclasses.replace(proposal, stream_k=False, block_n2=0, **config_overrides)
        proposal = dataclasses.replace(proposal, stream_k=self._stream_k_tail(proposal, m, n, k, backend))
        path = self.policy
        if path == "auto":
            prefer = prefer_fused(m, n, k, backend.world_size, dtype, interpreter=backend.interpreter)
            path = "fused" if prefer else "fallback"
        signature = (self.op_name, *shape, str(dtype), has_bias, path)
        first = signature not in self._agreed
        if capturing and path == "fused" and not self.graphable:
            raise TileweaveError(f"{self.op_name}: {_launch.CAPTURE_FUSED}")
        if capturing and first:
            raise TileweaveError(f"{self.op_name}: the first call of each shape checks it with the other "
                                 "ranks (a collective that a CUDA graph cannot hold): call it once with "
                                 "these shapes before capturing")
        config = agree(backend, self._agreed, self.op_name, signature, proposal)
        if not (m > 0 and n > 0 and k > 0):
            path = "fallback"
        self._decisions[memo] = (path, config)
        return path, config, first

    @staticmethod
    def _launch_kernel(backend: Backend, first: bool, **launch_args) -> None:
        """Launch the fused kernel. On the first call of a signature every rank compiles it first and
        then meets the others: a kernel spinning on a peer that is still compiling would spend its
        bounded wait on the compiler (seconds for a cold cache) and could report a lost peer."""
        if first and not backend.interpreter:
            try:
                _launch.launch(**launch_args, compile_only=True)
            except Exception:  # noqa: BLE001 - the launch below compiles again and raises the error itself
                pass
            FusedOp._meeting(backend)()
        _launch.launch_cached(**launch_args)

    @staticmethod
    def _meeting(backend: Backend) -> Callable[[], None]:
        """The barrier that follows a first launch's compile (``_launch_kernel``, ``OneshotPlan.meet``)."""
        device_ids = [backend.device.index] if backend.device.type == "cuda" else None
        return lambda: dist.barrier(group=backend.group, device_ids=device_ids)
