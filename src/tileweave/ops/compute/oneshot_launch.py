"""Launches of the one-shot kernels (``tileweave.kernels.oneshot``): one plan per shape and workspace,
so that a repeat call costs the host one launch with its pointers as ints."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from tileweave.kernels.oneshot import gather_rows_kernel, reduce_rows_kernel
from tileweave.ops.compute.gemm_launch import wrap_int32
from tileweave.runtime import triton_launch

ONESHOT_BLOCK = (32, 256, 4)
"""The one-shot kernels' tiles: rows, columns, warps (16 KB of bf16 per rank and tile)."""


@dataclasses.dataclass
class OneshotPlan:
    """The launches of one of ``tileweave.kernels.oneshot``'s kernels for one shape and workspace: every
    argument but the buffers that change per call and the epoch fixed, so that after the first launch
    of a layout (which compiles through Triton) a call costs the host one launch with its pointers as
    ints, as ``relaunch`` does; that launch is most of a one-shot call's host time. ``rows, cols``: the
    output's rows and columns (reduce) or a shard's (gather); ``row0``: this rank's first row (reduce);
    ``parts``: blocks of ``rows x cols`` the kernel moves (gather: one per peer)."""

    peer_offsets: torch.Tensor
    signals: torch.Tensor
    ready: torch.Tensor
    err: torch.Tensor
    host_err: torch.Tensor
    rank: int
    world: int
    rows: int
    cols: int
    max_spin: int
    programs: int
    row0: int = 0
    parts: int = 1
    meet: Callable[[], None] | None = None
    """Called once, before the plan's first launch and after compiling its kernel (on GPUs; the
    interpreter compiles nothing): the op's barrier, so that no rank's kernel spends its bounded wait
    on a peer that is still compiling (seconds with a cold cache). Plans are made on every rank at the
    same call, so every rank meets. A later launch that needs another specialisation (an output of
    another alignment or row stride) compiles inline, unmet: only a spin bound far below the default
    can expire on that."""
    compiled: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        bm, bn, self.warps = ONESHOT_BLOCK
        self.blocks = (bm, bn)
        tiles = -(-self.rows // bm) * -(-self.cols // bn) * self.parts
        self.programs = max(1, min(self.programs, tiles))

    def launch(self, kernel_fn, key: tuple, tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        """Launch ``kernel_fn`` with ``tensors`` (pointer arguments) then ``scalars``: the compiled
        kernel of ``key`` with the pointers as ints if there is one, else through Triton (kept)."""
        device = tensors[0].device
        fast = triton_launch.FAST and device.type == "cuda"
        if self.meet is not None:
            meet, self.meet = self.meet, None
            if device.type == "cuda":
                try:
                    with torch.cuda.device(device):
                        kernel = kernel_fn.warmup(*tensors, *scalars, grid=(self.programs,), **constexprs,
                                                  num_warps=self.warps)
                    if fast:
                        self.compiled[key] = triton_launch.kept(kernel)
                except Exception:  # noqa: BLE001 - the launch below compiles again and raises the error itself
                    pass
            meet()  # also after a failed compile: the peers are waiting here
        kernel = self.compiled.get(key) if fast else None
        if kernel is not None and torch.cuda.current_device() == device.index:
            triton_launch.launch_compiled(kernel, device.index, self.programs, (*(t.data_ptr() for t in tensors), *scalars),
                             tuple(constexprs.values()))
            return
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel = kernel_fn[(self.programs,)](*tensors, *scalars, **constexprs, num_warps=self.warps)
        if fast:
            self.compiled[key] = triton_launch.kept(kernel)


def launch_reduce_rows(plan: OneshotPlan, part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                       epoch: int) -> None:
    """``out`` = this rank's rows of the sum of every rank's ``part`` (``reduce_rows_kernel``)."""
    has_bias = bias is not None
    stride_p, stride_out = part.stride(0), out.stride(0)
    # What Triton specialises on that can change between calls: alignments, the row strides.
    key = (part.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, stride_out, has_bias,
           has_bias and bias.data_ptr() % 16 == 0, stride_p)
    tensors = (part, plan.peer_offsets, plan.signals, plan.ready, out, bias if has_bias else out, plan.err,
               plan.host_err)
    scalars = (wrap_int32(epoch), plan.max_spin, plan.rank, plan.rows, plan.cols, plan.row0, stride_p, stride_out)
    plan.launch(reduce_rows_kernel, key, tensors, scalars,
                {"WORLD": plan.world, "BM": plan.blocks[0], "BN": plan.blocks[1], "P": plan.programs,
                 "HAS_BIAS": has_bias})


def launch_gather_rows(plan: OneshotPlan, buf: torch.Tensor, epoch: int) -> None:
    """Every peer's rows of its gather buffer into the same rows of this rank's ``buf``
    (``gather_rows_kernel``)."""
    stride = buf.stride(0)
    tensors = (buf, plan.peer_offsets, plan.signals, plan.ready, plan.err, plan.host_err)
    scalars = (wrap_int32(epoch), plan.max_spin, plan.rank, plan.rows, plan.cols, stride)
    plan.launch(gather_rows_kernel, (buf.data_ptr() % 16 == 0, stride), tensors, scalars,
                {"WORLD": plan.world, "BM": plan.blocks[0], "BN": plan.blocks[1], "P": plan.programs})
