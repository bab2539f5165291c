"""GEMM + ReduceScatter, fused: the row-parallel forward of sequence-parallel TP.

==================  ==========================  ==========================================
tensor              shape (per rank)            meaning
==================  ==========================  ==========================================
``a``               ``[M, K_loc]``              activations, this rank's slice of K
``b``               ``[K_loc, N]``              this rank's rows of the weight
                                                (``weight.t()`` of an ``[N, K_loc]`` weight is
                                                read in place)
``bias``            ``[N]``                     optional, added once (not once per rank)
result              ``[M / W, N]``              rows ``[r*M/W, (r+1)*M/W)`` of
                                                ``sum over ranks (a @ b)`` + bias
==================  ==========================  ==========================================

Paths. ``policy="auto"`` takes the chunked transport where it was measured faster than GEMM + NCCL
reduce-scatter, the unfused path elsewhere (``rule.auto_route``). The chunked transport runs cuBLAS per
owner and row block and moves each finished block with the copy engines, overlapping it with the next
block's GEMM: pushed into the owner's receive slots (``chunked``) or, at two ranks, pulled by the owner
straight into its output (``pull``). ``policy="oneshot"``: one GEMM into a symmetric buffer, then one
kernel that sums this rank's rows of every rank's partial (for the small rows, where the host's time to
issue a call bounds the other paths). Every sum over ranks runs in rank order: bitwise deterministic.

FP8: with float8 ``a`` and ``b`` (e4m3fn or e5m2) and float32 ``scale_a``, ``scale_b`` of this rank's
operands (``matmul``'s shapes: one element each; rowwise ``[M, 1]`` and ``[1, N]``; blockwise ``[M,
K_loc/128]``, this rank's K blocks, and ``[K_loc/128, ceil(N/128)]``), each rank's partial is ``(a *
scale_a) @ (b * scale_b)``, accumulated in fp32; the result, the bias and ``out`` are ``out_dtype``
(bfloat16 by default, float16, float32). Every path takes them, its GEMMs on tileweave's ``matmul``:
the partials travel in ``out_dtype`` and are summed in fp32 in rank order; the chunked transports
(pushing and pulling) keep the own rows' partial in fp32 and round once after adding the arrived ones,
the one-shot path sums every partial as rounded to ``out_dtype``, the unfused path sums in NCCL in
``out_dtype`` (as for bfloat16 inputs). Every rank must pass scales of the same shapes.

Capture in a CUDA graph (``graphable=True``): the pushing chunked transport with constant-valued flags
(``chunked``'s docstring).

Concurrency: all ranks must call the op the same number of times in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.ops import common
from tileweave.ops.dense import DenseOp, Plan
from tileweave.ops.reduce_scatter import chunked, nccl, oneshot, pull, rule
from tileweave.ops.skeleton import option
from tileweave.runtime.backend import Backend, TileweaveError

OP = "gemm_reduce_scatter"
TRANSPORTS = ("chunked",)


class GemmReduceScatter(DenseOp):
    """A reusable fused GEMM+ReduceScatter bound to one group; keeps its receive buffer.

    ``policy``: ``"auto"`` picks the chunked transport or the unfused path (GEMM, then NCCL
    reduce-scatter) per shape; ``"fused"`` and ``"fallback"`` force one; ``"oneshot"`` takes the one-shot
    path on every call (NCCL under CUDA-graph capture, where its epochs would not advance).
    ``transport``: ``"chunked"`` (module docstring; memory ``2 (W-1)/W x [M, N]``: the receive slots
    and a send buffer). ``pull`` (every rank alike; ``TILEWEAVE_RS_PULL`` for the shared op): whether
    the chunked transport in a group of two pulls instead of pushing; None (the default): wherever it
    applies, which is not in a graphable op (its flags carry epochs; True there raises); other group
    sizes, and an ``out`` with padded rows, push. Other arguments: :class:`tileweave.ops.dense.DenseOp`.
    """

    op_name = OP
    transports = TRANSPORTS
    transport_env = settings.RS_TRANSPORT
    default_transport = "chunked"
    option_envs = {"pull": settings.RS_PULL}
    chunk_rows = 0
    """Rows per block of the chunked transport, 0 for ``blocks.chunk_rows_for`` (every rank must use the
    same)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, pull: bool | None = None, **kwargs) -> None:
        super().__init__(group, **kwargs)
        self.pull = (not self.graphable) if pull is None else pull

    def _check_pull(self, value) -> None:
        if value and self.graphable:
            raise TileweaveError("GemmReduceScatter: pull=True is not graphable (its flags carry epochs); "
                                 "use graphable=True without pull")

    pull = option("pull", _check_pull)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 use_fast_accum: bool = False) -> torch.Tensor:
        """See the module docstring (FP8: ``scale_a``, ``scale_b``, ``out_dtype``, ``use_fast_accum`` as
        ``matmul``'s). Errors: ``TypeError``/``ValueError`` naming the argument, raised before any
        communication (at a signature's first call on every rank, whichever rank's argument is bad);
        ``TileweaveError`` when the ranks' shapes differ (at a signature's first call, on every rank);
        ``CollectiveTimeout`` when a bounded wait for a peer expired."""
        plan, bias, out, scaled = self._plan_call(a, b, bias, out, (scale_a, scale_b, out_dtype, use_fast_accum))
        if out is None:
            dtype = a.dtype if scaled is None else scaled.out_dtype
            out = torch.empty((a.shape[0] // plan.backend.world_size, b.shape[1]), dtype=dtype, device=a.device)
        if plan.path == "chunked" and a.stride(1) != 1 and a.stride(0) != 1:
            a = a.contiguous()
        # The pulls land in out's rows: an out with padded rows takes the pushes.
        run = chunked.run if plan.run is pull.run and not out.is_contiguous() else None
        self._run(plan, common.capturing(a), (a, b, bias, out, scaled), run, chunk_rows=self.chunk_rows)
        return out

    def _check(self, a, b, bias, out, fp8) -> tuple:
        w, scaled = self._check_operands(a, b, "a", "M", "K_loc", "N", fp8)
        m, n = a.shape[0], b.shape[1]
        if m % w:
            raise ValueError(f"gemm_reduce_scatter scatters the M={m} rows of a over {w} ranks: M must be "
                             f"divisible by the group size {w} (pad M to {-(-m // w) * w})")
        dtype = a.dtype if scaled is None else scaled.out_dtype
        return (common.check_bias(bias, n, dtype, a.device), common.check_out(out, (m // w, n), dtype, a.device),
                scaled)

    local_run = staticmethod(nccl.run_local)
    nccl_run = staticmethod(nccl.run)
    oneshot_run = staticmethod(oneshot.run)

    def _gemm_shape(self, a, b, world: int) -> tuple[int, int, int, tuple]:
        (m, k), n = a.shape, b.shape[1]
        return m, n, k, (m, k, n)

    def _auto_route(self, m: int, n: int, k: int, dtype: torch.dtype, backend: Backend) -> str:
        return rule.auto_route(m, n, k, backend.world_size, dtype, pull=self.pull, interpreter=backend.interpreter)

    def _fused_plan(self, backend: Backend, config, m: int, n: int, k: int, dtype: torch.dtype) -> Plan:
        pulls = self.pull and backend.world_size == 2
        return Plan("chunked", pull.run if pulls else chunked.run, backend, config, epochs=True)
