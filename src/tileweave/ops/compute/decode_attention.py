"""Attention of a decode step over the filled part of a KV cache (``tileweave.kernels.decode_attention``):
its length is read on the device, so a step captured in a CUDA graph over a cache of ``max_seq`` slots
costs what the keys filled so far cost."""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from tileweave.kernels.decode_attention import decode_attention_kernel
from tileweave.ops import common
from tileweave.ops.compute.gemm_launch import stream_k_buffers
from tileweave.runtime import triton_launch

BLOCK = 64
"""Keys per step of a program's loop (a 64 x 128 bf16 tile of keys is 16 KB)."""
PROGRAMS_PER_SM = 2
"""Programs the grid aims for per SM: the filled keys of each (sequence, head) are cut into that many
spans over all of them."""
INTERPRETER_BLOCK = 16
_compiled: dict[tuple, object] = {}


def suits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel computes this step exactly: on GPUs, or in Triton's interpreter for float16 and
    float32 (it computes bfloat16 wrongly; torch's attention runs those on the CPU)."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.dtype != k.dtype:
        return False
    if q.is_cuda:
        return True
    return common.interpreting() and q.dtype != torch.bfloat16


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, *,
                     limit: int, scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """``out [B, H, D]``: each sequence's one query ``q [B, H, D]`` attending to its cache ``k, v [B, KVH,
    max_seq, D]`` (``H`` a multiple of ``KVH``: grouped-query attention, ``k`` and ``v`` never repeated)
    over the slots before ``min(slot + 1, limit)``, where ``slot`` is the query's slot, an int64 tensor on
    the device (its first element), and ``valid [B, max_seq]`` (bool) marks the slots that hold tokens
    (the query's own slot is attended to in any case). ``scale`` defaults to ``D ** -0.5``; ``splits``
    (spans of the filled keys per sequence and head) to a few programs per SM. Last dimensions contiguous."""
    if not suits(q, k):
        raise ValueError(f"decode_attention: {q.dtype} q and {k.dtype} k on {q.device}: it runs float16, bfloat16 or "
                         "float32 (one dtype) on GPUs, float16 or float32 in Triton's interpreter (which computes "
                         "bfloat16 wrongly)")
    bsz, heads, dim = q.shape
    kvh, max_seq = k.shape[1], k.shape[2]
    if heads % kvh or k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != dim or valid.shape != (bsz, max_seq):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, valid "
                         f"{tuple(valid.shape)}: expected q [B, H, D], k and v [B, KVH, max_seq, D] with KVH "
                         "dividing H, valid [B, max_seq]")
    for name, t in (("q", q), ("k", k), ("v", v), ("valid", valid)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must have a unit last stride, got {t.stride()}")
    limit = max(1, min(limit, max_seq))
    interpreted = not q.is_cuda
    block = INTERPRETER_BLOCK if interpreted else BLOCK
    if splits is None:
        sms = 4 if interpreted else torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = max(1, min(round(PROGRAMS_PER_SM * sms / (bsz * kvh)), math.ceil(limit / block)))
    group = heads // kvh
    gp = max(16, triton.next_power_of_2(group))
    dp = max(16, triton.next_power_of_2(dim))
    out = torch.empty((bsz, heads, dim), dtype=q.dtype, device=q.device)
    parts, locks = (stream_k_buffers(q.device, bsz * kvh * splits * gp * (dp + 2), bsz * kvh) if splits > 1
                    else (out, out))
    tensors = (q, k, v, valid, slot, out, parts, locks)
    args = (float(scale if scale is not None else dim ** -0.5), limit, splits, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), valid.stride(0),
            out.stride(0), out.stride(1))
    constexprs = dict(KVH=kvh, G=group, GP=gp, HD=dim, HDP=dp, BLOCK=block)
    programs = bsz * kvh * splits
    # What Triton specialises on: the ints' equality to 1 and divisibility by 16, the pointers' alignment.
    key = (q.device, q.dtype, valid.dtype, tuple((v == 1, v % 16 == 0) for v in args[1:]), tuple(constexprs.values()),
           tuple(t.data_ptr() % 16 == 0 for t in tensors))
    kernel = _compiled.get(key) if triton_launch.FAST and q.is_cuda else None
    if kernel is not None and torch.cuda.current_device() == q.device.index:
        triton_launch.launch_compiled(kernel, q.device.index, programs, (*(t.data_ptr() for t in tensors), *args),
                                      tuple(constexprs.values()))
        return out
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        handle = decode_attention_kernel[(programs,)](*tensors, *args, **constexprs, num_warps=4, num_stages=2)
    if triton_launch.FAST and q.is_cuda:
        if len(_compiled) >= 1024:
            _compiled.clear()
        _compiled[key] = triton_launch.kept(handle)
    return out
