"""The skeleton every fused op follows: check -> agree -> plan -> run.

- **check**: the op's argument checks (names, shapes, dtypes, devices), each error naming the argument.
- **agree**: what can differ between ranks (shapes, dtypes, optional arguments, the checks' outcome) is
  exchanged and judged (``workspace.agree``), so that a bad input on one rank raises the same error on
  every rank, within a bounded wait.
- **plan**: the path of the call's signature: the policy's, or under ``"auto"`` the op's rule (in the
  op's folder), rank 0's choice taken by every rank.
- **run**: the path's transport, a function in the op's folder that receives what it needs explicitly
  (a ``Call``: backend, plan, memory, error words, settings) and never the op, so nothing calls back up.

This module is the one home of what the five ops (``AllGatherGemm``, ``GemmReduceScatter``,
``MoEAllGatherGemm``, ``MoEGemmReduceScatter``, ``GemmAllReduce``) share: their base class ``TPOp``
(group and backend, the policy and ``max_spin`` checks, the op shared per group and device, settings
from ``tileweave.runtime.settings``, the agreement run by the op itself (``TPOp._agreed``), the rule that
a signature's first call is eager), the error words (``ErrorWords``), the compile-then-meet of a kernel's
first launch (``first_launch``) and the mark of a signature's first call, whose compiles no peer's bounded
wait counts (``first_call``).

Policies, the same words for every op (an op lists the ones it has in ``policies``): ``"auto"`` (the
op's rule per shape), ``"fused"`` (an overlapped path, its transport by the op's rule), ``"oneshot"``
(``"twoshot"``: GEMM+AllReduce's two-phase kernel) and ``"fallback"`` (NCCL and cuBLAS, unfused).

Paths, what ``tileweave.last_path(op)`` reports, the same words for every op (``PATHS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.runtime import agreement, settings
from tileweave.ops import common
from tileweave.ops.workspace import agree
from tileweave.runtime.backend import Backend, HostWord, TileweaveError, get_backend

PATHS = {
    "local": "a group of one: the compute alone, nothing communicated",
    "fused": "one persistent kernel of ours computes while the data travels; flags gate its tiles",
    "chunked": "the GEMM in chunks (per source, owner or row block), each chunk's data moved by the copy "
               "engines while the next chunk computes",
    "oneshot": "one kernel of ours moves the data (before the GEMM for an all-gather, after it for a reduction)",
    "twoshot": "a reduce-scatter then an all-gather of the sums, in one kernel of ours (GEMM+AllReduce)",
    "fallback": "NCCL's collective and the GEMM, one after the other",
}
"""The path names every op records, and what each means."""


def check_max_spin(owner: str, max_spin) -> None:
    """``max_spin``: None (the backend's default) or an int in [1, 2**31)."""
    if max_spin is not None and (isinstance(max_spin, bool) or not isinstance(max_spin, int)
                                 or not 0 < max_spin < 1 << 31):
        raise ValueError(f"{owner}: max_spin is the polls a flag wait may take before it reports a lost peer: "
                         f"None (the backend's default) or an int in [1, 2**31), got {max_spin!r}")


class ErrorWords:
    """Where an op's kernels record what went wrong (an expired wait for a peer, routing ids out of
    range) and how the host learns it without a sync per call.

    A device word is watched after each launch (``watch``): on the CPU and in debug mode the call
    synchronises and raises at once; on GPUs a host copy is refreshed, which the next call reads
    (``raise_pending``) once the GPU has written it. A word in pinned host memory (``host``), which a
    kernel writes directly, is read by the next call with no driver call at all."""

    def __init__(self, op_name: str) -> None:
        self.op_name = op_name
        self._mirrors: dict[str, tuple[torch.Tensor, object]] = {}
        self._hosts: list[tuple[Callable[[], HostWord | None], Callable[[], torch.Tensor | None]]] = []

    def host(self, word: Callable[[], HostWord | None], device_word: Callable[[], torch.Tensor | None]) -> None:
        """Also read the pinned word that ``word()`` returns (None: none made yet), which kernels write
        together with the device word that ``device_word()`` returns (cleared with it), before each
        call."""
        self._hosts.append((word, device_word))

    def watch(self, name: str, word: torch.Tensor, backend: Backend) -> None:
        """After work that may set ``word`` (the op's word called ``name``): raise now on the CPU and in
        debug mode, else refresh the host copy that the next call reads. Nothing under CUDA-graph
        capture (the host cannot wait there, and a captured copy would be read without an event to say
        it landed)."""
        if common.capturing(word):
            return
        entry = self._mirrors.get(name)
        mirror = entry[1] if entry is not None and entry[0] is word else None
        self._mirrors[name] = (word, common.surface_timeout(word, self.op_name, backend, mirror))

    def raise_pending(self, backend: Backend | None, capturing: bool = False) -> None:
        """Raise what an earlier call's work recorded (clearing it); nothing while a CUDA graph is being
        captured, where an event query could break the capture."""
        rank = backend.rank if backend is not None else -1
        for get_word, device_word in self._hosts:
            word = get_word()
            code = word.read() if word is not None else 0
            if code:
                word.clear()
                current = device_word()
                if current is not None:
                    current.zero_()  # which a watched copy of it would report again
                common.raise_code(code, self.op_name, rank)
        if capturing:
            return
        for word, mirror in self._mirrors.values():
            code = mirror.read() if mirror is not None else 0
            if code:
                mirror.clear()
                word.zero_()
                common.raise_code(code, self.op_name, rank)


def meeting(backend: Backend) -> Callable[[], None]:
    """The barrier that follows a first launch's compile (``first_launch``, ``OneshotPlan.meet``)."""
    device_ids = [backend.device.index] if backend.device.type == "cuda" else None
    return lambda: dist.barrier(group=backend.group, device_ids=device_ids)


def first_launch(backend: Backend, compile_kernel: Callable[[], object]) -> None:
    """Before a kernel's first launch on GPUs: compile it, then meet the other ranks. A kernel spinning
    on a peer that is still compiling would spend its bounded wait on the compiler (seconds for a cold
    cache) and could report a lost peer. A failed compile still meets (the peers wait there); the
    launch that follows compiles again and raises the error itself. Nothing in the interpreter."""
    if backend.interpreter:
        return
    try:
        compile_kernel()
    except Exception:  # noqa: BLE001 - reported by the launch that follows
        pass
    meeting(backend)()


def first_call(backend: Backend) -> contextlib.AbstractContextManager:
    """Around the rest of a signature's first call, after its agreement, where this rank launches, and so
    compiles, the call's kernels (seconds to a minute with a cold cache, each rank at its own pace):
    marked on the agreement segments (``runtime.agreement.first_call``), so that no peer's bounded wait
    for this rank (its next call's agreement, bounded by ``TILEWEAVE_TIMEOUT_S``) counts it. Nothing in
    a group of one."""
    return agreement.first_call() if backend.world_size > 1 else contextlib.nullcontext()


def finish_streams(backend: Backend) -> None:
    """After a call whose waits are stream waits, with no kernel of ours (the chunked transports): the
    waits are bounded on the host, on the CPU and in debug mode; not under CUDA-graph capture, where the
    host cannot wait."""
    if backend.interpreter or (common.debug_mode() and not torch.cuda.is_current_stream_capturing()):
        backend.synchronize()


class TPOp:
    """Base of the five fused ops: one group, its backend, the policy and ``max_spin`` settings, the op
    shared per (group, device), the error words (module docstring).

    ``policy``: one of the class's ``policies``; ``"auto"`` is replaced by ``TILEWEAVE_POLICY`` when
    that is set. ``max_spin``: polls a flag wait may take before it reports a lost peer (None: the
    backend's default). ``graphable``: the op's fused paths run on flags whose values are the same in
    every call, so that calls can be captured in a CUDA graph and replayed (ops that have such paths).
    Every rank must construct its op with the same arguments."""

    op_name = ""
    policies: tuple[str, ...] = ("auto", "fused", "fallback")
    _shared: dict[tuple, "TPOp"]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._shared = {}

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto",
                 max_spin: int | None = None, graphable: bool = False) -> None:
        if not isinstance(graphable, bool):
            raise TypeError(f"{type(self).__name__}: graphable must be a bool, got {graphable!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.graphable = graphable
        self._backend: Backend | None = None
        self._called: set = set()
        """The signatures called before (``_first_call``)."""
        self.errors = ErrorWords(self.op_name)
        self.policy = settings.policy() if policy == "auto" else policy
        self.max_spin = max_spin

    @classmethod
    def shared(cls, group: dist.ProcessGroup, device: torch.device) -> "TPOp":
        """The op shared by every functional call on ``group`` and ``device`` (and so by the TP layers),
        made with ``shared_options()`` (from the environment: ``tileweave.runtime.settings``)."""
        key = (id(group), device)  # the op holds the group, so its id is not reused while cached
        op = cls._shared.get(key)
        if op is None:
            op = cls._shared[key] = cls(group, **cls.shared_options())
        return op

    @classmethod
    def shared_options(cls) -> dict:
        """The constructor's arguments of the shared op (a subclass adds its own)."""
        return {}

    def _check_policy(self, policy) -> None:
        if policy not in self.policies:
            from_env = settings.text(settings.POLICY) == policy
            raise ValueError(f"{type(self).__name__}: policy must be one of {self.policies}, got {policy!r}"
                             + (f" (from {settings.POLICY})" if from_env else ""))

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, policy: str) -> None:
        self._check_policy(policy)
        self._policy = policy
        self._settings_changed("policy")

    @property
    def max_spin(self) -> int | None:
        return self._max_spin

    @max_spin.setter
    def max_spin(self, max_spin: int | None) -> None:
        check_max_spin(type(self).__name__, max_spin)
        self._max_spin = max_spin
        self._settings_changed("max_spin")

    def _settings_changed(self, name: str) -> None:
        """A setting was set (a subclass that keeps plans per signature drops what it decides)."""

    def backend_for(self, device: torch.device) -> Backend:
        """The group's backend on ``device``."""
        if self._backend is None or self._backend.device != device:
            self._backend = get_backend(self.group, device)
        return self._backend

    def spin_bound(self, backend: Backend) -> int:
        """Polls a flag wait of this op may take: ``max_spin`` or the backend's default."""
        return self.max_spin or backend.default_max_spin

    def _agreed(self, backend: Backend, signature: object, propose: Callable[[], object], *,
                hint: str = "") -> object:
        """Rank 0's ``propose()``, every rank together (``workspace.agree``): this rank's ``propose()``
        (its checks, then its proposal) runs here, in the op; what it raises (``TypeError``,
        ``ValueError``, ``TileweaveError``) is exchanged with the other ranks' outcomes and ``signature``
        (what the ranks must share) and raised on every rank. A group of one runs ``propose()`` alone."""
        if backend.world_size == 1:
            return propose()
        try:
            proposal, failure = propose(), None
        except (TypeError, ValueError, TileweaveError) as exc:
            proposal, failure = None, exc
        return agree(backend, self.op_name, signature, proposal, failure=failure, hint=hint)

    def _first_call(self, backend: Backend, signature: object) -> contextlib.AbstractContextManager:
        """Around the rest of a call after its agreement: ``first_call`` at the first call of
        ``signature``, nothing at later ones."""
        if signature in self._called:
            return contextlib.nullcontext()
        self._called.add(signature)
        return first_call(backend)

    def require_eager(self, what: str) -> None:
        """Raise the error of a signature's first call under CUDA-graph capture: ``what`` that call does
        with the other ranks, which a graph cannot hold."""
        raise TileweaveError(f"{self.op_name}: the first call of each signature {what} (collective work that a "
                             "CUDA graph cannot hold): call it once eagerly with these shapes before capturing")


def option(name: str, check: Callable[[TPOp, object], None] | None = None) -> property:
    """An op setting that decides which path a call takes: read as a plain attribute; set (on every
    rank alike, as the constructor's arguments), it is checked by ``check`` and reported to
    ``_settings_changed``, so that an op with a plan cache decides each signature again."""
    slot = "_option_" + name

    def set_option(op: TPOp, value) -> None:
        if check is not None:
            check(op, value)
        op.__dict__[slot] = value
        op._settings_changed(name)

    return property(operator.attrgetter(slot), set_option)


@dataclasses.dataclass
class Call:
    """What a transport receives for one call, explicitly: it never sees the op."""

    op_name: str
    backend: Backend
    plan: object
    """The signature's plan (the op's kind: ``dense.Plan`` for the dense pair)."""
    memory: object
    """The op's symmetric memory (``workspace.Memory``)."""
    errors: ErrorWords
    graphable: bool
    spin: int
    """Polls a flag wait may take."""
    options: dict = dataclasses.field(default_factory=dict)
    """The op's settings a transport reads (``chunk_rows``, ...)."""

    def record(self, path: str) -> None:
        """Record the path that ran (``tileweave.last_path``)."""
        common.record_path(self.op_name, path)
