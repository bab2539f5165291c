"""The communication GEMMs a TP layer runs on (``TPOps``), and the gathers its backward makes."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops import functional
from tileweave.ops.all_gather.op import AllGatherGemm
from tileweave.ops.compute.matmul import matmul


_BLOCK = 128


def _torch_blockwise() -> Callable | None:
    """torch's blockwise scaled matmul (``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` and
    ``BlockWise128x128`` scales, torch 2.10 and later), or None."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if fn is None or kinds is None or not hasattr(kinds, "BlockWise1x128"):
        return None
    return lambda a, b, sa, sb, out_dtype: fn(a, b, sa, kinds.BlockWise1x128, sb, kinds.BlockWise128x128,
                                              output_dtype=out_dtype)


_TORCH_BLOCKWISE = _torch_blockwise()


def weight_grad_matmul(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """The local GEMM of an FP8 layer's weight gradient, ``(a * scale_a) @ (b * scale_b)`` with
    ``tileweave.matmul``'s arguments. It hides no communication, so it runs where it is fastest, as the
    bf16 layers' weight gradients run on cuBLAS: e4m3 operands with blockwise scales (``scale_a [M,
    K/128]``, ``scale_b [K/128, N/128]``, every dimension a multiple of 128) and a bf16 output on a CUDA
    device go to torch's blockwise scaled matmul where torch has it (it sums each K block in float32
    and ignores ``use_fast_accum``); everything else to ``tileweave.matmul``."""
    m, k = a.shape
    n = b.shape[1]
    if (_TORCH_BLOCKWISE is not None and a.is_cuda and a.dtype == b.dtype == torch.float8_e4m3fn
            and out_dtype == torch.bfloat16 and m % _BLOCK == 0 and k % _BLOCK == 0 and n % _BLOCK == 0
            and tuple(scale_a.shape) == (m, k // _BLOCK) and tuple(scale_b.shape) == (k // _BLOCK, n // _BLOCK)):
        # torch takes the 1 x 128 scales M-major (strides (1, M))
        sa = torch.empty_strided(scale_a.shape, (1, m), dtype=torch.float32, device=a.device).copy_(scale_a)
        return _TORCH_BLOCKWISE(a, b, sa, scale_b, out_dtype)
    return matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


@dataclasses.dataclass(frozen=True)
class TPOps:
    """The communication GEMMs a TP layer runs on, with the signatures of ``tileweave.ops.functional``:
    ``all_gather_gemm(x_shard, b, group, *, bias=None, return_gathered=False)`` and
    ``gemm_reduce_scatter(a, b, group, *, bias=None)``; layers with an ``fp8`` recipe also pass float8
    operands with ``scale_a``, ``scale_b``, ``out_dtype`` and ``use_fast_accum``, and take
    ``(out, gathered, gathered_scales)`` from ``all_gather_gemm(..., return_gathered=True)`` (tileweave's
    ops do; NCCL-style stand-ins need not). ``shared_all_gather(group, device)``: an
    ``AllGatherGemm`` whose buffer the backward may borrow (its gathered view is lent until the op's
    next call, which saves a copy) and whose ``all_gather`` regathers an input on the copy engines;
    None: the backward takes a fresh gathered tensor and regathers with ``torch.distributed``.
    ``matmul(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum)``: the local GEMM of an ``fp8``
    layer's weight gradient, float8 operands with ``tileweave.matmul``'s scales (default:
    ``weight_grad_matmul``), so that stand-in ops replace all three GEMMs of a step."""

    all_gather_gemm: Callable
    gemm_reduce_scatter: Callable
    shared_all_gather: Callable[[dist.ProcessGroup, torch.device], AllGatherGemm] | None = None
    matmul: Callable = weight_grad_matmul


TILEWEAVE_OPS = TPOps(all_gather_gemm=functional.all_gather_gemm,
                      gemm_reduce_scatter=functional.gemm_reduce_scatter, shared_all_gather=AllGatherGemm.shared)
"""tileweave's fused ops, shared per (group, device): the layers' default."""


def gather_for_weight_grad(ops: TPOps, dy_shard: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup):
    """``(dy_shard gathered @ weight, dy_shard gathered)`` for a weight gradient that the caller queues
    at once. On a shared op (outside ``torch.compile``) the gathered tensor is the op's buffer itself,
    lent until this rank's next all-gather call: no copy into a fresh tensor, as the functional op makes
    for callers that keep it."""
    if ops.shared_all_gather is not None and not torch.compiler.is_compiling():
        return ops.shared_all_gather(group, dy_shard.device)(dy_shard, weight, return_gathered=True)
    return ops.all_gather_gemm(dy_shard, weight, group, return_gathered=True)


class Gathered:
    """A finished all-gather, with the interface of ``PendingGather``."""

    def __init__(self, gathered: torch.Tensor, gathered_scales: torch.Tensor | None = None) -> None:
        self._gathered = gathered
        self.gathered_scales = gathered_scales
        """Float8 gathers: the ``[M, KB]`` float32 scales of the gathered rows (None otherwise)."""

    def wait(self) -> torch.Tensor:
        return self._gathered

    def release(self) -> None:
        pass


def start_gather(ops: TPOps, x_shard: torch.Tensor, group: dist.ProcessGroup, *,
                 scales: torch.Tensor | None = None):
    """Gather the input again for the weight gradient while the input gradient runs: on the shared op's
    copy engines (no SMs, so nothing competes with a fused kernel spinning on its peers, unlike an NCCL
    kernel would), into its own buffer, released after the weight gradient; else with NCCL. Float8 rows
    take their ``scales`` (``[M/W, KB]`` float32, ``AllGatherGemm.all_gather``'s form), gathered beside
    them into the result's ``gathered_scales``."""
    if ops.shared_all_gather is not None:
        return ops.shared_all_gather(group, x_shard.device).all_gather(x_shard, scales=scales)
    return Gathered(_all_gather_rows(x_shard, group), None if scales is None else _all_gather_rows(scales, group))


def _all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t [rows, C]``, rank after rank; float8 travels as bytes, which every backend moves."""
    t = t.contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _all_gather_rows(t.view(torch.uint8), group).view(t.dtype)
    world = dist.get_world_size(group)
    gathered = t.new_empty((t.shape[0] * world, t.shape[1]))
    dist.all_gather(list(gathered.chunk(world)), t, group=group)
    return gathered
