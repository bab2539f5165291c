"""The launcher of the decode-shaped GEMM (``tileweave.kernels.splitk``), with the plans that let a repeat
call skip deriving its arguments again."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tileweave.kernels.splitk import splitk_gemm_kernel
from tileweave.ops.compute.gemm_launch import stream_k_buffers
from tileweave.runtime import triton_launch
from tileweave.tune.splitk import SplitKConfig


@dataclasses.dataclass
class LaunchPlan:
    """What a launch derives from shapes, strides and dtypes: replayed by ``relaunch`` for later calls
    with tensors alike in all of those."""

    ints: tuple
    constexprs: tuple
    num_warps: int
    num_stages: int
    programs: int
    workspace: tuple[int, int] | None
    """(fp32 elements of the partials, tiles) when the tiles are split, else None."""
    compiled: list = dataclasses.field(default_factory=list)


def launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, config: SplitKConfig,
           *, num_sms: int) -> LaunchPlan:
    """``c = a @ b (+ bias)`` on the split-K kernel: ``a [M, K]`` and ``b [K, N]`` (any strides; the
    transpose of an ``[N, K]`` weight is read in place), ``c [M, N]``, ``bias [N]`` or None, all on one
    device, checked by the caller."""
    m, k = a.shape
    n = b.shape[1]
    tiles, splits, k_split = config.grid(m, n, k, num_sms)
    workspace = (tiles * splits * config.block_m * config.block_n, tiles) if splits > 1 else None
    if a.dtype == torch.float32:
        precision = "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    plan = LaunchPlan(ints=(m, n, k, k_split, splits, *a.stride(), *b.stride(), *c.stride()),
                      constexprs=(config.block_m, config.block_n, config.block_k, bias is not None, precision,
                                  config.tma and _tma_ok(a, b)),
                      num_warps=config.num_warps, num_stages=config.num_stages, programs=tiles * splits,
                      workspace=workspace)
    relaunch(plan, a, b, c, bias)
    return plan


def relaunch(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The launch of ``plan`` again, for tensors that match the ones it was made from (the caller's key
    guarantees it)."""
    triton_launch.install_allocator()
    parts, locks = stream_k_buffers(c.device, *plan.workspace) if plan.workspace else (c, c)
    tensors = (a, b, c, c if bias is None else bias, parts, locks)
    if plan.compiled and torch.cuda.current_device() == a.device.index:
        triton_launch.launch_compiled(plan.compiled[0], a.device.index, plan.programs,
                                      (*(t.data_ptr() for t in tensors), *plan.ints), plan.constexprs)
        return
    names = dict(zip(("BM", "BN", "BK", "HAS_BIAS", "PRECISION", "USE_TMA"), plan.constexprs))
    cuda = a.is_cuda
    with torch.cuda.device(a.device) if cuda else contextlib.nullcontext():
        kernel = splitk_gemm_kernel[(plan.programs,)](*tensors, *plan.ints, **names, num_warps=plan.num_warps,
                                                      num_stages=plan.num_stages)
    if cuda and triton_launch.FAST and not plan.compiled:
        plan.compiled.append(triton_launch.kept(kernel))


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel may read ``a [M, K]`` and ``b [K, N]`` through tensor descriptors: both K-major
    (``b`` the transpose of a row-major weight), 16-byte aligned bases and row pitches."""
    aligned = lambda t, pitch: t.data_ptr() % 16 == 0 and pitch * t.element_size() % 16 == 0  # noqa: E731
    return a.stride(1) == 1 and b.stride(0) == 1 and aligned(a, a.stride(0)) and aligned(b, b.stride(1))
