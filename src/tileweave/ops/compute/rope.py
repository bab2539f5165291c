"""Rotary position embedding of a fused ``q | k | v`` projection (``tileweave.kernels.rope``): the
forward splits and rotates in one pass (``rope_qkv``), the backward rotates back and joins
(``rope_qkv_backward``)."""

from __future__ import annotations

import contextlib

import torch
import triton

from tileweave.kernels.rope import rope_heads_kernel
from tileweave.ops import common

ROW_ELEMENTS = 4096
"""Elements of one head a program moves on GPUs (``BR`` rows of ``head_dim`` columns): 32 rows of a
128-wide head, 8 KB of bfloat16, as in the other elementwise passes' tiles; not tuned."""
INTERPRETER_ROW_ELEMENTS = 8192
"""The same in Triton's interpreter, whose cost is per program: few, large ones."""


def _check(name: str, qkv_shape: tuple[int, int], seq: int, heads: int, kv_heads: int, head_dim: int,
           cos: torch.Tensor, sin: torch.Tensor, like: torch.Tensor) -> None:
    m, width = qkv_shape
    for arg, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim={head_dim} must be even (rotary pairs)")
    if width != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{name}: the fused projection must be [M, (heads + 2 kv_heads) * head_dim] = "
                         f"[M, {(heads + 2 * kv_heads) * head_dim}], got width {width}")
    if m % seq:
        raise ValueError(f"{name}: {m} rows are not whole sequences of seq={seq} tokens")
    for arg, t in (("cos", cos), ("sin", sin)):
        common.check_matrix(f"{name}: {arg}", t, device=like.device)
        if tuple(t.shape) != (seq, head_dim // 2):
            raise ValueError(f"{name}: {arg} must be [seq, head_dim / 2] = [{seq}, {head_dim // 2}], "
                             f"got {list(t.shape)}")
        if t.stride(1) != 1 or t.stride(0) != cos.stride(0):
            raise ValueError(f"{name}: cos and sin must have unit column strides and one row stride, got "
                             f"{cos.stride()} and {sin.stride()}")


def _launch(sources, dests, cos, sin, seq, heads, kv_heads, head_dim, sign: float) -> None:
    m = sources[0].shape[0]
    if m == 0:
        return
    interp = common.interpreting()
    if sources[0].device.type == "cpu" and not interp:
        raise RuntimeError("rope_qkv on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    bh = triton.next_power_of_2(head_dim // 2)
    br = max(1, (INTERPRETER_ROW_ELEMENTS if interp else ROW_ELEMENTS) // (2 * bh))
    with torch.cuda.device(cos.device) if cos.is_cuda else contextlib.nullcontext():
        rope_heads_kernel[(triton.cdiv(m, br), heads + 2 * kv_heads)](
            *sources, *dests, cos, sin, m, seq, heads, kv_heads, head_dim,
            *(t.stride(0) for t in sources), *(t.stride(0) for t in dests), cos.stride(0),
            SIGN=sign, BR=br, BH=bh, num_warps=4)


def _interpreter_copy(t: torch.Tensor) -> torch.Tensor:
    # the interpreter's bfloat16 loads are wrong: it reads float32 copies
    return t.float() if common.interpreting() and t.dtype == torch.bfloat16 else t


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, seq: int, heads: int, kv_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, heads * head_dim], k [M, kv_heads * head_dim], v [M, kv_heads * head_dim])``, new contiguous
    tensors, from ``qkv [M, (heads + 2 kv_heads) * head_dim]`` (per row ``[q | k | v]``, each head's
    ``head_dim`` columns together): ``q`` and ``k`` rotated, ``v`` copied.

    Rows are whole sequences of ``seq`` tokens one after another (row ``m`` is position ``m % seq``);
    ``cos``, ``sin`` are ``[seq, head_dim / 2]`` (``tileweave.nn.block.rope_tables``), columns ``2j`` and
    ``2j + 1`` of a head the pair turned by angle j. Math in float32, one rounding to ``qkv``'s dtype
    (fp16, bf16, fp32); ``qkv`` with unit column stride. No host synchronisation. On the CPU this runs
    in Triton's interpreter (bfloat16 read through float32). Errors, raised before anything is launched,
    name the argument."""
    common.check_matrix("rope_qkv: qkv", qkv)
    _check("rope_qkv", tuple(qkv.shape), seq, heads, kv_heads, head_dim, cos, sin, qkv)
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        raise ValueError(f"rope_qkv: qkv must have unit column stride, got strides {qkv.stride()}")
    m = qkv.shape[0]
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    outs = tuple(torch.empty((m, w), dtype=qkv.dtype, device=qkv.device) for w in widths)
    src, tc, ts = _interpreter_copy(qkv), _interpreter_copy(cos), _interpreter_copy(sin)
    dests = tuple(_interpreter_copy(t) for t in outs)
    sources = (src[:, :widths[0]], src[:, widths[0]:widths[0] + widths[1]], src[:, widths[0] + widths[1]:])
    _launch(sources, dests, tc, ts, seq, heads, kv_heads, head_dim, 1.0)
    for out, dest in zip(outs, dests):
        if dest is not out:
            out.copy_(dest)
    return outs


def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, *, seq: int, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``dqkv [M, (heads + 2 kv_heads) * head_dim]`` of ``rope_qkv``: ``dq`` and ``dk`` turned back (the
    inverse rotation), ``dv`` copied, into one new contiguous tensor. ``dq [M, heads * head_dim]``,
    ``dk``, ``dv [M, kv_heads * head_dim]`` of one dtype, unit column strides; the rest as ``rope_qkv``."""
    common.check_matrix("rope_qkv_backward: dq", dq)
    m = dq.shape[0]
    for name, t in (("dk", dk), ("dv", dv)):
        common.check_matrix(f"rope_qkv_backward: {name}", t, dtype=dq.dtype, device=dq.device)
        if t.shape[0] != m:
            raise ValueError(f"rope_qkv_backward: {name} has {t.shape[0]} rows, dq has {m}")
    _check("rope_qkv_backward", (m, dq.shape[1] + dk.shape[1] + dv.shape[1]), seq, heads, kv_heads, head_dim,
           cos, sin, dq)
    for name, t, n in (("dq", dq, heads), ("dk", dk, kv_heads), ("dv", dv, kv_heads)):
        if t.shape[1] != n * head_dim:
            raise ValueError(f"rope_qkv_backward: {name} must have {n} * {head_dim} columns, got {t.shape[1]}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"rope_qkv_backward: {name} must have unit column stride, got strides {t.stride()}")
    dqkv = torch.empty((m, (heads + 2 * kv_heads) * head_dim), dtype=dq.dtype, device=dq.device)
    dest = _interpreter_copy(dqkv)
    w_q, w_k = heads * head_dim, kv_heads * head_dim
    dests = (dest[:, :w_q], dest[:, w_q:w_q + w_k], dest[:, w_q + w_k:])
    _launch(tuple(_interpreter_copy(t) for t in (dq, dk, dv)), dests, _interpreter_copy(cos),
            _interpreter_copy(sin), seq, heads, kv_heads, head_dim, -1.0)
    if dest is not dqkv:
        dqkv.copy_(dest)
    return dqkv
