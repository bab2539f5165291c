"""AllGather + GEMM, fused: the column-parallel forward of sequence-parallel TP.

==================  ==========================  ==========================================
tensor              shape (per rank)            meaning
==================  ==========================  ==========================================
``a_shard``         ``[M / W, K]``              this rank's rows of the activations
``b``               ``[K, N_loc]``              this rank's columns of the weight
                                                (``weight.t()`` of an ``[N_loc, K]`` weight is
                                                read in place)
``bias``            ``[N_loc]``                 optional
result              ``[M, N_loc]``              ``AllGather_M(a_shard) @ b + bias``
gathered            ``[M, K]``                  ``AllGather_M(a_shard)`` (backward needs it)
==================  ==========================  ==========================================

Paths. ``policy="auto"`` takes a fused transport where it was measured faster than NCCL + cuBLAS, the
unfused path elsewhere (``rule.auto_route``). The fused transports share one protocol (``push``): each
rank's copy stream pushes its shard into every peer's symmetric gather buffer (``mesh``, for
NVSwitch-class nodes) or forwards every chunk to rank+1 (``ring``, for PCIe or partial meshes), then
writes the peer's ready flag with a stream memory op; the consumer computes its own rows straight from
``a_shard`` while the shards travel, then each peer's rows once that peer's flag carries this call's
value: the persistent GEMM kernel (``mesh``, ``ring``) or cuBLAS per shard (``chunked``). After the
GEMM each rank tells every peer that its gather buffer may be refilled (``released``), and a producer
waits for that before pushing the next call's shard, so no barrier is needed between calls.
``policy="oneshot"``: one kernel copies the peers' shards out of their buffers, then one GEMM.

FP8: with float8 ``a_shard`` and ``b`` (e4m3fn or e5m2) and float32 ``scale_a``, ``scale_b`` (``matmul``'s
shapes for this rank's ``a_shard [M/W, K] @ b``: one element each, a tensorwise ``scale_a`` that may
differ per rank; rowwise ``[M/W, 1]`` and ``[1, N_loc]``; blockwise ``[M/W, K/128]`` and ``[K/128,
ceil(N_loc/128)]``), the result is ``AllGather_M(a_shard * scale_a) @ (b * scale_b)`` in ``out_dtype``
(bfloat16 by default, float16, float32), fp32 accumulation: each gathered row keeps its source rank's
scale. The float8 rows travel (half the bytes of bfloat16) and each shard's a-scales beside them, in
the gathered form of ``tileweave.ops.dense`` (a row per row; a tensorwise scale as its shard's
rows each holding it): the push copies a shard's scales into a second region of the peer's gather
buffer, ``[M, KB]`` float32 after the rows, before it raises the ready flag, so one flag covers both;
the kernel reads a peer's rows' scales from there, its own rows' from ``scale_a``. The chunked transport
runs tileweave's ``matmul`` per shard, the unfused path all-gathers rows (as bytes) and scales over
NCCL, then one ``matmul``. With ``return_gathered`` a float8 call returns ``(out, gathered [M, K],
gathered_scales [M, KB])``: fresh tensors (the copy stream fills them, each shard once it has arrived),
the scales in the gathered form, so that ``gathered * gathered_scales`` (each row times its scale or
its 1 x 128 blocks' scales) is every rank's ``a_shard * scale_a``. Refused with float8:
``policy="oneshot"`` (its kernel gathers rows only) and ``gathered_out``. ``all_gather`` (the gather
alone) takes float8 rows with their scales in the gathered form, which travel alike. Every rank must
pass scales of the same shapes.

Capture in a CUDA graph (``graphable=True``, every transport): a replay repeats the flag values
written at capture, so a graphable op never writes an epoch. Its flags hold 0 or 1 instead: a producer
waits until its RELEASED word for a consumer is 1, sets it to 0, pushes, and sets the consumer's READY
word for it to 1; the consumer waits for READY == 1, and after the GEMM sets its READY words back to 0
and then each producer's RELEASED word to 1 (the same stream, fenced writes). RELEASED words start at
1. Eager calls of a graphable op run the same protocol.

Concurrency: all ranks must call the op the same number of times in the same order. Do not launch
two calls on one workspace concurrently from different streams.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.ops import common
from tileweave.ops.all_gather import nccl, oneshot, rule
from tileweave.ops.all_gather.push import PendingGather, programs, run_chunked, run_mesh, run_ring
from tileweave.ops.dense import DenseOp, Plan, wanted
from tileweave.ops.skeleton import option
from tileweave.ops.compute.gemm_launch import ag_stream_k_tail
from tileweave.ops.compute.scaling import FP8_DTYPES
from tileweave.ops.workspace import agree
from tileweave.runtime.backend import Backend
from tileweave.tune.configs import GemmConfig

OP = "all_gather_gemm"
TRANSPORTS = ("auto", "mesh", "ring", "chunked")
_RUN = {"mesh": run_mesh, "ring": run_ring, "chunked": run_chunked}


class AllGatherGemm(DenseOp):
    """A reusable fused AllGather+GEMM bound to one group; keeps its gather buffer between calls.

    ``policy``: ``"auto"`` picks the fused or the unfused path (NCCL all-gather, then GEMM) per shape,
    ``"fused"`` and ``"fallback"`` force one; ``"oneshot"`` takes the one-shot path on every call (NCCL
    under CUDA-graph capture, where its epochs would not advance). ``transport``: ``"mesh"``, ``"ring"``
    or ``"chunked"`` (module docstring); ``"auto"`` (default): chunked or mesh per shape.
    ``graphable=True``: constant-valued flags (module docstring), so that calls on the fused paths can
    be captured in a CUDA graph. ``stream_k`` (every rank alike; ``TILEWEAVE_AG_STREAM_K`` for the
    shared op): whether the fused kernel shares the tiles of its last, partial wave out by K steps over
    every program instead of leaving the programs without a whole tile idle; None (default): where
    ``rule.all_gather_stream_k`` says so (with a ``config`` given, as that config says). Only
    where the partial wave's tiles all lie in the last chunk. Other arguments: :class:`tileweave.ops.dense.DenseOp`.
    """

    op_name = OP
    a_name = "a_shard"
    transports = TRANSPORTS
    transport_env = settings.AG_TRANSPORT
    default_transport = "auto"
    option_envs = {"stream_k": settings.AG_STREAM_K}

    def __init__(self, group: dist.ProcessGroup | None = None, *, stream_k: bool | None = None, **kwargs) -> None:
        super().__init__(group, **kwargs)
        self.stream_k = stream_k

    stream_k = option("stream_k")

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, return_gathered: bool = False,
                 gathered_out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 use_fast_accum: bool = False):
        """See the module docstring. Returns ``out`` or ``(out, gathered)``; ``gathered`` is a view of
        the workspace, valid until the next call of this object (or of ``gather_buffer``) on this rank:
        the call lends the buffer to the caller and releases it to the peers only then, so a peer that
        runs ahead cannot refill it while the caller's kernels still read it. Read it on the stream of
        the call. A graphable op returns a fresh tensor instead (a release deferred to the next call
        would not replay in a CUDA graph). With ``gathered_out`` (a contiguous ``[M, K]`` tensor) the
        copy stream writes the gathered input there, each shard once it has arrived, and that tensor is
        returned. A float8 call returns ``(out, gathered, gathered_scales)``, fresh (module docstring).

        Errors: ``TypeError``/``ValueError`` naming the argument, raised before any communication;
        ``TileweaveError`` when the ranks' shapes differ (at a signature's first call, on every rank);
        ``CollectiveTimeout`` when a bounded wait for a peer expired (one call late unless
        ``TILEWEAVE_DEBUG=1`` or on the CPU). FP8 (``scale_a``, ``scale_b``, ``out_dtype``,
        ``use_fast_accum`` as ``matmul``'s): the module docstring; a bad float8 argument raises on every
        rank at a signature's first call, whichever rank passed it."""
        if gathered_out is not None and wanted(a_shard, b, scale_a, scale_b, out_dtype):
            raise TypeError(f"{OP}: gathered_out is not supported with float8 inputs (the gathered rows come with "
                            "their scales); pass return_gathered=True, which returns fresh (gathered, scales)")
        if gathered_out is not None and isinstance(a_shard, torch.Tensor) and a_shard.dim() == 2:
            # Before the plan: a bad argument must raise on every rank before any collective.
            _check_gathered_out(gathered_out, a_shard, self.backend_for(a_shard.device).world_size)
        plan, bias, out, scaled = self._plan_call(a_shard, b, bias, out, (scale_a, scale_b, out_dtype, use_fast_accum))
        capturing = common.capturing(a_shard)
        if scaled is not None:  # gathered float8 rows are fresh tensors, never the lent buffer
            return self._run(plan, capturing, (a_shard, b, bias, out, return_gathered, None, scaled))
        if gathered_out is not None:
            return_gathered = True
        elif return_gathered and self.graphable:
            gathered_out = gathered_like(a_shard, plan.backend.world_size)
        return self._run(plan, capturing, (a_shard, b, bias, out, return_gathered, gathered_out))

    def _check(self, a_shard, b, bias, out, fp8) -> tuple:
        w, scaled = self._check_operands(a_shard, b, "a_shard", "M/W", "K", "N_loc", fp8)
        if scaled is not None and self.policy == "oneshot" and w > 1:
            raise TypeError(f"{OP}: policy='oneshot' does not take float8 inputs (its kernel gathers the rows "
                            "without their scales); use policy='auto', 'fused' or 'fallback'")
        n, device = b.shape[1], a_shard.device
        dtype = a_shard.dtype if scaled is None else scaled.out_dtype
        return (common.check_bias(bias, n, dtype, device),
                common.check_out(out, (a_shard.shape[0] * w, n), dtype, device), scaled)

    local_run = staticmethod(nccl.run_local)
    nccl_run = staticmethod(nccl.run)
    oneshot_run = staticmethod(oneshot.run)

    def _gemm_shape(self, a_shard, b, world: int) -> tuple[int, int, int, tuple]:
        mc, k = a_shard.shape
        return mc * world, b.shape[1], k, (mc, k, b.shape[1])

    def _auto_route(self, m: int, n: int, k: int, dtype: torch.dtype, backend: Backend) -> str:
        return rule.auto_route(m, n, k, backend.world_size, dtype, interpreter=backend.interpreter)

    def _fused_plan(self, backend: Backend, config: GemmConfig, m: int, n: int, k: int, dtype: torch.dtype) -> Plan:
        # A function of the shapes, which every rank has just agreed on.
        transport = rule.fused_transport(m, n, k, backend.world_size, dtype, interpreter=backend.interpreter,
                                    transport=self.transport)
        return Plan("chunked" if transport == "chunked" else "fused", _RUN[transport], backend, config, epochs=True)

    def _stream_k_tail(self, config: GemmConfig, m: int, n: int, k: int, backend: Backend) -> bool:
        """The ``stream_k`` option, where the kernel can take the tail at all."""
        w = backend.world_size
        count = programs(config, backend)
        if not ag_stream_k_tail(m // w, n, config, w, count):
            return False
        if self.stream_k is not None:
            return self.stream_k
        if self.config is not None:
            return self.config.stream_k
        return rule.all_gather_stream_k(m // w, n, k, w, config.block_m, config.block_n, count)

    def gather_buffer(self, m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's ``[M, K]`` gather buffer. A producer that writes its output straight into rows
        ``[r*M/W, (r+1)*M/W)`` of it and passes that view as ``a_shard`` saves the copy that
        ``return_gathered`` otherwise makes."""
        backend = self.backend_for(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.memory.workspace(backend, m * k * itemsize).data.view(backend.rank, dtype, (m, k))

    def all_gather(self, a_shard: torch.Tensor, *, scales: torch.Tensor | None = None) -> PendingGather:
        """Start gathering ``a_shard [M/W, K]`` into this op's ``[M, K]`` buffer, without a GEMM: the
        same copy-engine transport, so it needs no SM and can run next to kernels that spin on their
        peers. ``wait()`` on the result makes the caller's stream wait for every shard and returns the
        buffer; ``release()``, once the kernels that read it are enqueued, lets the peers refill it.
        Collective like a call of the op: every rank, in the same order; no other call of this object
        between the start and ``release()``.

        Float8 rows (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) come with their ``scales``,
        ``[M/W, KB]`` float32 in the gathered form (module docstring: each row's scale, a tensorwise
        scale repeated on every row, or each row's ``K/128`` block scales); they travel beside the rows
        under the same flag, and the result's ``gathered_scales`` (``[M, KB]``, in the buffer, lent
        alike) holds every rank's. Every rank passes the same dtype and shapes. Errors name the
        argument: ``scales`` missing for float8 rows or given for others, of a wrong dtype or shape."""
        if not isinstance(a_shard, torch.Tensor):
            _check_gather_scales(a_shard, scales)
        backend = self.backend_for(a_shard.device)
        w = backend.world_size
        if w == 1:
            _check_gather_scales(a_shard, scales)
            return PendingGather(backend, a_shard, gathered_scales=scales)
        # The checks' outcome is exchanged, so that a bad argument on one rank fails every rank here.
        signature = {"all_gather a_shard": common.signature_of(a_shard), "scales": common.signature_of(scales)}
        agree(backend, self.op_name, signature, lambda: _check_gather_scales(a_shard, scales))
        mc, k = a_shard.shape
        if self.policy == "fallback" or not backend.peer_access:
            if scales is not None:  # float8 travels as bytes, the scales as float32 rows
                return PendingGather(backend, common.all_gather_rows(a_shard, backend),
                                     gathered_scales=common.all_gather_rows(scales, backend))
            gathered = a_shard.new_empty((mc * w, k))
            dist.all_gather_into_tensor(gathered, a_shard.contiguous(), group=backend.group)
            return PendingGather(backend, gathered)
        if not self.graphable:
            common.check_not_capturing(OP, a_shard)
        kb = 0 if scales is None else scales.shape[1]
        key = ("all_gather", mc, k, a_shard.dtype, kb)
        if key not in self._plans:
            self._plans[key] = Plan("all_gather", None, backend)
        self.errors.raise_pending(backend, common.capturing(a_shard))
        shard_scales = None if scales is None else scales.contiguous()
        return PendingGather.start(backend, self.memory, a_shard, ring=self.transport == "ring",
                                   constant=self.graphable, shard_scales=shard_scales)


def _check_gather_scales(a_shard, scales) -> None:
    """``all_gather``'s arguments: rows of a dtype the ops run, or float8 rows with ``[M/W, KB]`` float32
    scales on their device."""
    if isinstance(a_shard, torch.Tensor) and a_shard.dim() == 2 and a_shard.dtype in FP8_DTYPES:
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2 \
                or scales.shape[0] != a_shard.shape[0] or scales.device != a_shard.device:
            raise TypeError(f"{OP}.all_gather: float8 a_shard {list(a_shard.shape)} needs scales, a float32 "
                            f"[{a_shard.shape[0]}, KB] tensor on {a_shard.device} (each row's scale or block "
                            f"scales), got {common.describe(scales)}")
        return
    common.check_matrix("a_shard", a_shard)
    common.check_runs_dtype(OP, "a_shard", a_shard)
    if scales is not None:
        raise TypeError(f"{OP}.all_gather: scales go with float8 rows; a_shard is {a_shard.dtype}")


def _check_gathered_out(gathered_out: torch.Tensor, a_shard: torch.Tensor, world: int) -> None:
    mc, k = a_shard.shape
    common.check_out(gathered_out, (mc * world, k), a_shard.dtype, a_shard.device, name="gathered_out")
    if not gathered_out.is_contiguous():
        raise ValueError(f"gathered_out must be contiguous, got strides {gathered_out.stride()}")


def gathered_like(a_shard: torch.Tensor, world: int) -> torch.Tensor:
    """A fresh contiguous ``[M, K]`` tensor for the gathered ``a_shard``."""
    return torch.empty((a_shard.shape[0] * world, a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
