"""Grouped GEMM over device-side group offsets, with rows gathered by index: the MoE layers' core."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import triton

from tileweave.kernels.grouped_gemm import grouped_gemm_kernel
from tileweave.ops import _launch
from tileweave.tune.grouped import GroupedConfig, choose_grouped_config

G_BLOCK_MAX = 1024
"""Up to this many visited groups the kernel keeps every group's offsets in registers; beyond it each
program walks the groups in memory."""


class Gate(NamedTuple):
    ready_flags: torch.Tensor
    epoch: int
    rank: int
    err: torch.Tensor
    max_spin: int


@functools.cache
def _sm_count(kind: str, index: int | None) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4


def _sm90(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= 9


@functools.cache
def _capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def grouped_config(rows: int, n: int, k: int, groups: int, dtype: torch.dtype,
                   device: torch.device) -> GroupedConfig:
    """The config ``grouped_gemm`` picks when given none (``tileweave.tune.grouped`` has the rule)."""
    return choose_grouped_config(rows, n, k, groups, dtype, num_sms=_sm_count(device.type, device.index),
                                 interpreter=_launch.interpreting())


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, a_rows: torch.Tensor | None = None,
                 row_scale: torch.Tensor | None = None, experts: int | None = None,
                 out: torch.Tensor | None = None, config: GroupedConfig | None = None,
                 group_range: tuple[int, int] | None = None, gate: tuple | None = None,
                 signal: tuple | None = None) -> torch.Tensor:
    """``out[p] = a[a_rows[p]] @ b[g % E] (* row_scale[p])`` for every row p of every group g.

    Shapes: ``a [Ma, K]`` (unit column stride, any row stride); ``a_rows`` int32/int64 ``[P]`` (row p
    reads ``a[a_rows[p]]``; without it ``a`` is ``[P, K]`` in output order); ``b [E, K, N]`` with any
    strides, read in place, including ``w.transpose(1, 2)`` of a stacked ``nn.Linear`` weight
    ``w [E, N, K]``; ``offsets`` int32 ``[G + 1]`` on the device: ``offsets[0] == 0``,
    non-decreasing, ``offsets[G] == P``; group g is output rows ``[offsets[g], offsets[g + 1])``
    (possibly empty) and uses expert ``g % E`` with ``E = experts or b.shape[0]``. ``row_scale``
    float32 ``[P]`` multiplies output row p after the fp32 accumulation. ``out [P, N]`` (unit column
    stride) has ``a``'s dtype; float16, bfloat16 and float32 inputs (float32 uses TF32 where
    ``torch.backends.cuda.matmul.allow_tf32`` allows it). On the CPU this runs in Triton's interpreter,
    bfloat16 upcast to float32 there.

    The row counts stay on the device: no host synchronisation (capturable in a CUDA graph). The
    offsets are checked against P only under ``TILEWEAVE_DEBUG=1`` (a host sync); out-of-range
    offsets or row indices are otherwise undefined behaviour.

    ``group_range=(g_lo, g_hi)``: compute only groups ``[g_lo, g_hi)``, visited from g_lo on; other
    rows of ``out`` are left as they are.

    ``gate=(ready_flags, epoch, rank, err, max_spin)`` (consumer of an all-gather): groups are visited
    from group ``rank * E`` on, wrapping; a tile of group g from source ``s = g // E != rank`` first
    waits, at most ``max_spin`` polls, until ``ready_flags[s]`` (int32, one word per source) reaches
    ``epoch`` (cyclic comparison). An expired wait stores ``1 + s`` in ``err`` (int32 ``[1]``, atomic
    max) and its tiles neither load nor store; the caller checks ``err`` (``_launch.raise_on_timeout``).

    ``signal=(counters,)``: after each finished tile of group g (its stores done), a system-scope
    release adds 1 to ``counters[g // E]`` (int32). ``expected_tiles`` gives the counts per call.

    Concurrency: ``out`` rows of the computed groups are written, nothing else; the call is ordered on
    the current stream like any kernel.
    """
    _launch.check_matrix("a", a)
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"b must be a 3-D tensor [E, K, N], got {_describe(b)}")
    _launch.check_matrix("b[0]", b[0], dtype=a.dtype, device=a.device)
    num_b, k, n = b.shape
    if a.shape[1] != k:
        raise ValueError(f"a is [Ma, K={a.shape[1]}] but b is {list(b.shape)}: b must be [E, K={a.shape[1]}, N]")
    experts = num_b if experts is None else experts
    if not isinstance(experts, int) or not 1 <= experts <= num_b:
        raise ValueError(f"experts must be an int from 1 to b.shape[0] = {num_b}, got {experts!r}")
    _check_index("offsets", offsets, a.device, (torch.int32,))
    if offsets.numel() < 1:
        raise ValueError("offsets must have G + 1 >= 1 entries, got none")
    groups = offsets.numel() - 1
    if a_rows is not None:
        _check_index("a_rows", a_rows, a.device, (torch.int32, torch.int64))
        rows = a_rows.numel()
    else:
        rows = a.shape[0]
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or row_scale.shape != (rows,) or row_scale.dtype != torch.float32 \
                or row_scale.device != a.device:
            raise ValueError(f"row_scale must be a float32 tensor of shape ({rows},) on {a.device}, "
                             f"got {_describe(row_scale)}")
    out = _launch.check_out(out, (rows, n), a.dtype, a.device)
    g_lo, g_hi = _check_range(group_range, groups)
    sources = math.ceil(groups / experts)
    gate = _check_gate(gate, sources, a.device)
    counters = _check_signal(signal, sources, a.device)
    if out is None:
        out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if _launch.debug_mode():
        _check_offsets(offsets, rows)
    if rows == 0 or n == 0 or g_hi == g_lo:
        return out
    if a.device.type == "cpu" and not _launch.interpreting():
        raise RuntimeError("grouped_gemm on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    chosen = config or grouped_config(rows, n, k, groups, a.dtype, a.device)
    if not isinstance(chosen, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig, got {type(chosen).__name__}")
    if a.dtype == torch.bfloat16 and _launch.interpreting():
        # The interpreter's bfloat16 dot is wrong: compute in float32 and round once at the end.
        staged = out.float()
        _run(a.float(), b.float(), offsets, a_rows, row_scale, staged, experts, chosen, g_lo, g_hi, gate,
             counters)
        out.copy_(staged)
        return out
    _run(a, b, offsets, a_rows, row_scale, out, experts, chosen, g_lo, g_hi, gate, counters)
    return out


def _run(a, b, offsets, a_rows, row_scale, out, experts, config, g_lo, g_hi, gate, counters) -> None:
    _launch._install_allocator()
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(2) == 1:
        b_nk = False
    elif b.stride(1) == 1:
        b_nk = True
    else:
        b = b.contiguous()
        b_nk = False
    num_b, k, n = b.shape
    elem = b.element_size()
    # A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last.
    inner = b.stride(2) if b_nk else b.stride(1)
    b_tma = (k > 0 and b.data_ptr() % 16 == 0 and (b.stride(0) * elem) % 16 == 0 and (inner * elem) % 16 == 0
             and (_launch.interpreting() or _sm90(a.device)))
    n_groups = g_hi - g_lo
    g_block = triton.next_power_of_2(n_groups) if n_groups <= G_BLOCK_MAX else 0
    rows = out.shape[0]
    bound = (math.ceil(rows / config.block_m) + n_groups) * math.ceil(n / config.block_n)
    programs = max(1, min(config.programs or _sm_count(a.device.type, a.device.index), bound))
    if a.dtype == torch.float32:
        precision = "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    rotate = 0
    ready = err = out
    epoch = max_spin = rank = 0
    if gate is not None:
        ready, epoch, rank, err, max_spin = gate
        rotate = (rank * experts - g_lo) % n_groups
    dummy = out
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        grouped_gemm_kernel[(programs,)](
            a, a_rows if a_rows is not None else offsets, b, out, offsets,
            row_scale if row_scale is not None else dummy, ready, err,
            counters if counters is not None else dummy,
            _launch._i32(epoch), max_spin, rank, g_lo, n_groups, rotate, experts, n, k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
            BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m, P=programs,
            G_BLOCK=g_block, B_NK=b_nk, B_TMA=b_tma, GATHER=a_rows is not None, HAS_SCALE=row_scale is not None,
            GATE=gate is not None, SIGNAL=counters is not None, PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages)


def expected_tiles(offsets: torch.Tensor, *, experts: int, n: int, config: GroupedConfig,
                   sources: int | None = None) -> torch.Tensor:
    """Tiles per source rank (int32 ``[sources]``, on the device, no host sync): what one call with
    ``signal`` adds to each counter, for the groups of each source ``s`` (groups ``[s*E, (s+1)*E)``)."""
    groups = offsets.numel() - 1
    sources = math.ceil(groups / experts) if sources is None else sources
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    tiles = (counts + config.block_m - 1) // config.block_m * math.ceil(n / config.block_n)
    padded = torch.zeros(sources * experts, dtype=torch.int64, device=offsets.device)
    padded[:groups] = tiles
    return padded.view(sources, experts).sum(1).to(torch.int32)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _check_index(name: str, t, device: torch.device, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in dtypes or t.device != device:
        kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a 1-D {kinds} tensor on {device}, got {_describe(t)}")
    if t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_range(group_range, groups: int) -> tuple[int, int]:
    if group_range is None:
        return 0, groups
    if (not isinstance(group_range, tuple) or len(group_range) != 2
            or not all(isinstance(v, int) for v in group_range)):
        raise ValueError(f"group_range must be a tuple (g_lo, g_hi) of ints, got {group_range!r}")
    g_lo, g_hi = group_range
    if not 0 <= g_lo <= g_hi <= groups:
        raise ValueError(f"group_range must satisfy 0 <= g_lo <= g_hi <= G = {groups}, got {group_range}")
    return g_lo, g_hi


def _check_gate(gate, sources: int, device: torch.device) -> Gate | None:
    if gate is None:
        return None
    if not isinstance(gate, tuple) or len(gate) != 5:
        raise ValueError("gate must be a tuple (ready_flags, epoch, rank, err, max_spin)")
    ready, epoch, rank, err, max_spin = gate
    _check_index("gate ready_flags", ready, device, (torch.int32,))
    if ready.numel() < sources:
        raise ValueError(f"gate ready_flags needs one word per source rank ({sources}), got {ready.numel()}")
    if not isinstance(rank, int) or not 0 <= rank < sources:
        raise ValueError(f"gate rank must be an int in [0, {sources}), got {rank!r}")
    _check_index("gate err", err, device, (torch.int32,))
    if err.numel() != 1:
        raise ValueError(f"gate err must have one element, got {err.numel()}")
    for name, value in (("epoch", epoch), ("max_spin", max_spin)):
        if not isinstance(value, int):
            raise ValueError(f"gate {name} must be an int, got {value!r}")
    if not 0 < max_spin < 1 << 31:
        raise ValueError(f"gate max_spin must be in [1, 2**31), got {max_spin}")
    return Gate(ready, epoch, rank, err, max_spin)


def _check_signal(signal, sources: int, device: torch.device) -> torch.Tensor | None:
    if signal is None:
        return None
    if not isinstance(signal, tuple) or len(signal) != 1:
        raise ValueError("signal must be a tuple (counters,)")
    counters = signal[0]
    _check_index("signal counters", counters, device, (torch.int32,))
    if counters.numel() < sources:
        raise ValueError(f"signal counters needs one word per source rank ({sources}), got {counters.numel()}")
    return counters


def _check_offsets(offsets: torch.Tensor, rows: int) -> None:
    values = offsets.cpu()
    if values[0] != 0 or values[-1] != rows or bool((values[1:] < values[:-1]).any()):
        raise ValueError(f"offsets must start at 0, not decrease and end at P = {rows}; got {values.tolist()}")
