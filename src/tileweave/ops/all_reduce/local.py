"""GEMM + AllReduce in a group of one (the ``"local"`` path): the GEMM, then on GPUs one kernel for the
bias, the residual add and the RMSNorm (the one-shot kernel of ``tileweave.kernels.gemm_all_reduce`` with a
single rank: no flags, no peers), in place of the handful of torch kernels an unfused epilogue takes. A
decode step's row-parallel linear at TP = 1 is then two launches.

The GEMM (``partial``) is the one every GEMM + AllReduce path runs for its rank's partial: float8 inputs
on tileweave's scaled GEMM; 16-bit inputs on ``tileweave.matmul`` where its decode-shaped route
(``tileweave.tune.splitk``) is faster than cuBLAS by ``splitk_pays``, on cuBLAS otherwise (faster than
tileweave's tile GEMM on every decode shape measured); on the CPU torch's, in fp32.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from tileweave.kernels.gemm_all_reduce import oneshot_kernel
from tileweave.ops.all_reduce import nccl
from tileweave.ops.compute.matmul import matmul
from tileweave.runtime import triton_launch
from tileweave.runtime.backend import Backend
from tileweave.tune.splitk import splitk_pays

ROW_ELEMS = 8192
"""Columns of a row the epilogue kernel holds at once on GPUs: a Llama-3-70B row (8192) in one step, so
that a decode step's few rows are read once, not walked in a loop of dependent loads."""
ROWS = 2
"""Rows per program (the kernel's smallest block)."""
INTERPRETED_ROW_ELEMS = 64
"""Columns per step in Triton's interpreter, so that the CPU tests' rows take several steps."""


def partial(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scales: tuple | None) -> torch.Tensor:
    """``out = a @ b`` in ``out``'s dtype (module docstring: which GEMM), on this device."""
    if scales is not None:
        return matmul(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=out.dtype, out=out)
    if a.is_cuda and not splitk_pays(a.shape[0], b.shape[1], a.shape[1], a.dtype):
        return torch.mm(a, b, out=out)
    return matmul(a, b, out=out)


def run(backend: Backend, a: torch.Tensor, b: torch.Tensor | None, bias, residual, norm_weight, eps: float,
        y: torch.Tensor, resid: torch.Tensor | None, scales: tuple | None = None) -> None:
    """The whole call for a group of one; writes ``y`` (and ``resid`` with a norm). ``b`` None: ``a`` is
    the partial itself (``GemmAllReduce.all_reduce``)."""
    if not a.is_cuda or backend.interpreter:
        nccl.run(backend, a, b, bias, residual, norm_weight, eps, y, resid, scales)
        return
    plain = bias is None and residual is None and norm_weight is None
    if b is None:
        if plain:
            y.copy_(a)
            return
        part = a if a.is_contiguous() else a.contiguous()
    elif plain:
        partial(a, b, y, scales)
        return
    else:
        part = partial(a, b, torch.empty(y.shape, dtype=y.dtype, device=y.device), scales)
    epilogue(part, bias, residual, norm_weight, eps, y, resid)


@dataclasses.dataclass
class _Plan:
    programs: int
    constexprs: dict
    num_warps: int
    compiled: list = dataclasses.field(default_factory=list)


_plans: dict[tuple, _Plan] = {}
_offsets: dict[torch.device, torch.Tensor] = {}


def epilogue(part, bias, residual, norm_weight, eps: float, y: torch.Tensor, resid: torch.Tensor | None) -> None:
    """``y = part (+ bias) (+ residual)``, or with ``norm_weight`` ``resid`` that and ``y`` its RMSNorm:
    the one-shot kernel on one rank (contiguous ``[M, N]`` tensors of one dtype, checked by the op; on the
    CPU in Triton's interpreter, float16 or float32)."""
    m, n = y.shape
    norm = norm_weight is not None
    # The compiled kernel is specialised on its pointers' 16-byte alignment too (views may be unaligned).
    aligned = tuple(t is None or t.data_ptr() % 16 == 0 for t in (part, y, resid, bias, residual, norm_weight))
    key = (m, n, y.dtype, y.device, bias is not None, residual is not None, norm, aligned)
    plan = _plans.get(key)
    if plan is None:
        bn = min(triton.next_power_of_2(n), ROW_ELEMS if y.is_cuda else INTERPRETED_ROW_ELEMS)
        plan = _Plan(programs=-(-m // ROWS), num_warps=max(4, min(16, ROWS * bn // 1024)),
                     constexprs=dict(WORLD=1, BM=ROWS, BN=bn, P=-(-m // ROWS), HAS_BIAS=bias is not None,
                                     HAS_RESIDUAL=residual is not None, HAS_NORM=norm, CONSTANT=False))
        if len(_plans) >= 1024:
            _plans.clear()
        _plans[key] = plan
    offsets = _offsets.get(y.device)
    if offsets is None:
        # The kernel addresses rank p's partial at part + offsets[p]: one rank, at offset 0. Its flag
        # pointers are never read with one rank; any device tensor stands in for them.
        offsets = _offsets[y.device] = torch.zeros(1, dtype=torch.int64, device=y.device)
    tensors = (part, offsets, offsets, offsets, offsets, offsets, y, resid if norm else y,
               y if bias is None else bias, y if residual is None else residual, norm_weight if norm else y,
               offsets, offsets)
    ints = (0, 0, 0, m, n, n, n, n, n, float(eps))
    if not y.is_cuda:
        oneshot_kernel[(plan.programs,)](*tensors, *ints, **plan.constexprs, num_warps=plan.num_warps)
        return
    device = y.device.index
    if plan.compiled and torch.cuda.current_device() == device:
        triton_launch.launch_compiled(plan.compiled[0], device, plan.programs,
                                      (*(t.data_ptr() for t in tensors), *ints), tuple(plan.constexprs.values()))
        return
    with torch.cuda.device(y.device):
        kernel = oneshot_kernel[(plan.programs,)](*tensors, *ints, **plan.constexprs, num_warps=plan.num_warps)
    if triton_launch.FAST and not plan.compiled:
        plan.compiled.append(triton_launch.kept(kernel))
