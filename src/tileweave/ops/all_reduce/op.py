"""GEMM + AllReduce for decode: the row-parallel linear of TP without sequence parallelism, optionally
with the residual add and the RMSNorm that follow it in a decoder layer.

===================  ===============  ==============================================================
tensor               shape (per rank) meaning
===================  ===============  ==============================================================
``a``                ``[M, K_loc]``   activations, this rank's slice of K (K_loc may differ by rank)
``b``                ``[K_loc, N]``   this rank's rows of the weight (``weight.t()`` of an
                                      ``nn.Linear`` weight ``[N, K_loc]`` is read in place)
``bias``             ``[N]``          optional, added once (not once per rank)
``residual``         ``[M, N]``       optional, added to the sum
``norm_weight``      ``[N]``          optional (needs ``residual``): RMSNorm's scale
result               ``[M, N]``       ``sum over ranks (a_r @ b_r) (+ bias) (+ residual)``, the same
                                      on every rank; with ``norm_weight`` a pair ``(normed, resid)``:
                                      ``resid = residual + sum (+ bias)``,
                                      ``normed = resid * rsqrt(mean(resid**2, -1) + eps) * norm_weight``
===================  ===============  ==============================================================

All tensors share one dtype (float16, bfloat16 or float32) and one device. FP8: with float8 ``a`` and
``b`` (e4m3fn or e5m2) and float32 ``scale_a``, ``scale_b`` of this rank's slice (torch's ``_scaled_mm``
shapes: tensorwise, rowwise ``[M, 1]`` / ``[1, N]``, blockwise ``[M, K_loc/128]`` / ``[K_loc/128,
N/128]``; ``tileweave.ops.compute.scaling``), each rank's partial is ``(a_r * scale_a_r) @ (b_r *
scale_b_r)`` in ``out_dtype`` (bfloat16 by default), and the bias, residual, norm weight and output
have that dtype. The fused transports sum the
partials (rounded to the dtype) in fp32; the unfused path on GPUs sums them in NCCL in the dtype, as
Megatron-style layers do. The bias, the residual add and the norm are fp32; the results are rounded to
the dtype. Every rank gets the bitwise same result, and the same on every run (the fused transports
sum in rank order; NCCL's order is fixed by the group). In Triton's interpreter (CPU) bfloat16 takes
the unfused path in fp32, since the interpreter's bfloat16 arithmetic is wrong.

Paths (``last_path("gemm_all_reduce")``): ``"oneshot"`` and ``"twoshot"`` (``transports``), ``"fallback"``
(the GEMM, NCCL's all-reduce, torch's epilogue: ``nccl``), ``"local"`` (a group of one: the GEMM and one
epilogue kernel, ``local``). ``policy="auto"``
picks per shape by ``rule.choose_path``, ``"fused"`` the faster of the two fused transports by the same
estimates, decided at the first call of a signature; rank 0's pick is taken by every rank.

Every call first exchanges with the other ranks (on the host, through shared memory, bounded by
``TILEWEAVE_TIMEOUT_S``) the shapes, dtypes and optional arguments and the outcome of each rank's checks,
then judges them: a bad argument on one rank raises the same error on every rank, ranks that pass
different M, N, dtype or optional arguments raise ``TileweaveError`` on every rank, and a rank that does
not come is named in a ``CollectiveTimeout``.

Synchronisation: a fused call waits on the GPU for its peers' partials of the same call (and, on the
graphable protocol, for the peers to have finished reading this rank's previous partial); the host never
waits. An expired wait (a lost peer) raises ``CollectiveTimeout`` on the next call (at once on the CPU and
with ``TILEWEAVE_DEBUG=1``). All ranks must call the op the same number of times, in the same order, with
the same M, N, dtype and optional arguments; no two calls of one op may run concurrently (one stream).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.ops import common
from tileweave.ops.all_reduce import local, nccl, rule
from tileweave.ops.all_reduce.transports import FusedTransport
from tileweave.ops.compute import scaling
from tileweave.ops.skeleton import TPOp
from tileweave.runtime.backend import Backend, TileweaveError

OP = "gemm_all_reduce"
POLICIES = ("auto", "fused", "oneshot", "twoshot", "fallback")


class GemmAllReduce(TPOp):
    """A reusable GEMM + AllReduce bound to one group; keeps its symmetric buffers (module docstring).

    ``policy``: ``"auto"`` (per shape, ``rule.choose_path``), ``"fused"`` (the faster fused transport per
    shape), or one path for every call: ``"oneshot"``, ``"twoshot"``, ``"fallback"``. ``graphable``: run
    the fused transports on flags whose values are the same in every call (reset by their readers), so
    that calls can be captured in a CUDA graph and replayed with new inputs; the first call of a signature must be eager (it agrees on the signature with
    the other ranks and sizes the buffers). A non-graphable op runs the unfused path under capture.
    ``max_spin``: polls a flag wait may take before it reports a lost peer (None: the backend's default).
    Every rank must construct the op with the same settings; they are fixed once the op has been called
    (each signature's path is decided at its first call and kept)."""

    op_name = OP
    policies = POLICIES

    @classmethod
    def shared_options(cls) -> dict:
        """``TILEWEAVE_GRAPHABLE=1`` makes the shared op graphable (``tileweave.runtime.settings``)."""
        return {"graphable": settings.flag(settings.GRAPHABLE)}

    def __init__(self, group: dist.ProcessGroup | None = None, *, policy: str = "auto", graphable: bool = False,
                 max_spin: int | None = None) -> None:
        self._fused: FusedTransport | None = None
        self._plans: dict[tuple, str] = {}
        """Per call signature: the path, decided once and agreed by every rank (the op's one cache)."""
        super().__init__(group, policy=policy, max_spin=max_spin, graphable=graphable)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, out: torch.Tensor | None = None, *, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        if not isinstance(a, torch.Tensor):  # its device says which backend to agree on
            raise TypeError(f"a must be a torch.Tensor [M, K_loc], got {type(a).__name__}")
        backend = self.backend_for(a.device)
        scales = (scale_a, scale_b) if scaling.is_fp8(a) or scale_a is not None or scale_b is not None else None
        path, key = self._plan(backend, a, b, bias, residual, norm_weight, eps, out, scales, out_dtype)
        dtype = scaling.out_dtype_of(OP, a, out_dtype)
        bias = common.check_bias(bias, b.shape[1], dtype, a.device)
        return self._run(backend, path, key, a, b, bias, residual, norm_weight, eps, out, scales, dtype)

    def all_reduce(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6, out: torch.Tensor | None = None):
        """The sum over ranks of each rank's partial ``x [M, N]`` (a result that is not one GEMM, such as
        an expert layer's), with ``__call__``'s epilogue: ``(+ residual)``, and with ``norm_weight`` the
        pair ``(normed, resid)``. The same paths, protocol and guarantees as ``__call__`` (module
        docstring): the fused transports copy ``x`` into this rank's slot where ``__call__`` runs its GEMM,
        then sum the slots in rank order in fp32; ``x``, ``residual``, ``norm_weight`` and the result share
        one dtype (float16, bfloat16, float32). Graphable like ``__call__`` on a graphable op."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [M, N], got {type(x).__name__}")
        backend = self.backend_for(x.device)
        path, key = self._plan(backend, x, None, None, residual, norm_weight, eps, out, None, None)
        return self._run(backend, path, key, x, None, None, residual, norm_weight, eps, out, None, x.dtype)

    def _run(self, backend: Backend, path: str, key: tuple, a, b, bias, residual, norm_weight, eps, out, scales,
             dtype):
        """The call on ``path``; ``b`` None: ``a`` is this rank's partial (``all_reduce``). The first call
        of its signature ``key`` runs in ``skeleton.first_call``, where its kernels compile."""
        m, n = a.shape[0], a.shape[1] if b is None else b.shape[1]
        capturing = common.capturing(a)
        if capturing and path in ("oneshot", "twoshot") and not self.graphable:
            if self.policy == "fused":
                raise common.capture_refused(OP, graphable_ops=True)
            path = "fallback"  # NCCL captures; the epochs of the fused transports would not advance on replay
        y = out if out is not None else torch.empty((m, n), dtype=dtype, device=a.device)
        resid = torch.empty((m, n), dtype=dtype, device=a.device) if norm_weight is not None else None
        with self._first_call(backend, key):
            if path in ("oneshot", "twoshot"):
                self._fused_transport(backend).run(path, a, b, bias, residual, norm_weight, float(eps), y, resid,
                                                   scales)
            elif path == "local":
                local.run(backend, a, b, bias, residual, norm_weight, float(eps), y, resid, scales)
            else:
                nccl.run(backend, a, b, bias, residual, norm_weight, float(eps), y, resid, scales)
        common.record_path(OP, path)
        return y if norm_weight is None else (y, resid)

    def backend_for(self, device: torch.device) -> Backend:
        backend = self._backend
        if backend is None or backend.device != device:
            self._fused = None  # its buffers belong to the old device's backend
        return super().backend_for(device)

    def _fused_transport(self, backend: Backend) -> FusedTransport:
        if self._fused is None:
            self._fused = FusedTransport(backend, self.errors, graphable=self.graphable,
                                         max_spin=self.spin_bound(backend))
        return self._fused

    def _plan(self, backend: Backend, a, b, bias, residual, norm_weight, eps, out, scales,
              out_dtype) -> tuple[str, tuple]:
        """``(path, signature)`` of this call, every rank together: this rank checks its arguments and
        proposes a path (its signature's, decided at its first call: the policy's, or the rule's under
        "auto"), then every rank's signature, check outcome and proposal are exchanged and judged
        (``TPOp._agreed``), so that a bad argument on one rank raises the same error on every rank; rank
        0's path is taken."""
        summed = b is None  # all_reduce: ``a`` is the partial itself
        m = a.shape[0] if a.dim() >= 1 else 0  # the key of a bad call is never stored: the checks raise
        if summed:
            n = a.shape[1] if a.dim() == 2 else 0
        else:
            n = b.shape[1] if isinstance(b, torch.Tensor) and b.dim() == 2 else 0
        # The path depends on (M, N, dtype) and the epilogue alone, so both forms share their plans.
        key = (m, n, a.dtype, a.device, bias is not None, residual is not None, norm_weight is not None, out_dtype)

        def propose() -> str:
            common.check_no_grad(OP, a, b, bias, residual, norm_weight,
                                 names=("x" if summed else "a", "b", "bias", "residual", "norm_weight"))
            if summed:
                dtype = _check_sum(a, residual, norm_weight, eps, out)
            else:
                dtype = _check(a, b, bias, residual, norm_weight, eps, out, scales, out_dtype)
            return self._plans.get(key) or self._propose(backend, a, m, n, norm_weight is not None, dtype)

        if key not in self._plans and common.capturing(a):
            self.require_eager("sizes the buffers with the other ranks")
        w = backend.world_size
        signature = None
        if w > 1:
            # K_loc may differ by rank: a's rows and b's columns are what every rank shares.
            describe = common.signature_of
            signature = {"form": "all_reduce" if summed else "gemm",
                         "a": describe(a, dims=(0, 1) if summed else (0,)), "b": describe(b, dims=(-1,)),
                         "bias": describe(bias),
                         "residual": describe(residual), "norm_weight": describe(norm_weight),
                         "policy": repr(self.policy), "graphable": repr(self.graphable),
                         "out_dtype": repr(out_dtype), "scales": "given" if scales is not None else "none"}
        path = self._agreed(backend, signature, propose)
        if w > 1 and (m == 0 or n == 0):
            path = "fallback"
        if key not in self._plans and path in ("oneshot", "twoshot"):
            dtype = scaling.out_dtype_of(OP, a, out_dtype)
            self._fused_transport(backend).prepare(path, m, n, dtype, norm_weight is not None)
        self._plans[key] = path
        return path, key

    def _propose(self, backend: Backend, a, m: int, n: int, norm: bool, dtype: torch.dtype) -> str:
        """This rank's path for a new signature (partials in ``dtype``): the policy's, or under "auto" the
        rule's."""
        w = backend.world_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        slot_bytes = m * n * itemsize * (2 if norm else 1)
        if w == 1:
            proposal = "local"
        elif not backend.peer_access:
            proposal = "fallback"
        elif self.policy == "fused":
            proposal = rule.fused_path(m, n, w, itemsize, programs=backend.num_sms)
        elif self.policy != "auto":
            proposal = self.policy
        else:
            proposal = rule.choose_path(m, n, w, itemsize, programs=backend.num_sms, slot_bytes=slot_bytes)
        interpreted_bf16 = backend.interpreter and dtype == torch.bfloat16
        if interpreted_bf16 and proposal in ("oneshot", "twoshot"):
            if self.policy != "auto":
                raise TileweaveError(f"{OP}: policy={self.policy!r} runs Triton kernels, which compute bfloat16 "
                                     "wrongly in the interpreter (CPU): use float16 or float32 there, or "
                                     "policy='auto' (the unfused path in fp32)")
            proposal = "fallback"
        return proposal


def _check(a, b, bias, residual, norm_weight, eps, out, scales, out_dtype) -> torch.dtype:
    """Every argument against the module docstring's table, before anything runs: errors name the
    argument, what was expected and what came. Returns the dtype of the partials and the result."""
    if scaling.is_fp8(a) or scaling.is_fp8(b):
        for name, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    else:
        common.check_matrix("a", a)
        common.check_matrix("b", b, dtype=a.dtype, device=a.device)
    scale_a, scale_b = scales if scales is not None else (None, None)
    if scaling.check_operands(OP, a, b, scale_a, scale_b):
        if b.shape[0] == a.shape[1]:  # else the shape check below names it
            scaling.dense_scales(OP, a.shape[0], b.shape[1], a.shape[1], scale_a, scale_b)
    dtype = scaling.out_dtype_of(OP, a, out_dtype)
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"a is [M={m}, K_loc={k}] but b is {list(b.shape)}: b must be [K_loc={k}, N] "
                         f"(for an nn.Linear weight [N, K_loc], pass weight.t())")
    n = b.shape[1]
    if a.device.type not in ("cuda", "cpu"):
        raise ValueError(f"a is on {a.device}; gemm_all_reduce runs on CUDA GPUs (or on the CPU with emulated "
                         "ranks for testing)")
    if a.stride(1) != 1 and a.stride(0) != 1:
        raise ValueError(f"a must have unit stride along one dimension, got strides {a.stride()}")
    if b.stride(1) != 1 and b.stride(0) != 1:
        raise ValueError(f"b must have unit stride along one dimension, got strides {b.stride()}")
    _check_epilogue(a, n, dtype, bias, residual, norm_weight, eps, out)
    return dtype


def _check_epilogue(a, n: int, dtype: torch.dtype, bias, residual, norm_weight, eps, out) -> None:
    m = a.shape[0]
    common.check_bias(bias, n, dtype, a.device)
    if residual is not None:
        _check_like("residual", residual, (m, n), dtype, a.device)
    if norm_weight is not None:
        if residual is None:
            raise ValueError("norm_weight needs residual: the fused RMSNorm normalises residual + sum "
                             "(pass residual=, or leave norm_weight out and normalise the sum yourself)")
        _check_like("norm_weight", norm_weight, (n,), dtype, a.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if out is not None:
        common.check_out(out, (m, n), dtype, a.device)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def _check_sum(x, residual, norm_weight, eps, out) -> torch.dtype:
    """``all_reduce``'s arguments (``_check``'s rules for the epilogue); returns the dtype."""
    common.check_matrix("x", x)
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"x is on {x.device}; gemm_all_reduce runs on CUDA GPUs (or on the CPU with emulated "
                         "ranks for testing)")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    _check_epilogue(x, x.shape[1], x.dtype, None, residual, norm_weight, eps, out)
    return x.dtype


def _check_like(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the result is {dtype}; cast them to one dtype")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but a is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def shared_op(group: dist.ProcessGroup, device: torch.device) -> GemmAllReduce:
    """The op shared by every functional call on ``group`` and ``device`` (and so by the TP layers):
    ``GemmAllReduce.shared``."""
    return GemmAllReduce.shared(group, device)
