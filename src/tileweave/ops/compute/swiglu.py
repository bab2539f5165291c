"""The SwiGLU's backward passes (``tileweave.kernels.swiglu``): the MoE experts' (``swiglu_grad``, gate and
up interleaved, with the routing weight) and the dense layers' (``swiglu_backward``, ``x = gate | up``)."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.swiglu import swiglu_backward_kernel, swiglu_grad_kernel
from tileweave.ops import common

TILES = (8, 256, 4)
"""Rows of a program, columns per step, and its warps, on GPUs."""
INTERPRETER_TILES = (16, 32, 4)
"""The same in Triton's interpreter (the CPU tests)."""
BACKWARD_TILES = (8, 512, 4)
"""``swiglu_backward``'s ``(BR, BC, num_warps)`` on GPUs: a program's tile of rows by columns of each half.
Chosen by analogy with ``tileweave.ops.compute.fused_quantize``'s SwiGLU tile launch (one more elementwise
pass over the same ``gate | up``), not tuned."""
BACKWARD_INTERPRETER_TILES = (32, 256, 4)
"""The same in Triton's interpreter, whose cost is per program: few, large ones."""


def swiglu_grad(g: torch.Tensor, pre: torch.Tensor, row_scale: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy [P, 2N], h_scaled [P, N], row_dot [P])`` of the SwiGLU ``h = silu(gate) * up`` whose
    output row p was scaled by ``row_scale[p]`` (a routing weight) before the down projection:

    * ``dy = dgate | dup`` (gate columns, then up columns: the layout of the up projection's weight)
      of ``dh = row_scale[p] * g[p]``;
    * ``h_scaled[p] = row_scale[p] * h[p]`` (what the down projection's weight gradient multiplies);
    * ``row_dot[p] = <g[p], h[p]>`` (float32: the routing weight's gradient), summed in a fixed order.

    ``g [P, N]`` is the gradient of the scaled projection's input before the scale; ``pre [P, 2N]`` the
    pre-activations interleaved as ``tileweave.ops.compute.grouped_gemm.SwiGLU`` stores them (gate j in
    column 2j, up j in 2j + 1); both of one dtype (fp16, bf16, fp32) with unit column stride;
    ``row_scale`` float32 ``[P]``. Math in fp32; ``dy`` and ``h_scaled`` in ``g``'s dtype. No host
    synchronisation. On the CPU this runs in Triton's interpreter (bfloat16 read through float32).
    """
    common.check_matrix("g", g)
    rows, n = g.shape
    common.check_matrix("pre", pre, dtype=g.dtype, device=g.device)
    if tuple(pre.shape) != (rows, 2 * n):
        raise ValueError(f"pre must be [P, 2N] = [{rows}, {2 * n}] for g [P, N] = [{rows}, {n}], "
                         f"got {list(pre.shape)}")
    for name, t in (("g", g), ("pre", pre)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension, got strides {t.stride()}")
    if not isinstance(row_scale, torch.Tensor) or row_scale.shape != (rows,) or row_scale.dtype != torch.float32 \
            or row_scale.device != g.device or (rows > 1 and row_scale.stride(0) != 1):
        raise ValueError(f"row_scale must be a contiguous float32 tensor of shape ({rows},) on {g.device}")
    dy = torch.empty((rows, 2 * n), dtype=g.dtype, device=g.device)
    h_scaled = torch.empty((rows, n), dtype=g.dtype, device=g.device)
    row_dot = torch.zeros(rows, dtype=torch.float32, device=g.device)
    if rows == 0 or n == 0:
        return dy, h_scaled, row_dot
    interp = common.interpreting()
    if g.device.type == "cpu" and not interp:
        raise RuntimeError("swiglu_grad on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    outs = (dy, h_scaled)
    if interp and g.dtype == torch.bfloat16:
        g, pre = g.float(), pre.float()
        outs = (torch.empty(dy.shape), torch.empty(h_scaled.shape))
    br, bc, warps = INTERPRETER_TILES if interp else TILES
    with torch.cuda.device(g.device) if g.is_cuda else contextlib.nullcontext():
        swiglu_grad_kernel[(triton.cdiv(rows, br),)](
            g, pre, row_scale, outs[0], outs[1], row_dot, rows, n,
            g.stride(0), pre.stride(0), outs[0].stride(0), outs[1].stride(0), BR=br, BC=bc, num_warps=warps)
    if outs[0] is not dy:
        dy.copy_(outs[0])
        h_scaled.copy_(outs[1])
    return dy, h_scaled, row_dot


def swiglu_backward(dh: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dx = dgate | dup`` ``[M, 2F]``: the gradient of ``x = gate | up`` ``[M, 2F]`` (gate in columns
    ``[0, F)``, up in ``[F, 2F)``) for the gradient ``dh [M, F]`` of ``h = silu(gate) * up``::

        sig = sigmoid(gate)
        dgate = dh * up * sig * (1 + gate * (1 - sig))
        dup = dh * gate * sig

    ``dh`` and ``x`` of one dtype (fp16, bf16, fp32) on one device, each with unit stride along its last
    dimension and any row stride (say, ``x`` a column slice of a wider projection's output). One pass: each
    element of ``dh`` and ``x`` is read once and ``dx`` written once; math in fp32, ``dx`` a new contiguous
    tensor in ``x``'s dtype. No host synchronisation; runs on the current stream of ``x``'s device. Any
    ``M`` and ``F``, 0 included. On the CPU this runs in Triton's interpreter (bfloat16 read through
    float32).

    Errors, raised before anything is launched, name the argument: not a 2-D tensor of a supported
    dtype, ``x`` of an odd width, ``dh`` not ``[M, F]``, the two of different dtypes or devices, a column
    stride other than 1; CPU tensors without ``TRITON_INTERPRET=1``.
    """
    common.check_matrix("swiglu_backward: x", x)
    common.check_matrix("swiglu_backward: dh", dh, dtype=x.dtype, device=x.device)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"swiglu_backward: x must be gate | up, [M, 2F] with an even width, got {list(x.shape)}")
    f = width // 2
    if tuple(dh.shape) != (rows, f):
        raise ValueError(f"swiglu_backward: dh must be [M, F] = [{rows}, {f}] for x [M, 2F] = {list(x.shape)}, "
                         f"got {list(dh.shape)}")
    for name, t in (("x", x), ("dh", dh)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"swiglu_backward: {name} must have unit stride along its last dimension, got "
                             f"strides {t.stride()}; pass {name}.contiguous()")
    dx = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0 or f == 0:
        return dx
    interp = common.interpreting()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError("swiglu_backward on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    out = dx
    if interp and x.dtype == torch.bfloat16:  # the interpreter's bfloat16 loads are wrong
        dh, x, out = dh.float(), x.float(), torch.empty((rows, width))
    br, bc, warps = BACKWARD_INTERPRETER_TILES if interp else BACKWARD_TILES
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        swiglu_backward_kernel[(triton.cdiv(rows, br), triton.cdiv(f, bc))](
            dh, x, out, rows, f, dh.stride(0), x.stride(0), out.stride(0), BR=br, BC=bc, num_warps=warps)
    if out is not dx:
        dx.copy_(out)
    return dx
