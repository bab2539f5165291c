"""Grouped GEMM over device-side group offsets, with rows gathered by index: the MoE layers' core."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
import triton

from tileweave.kernels.grouped_gemm import grouped_gemm_kernel
from tileweave.ops import common
from tileweave.ops.compute import scaling
from tileweave.ops.compute.gemm_launch import layout, wrap_int32
from tileweave.ops.compute.grouped_checks import check_gate, check_offsets, check_range, check_signal
from tileweave.ops.compute.quantize import _GRID, FP8_MAX, Quantized, _host_scale, quantize
from tileweave.runtime import triton_launch
from tileweave.tune.grouped import GroupedConfig, choose_grouped_config

G_BLOCK_MAX = 1024
"""Up to this many visited groups the kernel keeps every group's offsets in registers; beyond it each
program walks the groups in memory."""


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """Epilogue of an expert MLP's up projection: ``b [E, K, 2N]`` holds the gate columns ``[0, N)``
    and the up columns ``[N, 2N)`` (for a stacked ``nn.Linear`` weight ``[E, 2N, K]``: its transpose
    view); the result is ``out [P, N] = silu(a @ gate) * up`` from the fp32 accumulators, computed in
    float32 as ``gate / (1 + exp(-gate)) * up``.
    ``pre``: an optional ``[P, 2N]`` tensor of ``a``'s dtype that receives ``gate | up`` (the
    backward's input).

    ``cast``: the epilogue writes ``h``'s float8 cast instead of ``h``, as the next GEMM's first operand
    (``"tensorwise"``, ``"rowwise"`` or ``"blockwise_1x128"``, ``tileweave.ops.compute.quantize``'s
    forms, in ``cast_dtype``, scales rounded up to powers of two with ``power_of_two``), and
    ``grouped_gemm`` returns it as a ``Quantized``: ``data [P, N]`` and ``scale`` (one element,
    ``[P, 1]`` or ``[P, ceil(N/128)]``; where 128 does not divide N, a row's last block holds the
    columns left, as ``quantize(..., pad=True)`` has them). The values cast are the float32 ``h`` the
    epilogue computed, never rounded to the output dtype, and the result equals ``quantize`` of those
    values bit for bit. Blockwise takes one launch; rowwise and tensorwise two (the values in float32
    and their amaxes, then the cast). ``h`` itself is not returned."""

    pre: torch.Tensor | None = None
    cast: str | None = None
    cast_dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two: bool = False


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
                   device: torch.device, *, swiglu: bool = False, block_cast: bool = False) -> GroupedConfig:
    """The config ``grouped_gemm`` picks when given none (``tileweave.tune.grouped`` has the rule);
    ``swiglu``: with the SwiGLU epilogue (``n`` counts gate and up columns); ``block_cast``: the
    epilogue casts 1 x 128 blocks (tiles of a multiple of 128 columns)."""
    return choose_grouped_config(rows, n, k, groups, dtype, num_sms=_sm_count(device.type, device.index),
                                 interpreter=common.interpreting(), swiglu=swiglu, block_cast=block_cast)


def check_fp8(op: str, a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype, use_fast_accum: bool = False
              ) -> tuple[scaling.Scales | None, torch.dtype]:
    """A fused op's float8 arguments for ``a [Ma, K]`` and ``b [E, K, N]``, checked by name before any
    launch (``grouped_gemm``'s scale shapes, ``tileweave.ops.compute.scaling``): ``(scales, output
    dtype)``, or ``(None, a.dtype)`` for float16/bfloat16/float32 inputs after refusing scales, an
    ``out_dtype`` other than theirs and ``use_fast_accum`` there. A bfloat16 output is refused in
    Triton's interpreter, whose fused kernels compute it wrongly."""
    scaled = scaling.check_operands(op, a, b, scale_a, scale_b)
    dtype = scaling.out_dtype_of(op, a, out_dtype)
    if not scaled:
        if use_fast_accum:
            raise TypeError(f"{op}: use_fast_accum applies to float8 inputs only; a is {a.dtype}")
        return None, dtype
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: float8 operands must be a [Ma, K] and b [E, K, N], got {list(a.shape)} and "
                         f"{list(b.shape)}")
    if dtype == torch.bfloat16 and common.interpreting():
        raise TypeError(f"{op}: out_dtype is bfloat16 (the default for float8 inputs), which Triton's interpreter "
                        "(TRITON_INTERPRET=1, the CPU) computes wrongly in the fused kernels; pass "
                        "out_dtype=torch.float16 or torch.float32 on the CPU (bfloat16 runs on GPUs)")
    return scaling.grouped_scales(op, a.shape[0], b.shape[0], b.shape[2], b.shape[1], scale_a, scale_b,
                                  fast_accum=use_fast_accum), dtype


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, a_rows: torch.Tensor | None = None,
                 row_scale: torch.Tensor | None = None, experts: int | None = None,
                 out: torch.Tensor | None = None, config: GroupedConfig | None = None,
                 group_range: tuple[int, int] | None = None, gate: tuple | None = None,
                 signal: tuple | None = None, epilogue: SwiGLU | None = None,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, use_fast_accum: bool = False
                 ) -> torch.Tensor | Quantized:
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

    FP8 (``torch._scaled_grouped_mm``'s semantics, per expert): float8 ``a`` and ``b`` (e4m3fn or
    e5m2) with float32 ``scale_a`` and ``scale_b``: ``out[p] = (a[a_rows[p]] * scale_a[a_rows[p]]) @
    (b[e] * scale_b[e])`` in ``out_dtype`` (bfloat16 by default, float16, float32), fp32 accumulation.
    Tensorwise: ``scale_a`` one element, ``scale_b [E]``; rowwise: ``scale_a [Ma, 1]`` (or ``[Ma]``),
    ``scale_b [E, 1, N]`` (or ``[E, N]``); blockwise (DeepSeek-V3): ``scale_a [Ma, K/128]`` per
    1 x 128 block of a row of ``a``, ``scale_b [E, K/128, ceil(N/128)]`` per 128 x 128 block of each
    expert's ``b``, applied per K step inside the main loop (K a multiple of 128). ``scale_a``'s rows
    are ``a``'s rows: a gathered row takes its source row's scales. The scales apply before
    ``row_scale`` and the SwiGLU epilogue (whose ``pre`` has ``out_dtype``). ``use_fast_accum`` as
    ``tileweave.matmul``'s (default False: each K step's product added in fp32). In the interpreter a
    bfloat16 output is computed in float32 and rounded once.

    The row counts stay on the device: no host synchronisation (capturable in a CUDA graph). The
    offsets are checked against P only under ``TILEWEAVE_DEBUG=1`` (a host sync); out-of-range
    offsets or row indices are otherwise undefined behaviour.

    ``group_range=(g_lo, g_hi)``: compute only groups ``[g_lo, g_hi)``, visited from g_lo on; other
    rows of ``out`` are left as they are.

    ``gate=(ready_flags, epoch, rank, err, max_spin)`` (consumer of an all-gather): groups are visited
    from group ``rank * E`` on, wrapping; a tile of group g from source ``s = g // E != rank`` first
    waits, at most ``max_spin`` polls, until ``ready_flags[s]`` (int32, one word per source) reaches
    ``epoch`` (cyclic comparison). An expired wait stores ``1 + s`` in ``err`` (int32 ``[1]``, atomic
    max) and its tiles neither load nor store; the caller checks ``err`` (``common.raise_on_timeout``).

    ``signal=(counters,)``: after each finished tile of group g (its stores done), a system-scope
    release adds 1 to ``counters[g // E]`` (int32). ``expected_tiles`` gives the counts per call.

    ``epilogue``: :class:`SwiGLU` (``out`` is ``[P, N/2]``), the SwiGLU of an expert MLP fused into
    the tile's epilogue; rows of ``pre`` follow ``out``'s. With ``SwiGLU(cast=...)`` the result is the
    float8 cast of ``h`` and its scales (a ``Quantized``); ``out`` and ``group_range`` are refused.

    Concurrency: ``out`` rows of the computed groups are written, nothing else; the call is ordered on
    the current stream like any kernel.
    """
    key = _plan_key(a, b, offsets, a_rows, row_scale, experts, out, config, group_range, gate, signal, epilogue,
                    scale_a, scale_b, out_dtype, use_fast_accum)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        # First call with arguments like these: check them and derive the launch.
        plan = _prepare(a, b, offsets, a_rows, row_scale, experts, out, config, group_range, gate, signal,
                        epilogue, scale_a, scale_b, out_dtype, use_fast_accum)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    cast = None
    if plan.cast is not None:
        cast = _cast_outputs(plan, epilogue, a.device)
        out = cast[3]  # the float32 values (blockwise: never written)
    elif out is None:
        out = torch.empty((plan.rows, plan.out_n), dtype=plan.out_dtype, device=a.device)
    if common.debug_mode():
        check_offsets(offsets, plan.rows)
    pre = None if epilogue is None else epilogue.pre
    if plan.empty:
        return out if cast is None else _cast_result(plan, epilogue, cast)
    epoch = max_spin = 0
    ready = err = counters = None
    if gate is not None:
        ready, epoch, _, err, max_spin = gate
    if signal is not None:
        counters = signal[0]
    scales = (scale_a, scale_b) if plan.scaled else None
    if plan.upcast or plan.stage_out:
        # The interpreter's bfloat16 loads, dots and stores are wrong: compute in float32 and round once at
        # the end (float8 inputs stay as they are).
        staged = out if cast is not None else out.float()
        staged_pre = None if pre is None else pre.float()
        if plan.upcast:
            a, b = a.float(), b.float()
        _run(plan, a, b, offsets, a_rows, row_scale, staged, ready, err, counters, epoch, max_spin, staged_pre,
             scales, cast)
        if staged is not out:
            out.copy_(staged)
        if pre is not None:
            pre.copy_(staged_pre)
    else:
        _run(plan, a, b, offsets, a_rows, row_scale, out, ready, err, counters, epoch, max_spin, pre, scales, cast)
    return out if cast is None else _cast_result(plan, epilogue, cast)


def _cast_outputs(plan: "_Plan", epilogue: SwiGLU, device: torch.device) -> tuple:
    """``(data, scale, amax, values)`` of a call with ``SwiGLU(cast=...)``. Blockwise: the float8 ``h`` and
    its scales, which the kernel writes (the last two stand in for tensors it does not use). Rowwise and
    tensorwise: the zeroed amax words (one per row, or one) and the float32 values that the second
    launch casts (the first two stand in for tensors the kernel does not use)."""
    rows, n = plan.rows, plan.out_n
    if plan.cast == "1x128":
        data = torch.empty((rows, n), dtype=epilogue.cast_dtype, device=device)
        scale = torch.empty((rows, -(-n // scaling.BLOCK)), dtype=torch.float32, device=device)
        return data, scale, data, data
    values = torch.empty((rows, n), dtype=torch.float32, device=device)
    amax = torch.zeros(1 if plan.cast == "tensor" else rows, dtype=torch.float32, device=device)
    return values, amax, amax, values


def _cast_result(plan: "_Plan", epilogue: SwiGLU, cast: tuple) -> Quantized:
    data, scale, amax, values = cast
    if plan.cast != "1x128":  # the second launch: the cast with the amaxes the tiles raised
        return quantize(values, "tensorwise" if plan.cast == "tensor" else "rowwise", dtype=epilogue.cast_dtype,
                        power_of_two=epilogue.power_of_two, amax=None if plan.empty else amax)
    if plan.empty:  # no element: the scales of all-zero groups, as quantize gives them
        data.zero_()
        scale.fill_(_host_scale(0.0, epilogue.cast_dtype, epilogue.power_of_two))
    return Quantized(data, scale)


@dataclasses.dataclass
class _Plan:
    """What a launch derives from the arguments' shapes, strides, dtypes and alignment (the key of
    ``_plans``): later calls with arguments alike in all of those skip the checks and the derivation."""

    rows: int
    n: int
    empty: bool
    out_n: int = 0
    """Columns of ``out``: ``n``, or ``n / 2`` under ``SwiGLU``."""
    cast: str | None = None
    """The kernel's ``CAST`` group (``"tensor"``, ``"row"``, ``"1x128"``) under ``SwiGLU(cast=...)``."""
    upcast: bool = False
    stage_out: bool = False
    """Float8 inputs, bfloat16 output, in the interpreter: the kernel writes float32, rounded after (``pre``
    only, under ``SwiGLU(cast=...)``, whose values are float32)."""
    out_dtype: torch.dtype | None = None
    scaled: bool = False
    copy_a: bool = False
    copy_b: bool = False
    scalars: tuple = ()
    """rank, g_lo, n_groups, rotate, E, N, K and the strides."""
    constexprs: dict = dataclasses.field(default_factory=dict)
    programs: int = 1
    num_warps: int = 4
    num_stages: int = 1
    compiled: list = dataclasses.field(default_factory=list)
    """The compiled kernel once known (CUDA): later calls launch it with pointers as ints."""


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _plan_key(a, b, offsets, a_rows, row_scale, experts, out, config, group_range, gate, signal,
              epilogue, scale_a, scale_b, out_dtype, fast_accum) -> tuple | None:
    """Everything about the arguments that the launch depends on, or None to take the checked path."""
    epilogue_key = None
    if epilogue is not None:
        if type(epilogue) is not SwiGLU or epilogue.pre is not None and type(epilogue.pre) is not torch.Tensor:
            return None
        epilogue_key = ("swiglu", layout(epilogue.pre), epilogue.cast, epilogue.cast_dtype, epilogue.power_of_two)
    for t in (a, b, offsets, a_rows, row_scale, out, scale_a, scale_b):
        if t is not None and type(t) is not torch.Tensor:
            return None
    if config is not None and type(config) is not GroupedConfig or experts is not None and type(experts) is not int \
            or group_range is not None and (type(group_range) is not tuple or len(group_range) != 2):
        return None
    gate_key = None
    if gate is not None:
        if type(gate) is not tuple or len(gate) != 5 or type(gate[0]) is not torch.Tensor \
                or type(gate[3]) is not torch.Tensor or type(gate[1]) is not int or type(gate[2]) is not int \
                or type(gate[4]) is not int or not 0 < gate[4] < 1 << 31:
            return None
        gate_key = (layout(gate[0]), layout(gate[3]), gate[2])
    signal_key = None
    if signal is not None:
        if type(signal) is not tuple or len(signal) != 1 or type(signal[0]) is not torch.Tensor:
            return None
        signal_key = layout(signal[0])
    return (layout(a), layout(b), layout(offsets), layout(a_rows), layout(row_scale), layout(out), experts, config,
            group_range, gate_key, signal_key, epilogue_key, layout(scale_a), layout(scale_b), out_dtype,
            bool(fast_accum), common.interpreting(), G_BLOCK_MAX,
            a.dtype == torch.float32 and a.is_cuda and torch.backends.cuda.matmul.allow_tf32)


CASTS = {"tensorwise": "tensor", "rowwise": "row", "blockwise_1x128": "1x128"}
"""``SwiGLU.cast``'s forms and the kernel's ``CAST`` group of each."""


def _check_epilogue(epilogue, rows: int, n: int, dtype: torch.dtype, device: torch.device,
                    row_scale, out, group_range) -> int:
    """The width of ``out`` under ``epilogue`` after checking its tensors."""
    if epilogue is None:
        return n
    if not isinstance(epilogue, SwiGLU):
        raise TypeError(f"epilogue must be None or SwiGLU, got {type(epilogue).__name__}")
    if n % 2:
        raise ValueError(f"SwiGLU: b must hold gate and up columns [E, K, 2N], got {n} columns (odd)")
    if row_scale is not None:
        raise ValueError("SwiGLU: row_scale does not apply to the up projection's epilogue; pass None")
    if epilogue.pre is not None:
        common.check_out(epilogue.pre, (rows, n), dtype, device, name="SwiGLU pre")
    if epilogue.cast is not None:
        if epilogue.cast not in CASTS:
            raise ValueError(f"SwiGLU: cast must be None or one of {', '.join(CASTS)}, got {epilogue.cast!r}")
        if epilogue.cast_dtype not in scaling.FP8_DTYPES:
            raise TypeError(f"SwiGLU: cast_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                            f"{epilogue.cast_dtype}")
        if not isinstance(epilogue.power_of_two, bool):
            raise TypeError(f"SwiGLU: power_of_two must be a bool, got {epilogue.power_of_two!r}")
        if out is not None or group_range is not None:
            raise ValueError("SwiGLU(cast=...): the result is the float8 h and its scales, written whole; pass "
                             "neither out nor group_range")
    return n // 2


def _prepare(a, b, offsets, a_rows, row_scale, experts, out, config, group_range, gate, signal, epilogue,
             scale_a, scale_b, out_dtype, fast_accum=False) -> _Plan:
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"b must be a 3-D tensor [E, K, N], got {common.describe(b)}")
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
    scaled = scaling.check_operands("grouped_gemm", a, b, scale_a, scale_b)
    c_dtype = scaling.out_dtype_of("grouped_gemm", a, out_dtype)
    if scaled:
        if a.dim() != 2:
            raise ValueError(f"a must be 2-D, got shape {tuple(a.shape)}")
    else:
        common.check_matrix("a", a)
        common.check_matrix("b[0]", b[0], dtype=a.dtype, device=a.device)
    num_b, k, n = b.shape
    if a.shape[1] != k:
        raise ValueError(f"a is [Ma, K={a.shape[1]}] but b is {list(b.shape)}: b must be [E, K={a.shape[1]}, N]")
    experts = num_b if experts is None else experts
    if not isinstance(experts, int) or not 1 <= experts <= num_b:
        raise ValueError(f"experts must be an int from 1 to b.shape[0] = {num_b}, got {experts!r}")
    common.check_index("offsets", offsets, a.device, (torch.int32,))
    if offsets.numel() < 1:
        raise ValueError("offsets must have G + 1 >= 1 entries, got none")
    groups = offsets.numel() - 1
    if a_rows is not None:
        common.check_index("a_rows", a_rows, a.device, (torch.int32, torch.int64))
        rows = a_rows.numel()
    else:
        rows = a.shape[0]
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or row_scale.shape != (rows,) or row_scale.dtype != torch.float32 \
                or row_scale.device != a.device:
            raise ValueError(f"row_scale must be a float32 tensor of shape ({rows},) on {a.device}, "
                             f"got {common.describe(row_scale)}")
    scales = (scaling.grouped_scales("grouped_gemm", a.shape[0], num_b, n, k, scale_a, scale_b,
                                     fast_accum=fast_accum) if scaled else None)
    out_n = _check_epilogue(epilogue, rows, n, c_dtype, a.device, row_scale, out, group_range)
    common.check_out(out, (rows, out_n), c_dtype, a.device)
    cast = None if epilogue is None or epilogue.cast is None else CASTS[epilogue.cast]
    g_lo, g_hi = check_range(group_range, groups)
    sources = math.ceil(groups / experts)
    gate = check_gate(gate, sources, a.device)
    check_signal(signal, sources, a.device)
    swiglu = isinstance(epilogue, SwiGLU)
    n_tile = n // 2 if swiglu else n
    if rows == 0 or n == 0 or g_hi == g_lo:
        return _Plan(rows=rows, n=n, empty=True, out_n=out_n, out_dtype=c_dtype, cast=cast)
    if a.device.type == "cpu" and not common.interpreting():
        raise RuntimeError("grouped_gemm on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    config = config or grouped_config(rows, n, k, groups, a.dtype, a.device, swiglu=swiglu,
                                      block_cast=cast == "1x128")
    if not isinstance(config, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig, got {type(config).__name__}")
    if cast == "1x128" and config.block_n % scaling.BLOCK:
        raise ValueError(f"SwiGLU(cast='blockwise_1x128') needs GroupedConfig.block_n to be a multiple of "
                         f"{scaling.BLOCK} (each 1 x 128 block in one tile), got {config.block_n}")
    if scales is not None and scales.kernel_mode == "block" and scaling.BLOCK % config.block_k:
        raise ValueError(f"grouped_gemm: blockwise scales need GroupedConfig.block_k to divide {scaling.BLOCK}, "
                         f"got {config.block_k}")
    stage_out = scaled and c_dtype == torch.bfloat16 and common.interpreting()
    upcast = a.dtype == torch.bfloat16 and common.interpreting()
    if upcast:
        a, b = a.float(), b.float()
    copy_a = a.stride(1) != 1
    if copy_a:
        a = a.contiguous()
    if b.stride(2) == 1:
        b_nk, copy_b = False, False
    elif b.stride(1) == 1:
        b_nk, copy_b = True, False
    else:
        b, b_nk, copy_b = b.contiguous(), False, True
    elem = b.element_size()
    # A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last.
    inner = b.stride(2) if b_nk else b.stride(1)
    b_tma = (k > 0 and b.data_ptr() % 16 == 0 and (b.stride(0) * elem) % 16 == 0 and (inner * elem) % 16 == 0
             and (common.interpreting() or _sm90(a.device)))
    # The SwiGLU tile's box pairs gate and up rows of an nn.Linear weight ([E, 2N, K], read as its
    # transpose): other layouts load by pointers.
    b_tma = b_tma and (not swiglu or b_nk)
    n_groups = g_hi - g_lo
    g_block = triton.next_power_of_2(n_groups) if n_groups <= G_BLOCK_MAX else 0
    bound = (math.ceil(rows / config.block_m) + n_groups) * math.ceil(n_tile / config.block_n)
    programs = max(1, min(config.programs or _sm_count(a.device.type, a.device.index), bound))
    if a.dtype == torch.float32:
        precision = "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    rank = rotate = 0
    if gate is not None:
        rank = gate.rank
        rotate = (rank * experts - g_lo) % n_groups
    # With a cast, c is the float32 values (or unused) and the float8 h and its scales are contiguous
    # (_cast_outputs); the format's constants are quantize's.
    out_strides = (out_n, 1) if out is None or cast is not None else out.stride()
    pre_stride = 0 if epilogue is None or epilogue.pre is None else epilogue.pre.stride(0)
    fmt = epilogue.cast_dtype if cast is not None else torch.float8_e4m3fn
    blocks = -(-out_n // scaling.BLOCK)
    cast_strides = (out_n, blocks, 1) if cast == "1x128" else (0, 0, 0)
    constexprs = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m, P=programs,
                      G_BLOCK=g_block, B_NK=b_nk, B_TMA=b_tma, GATHER=a_rows is not None,
                      HAS_SCALE=row_scale is not None, GATE=gate is not None, SIGNAL=signal is not None,
                      PRECISION=precision, FLATTEN=config.flatten and g_block > 0 and gate is None,
                      SWIGLU=swiglu, SAVE_PRE=swiglu and epilogue.pre is not None,
                      SCALING=None if scales is None else scales.kernel_mode, CAST=cast, FP8_MAX=FP8_MAX[fmt],
                      MANT=_GRID[fmt][0], MIN_EXP=_GRID[fmt][1], POW2=cast is not None and epilogue.power_of_two)
    scalars = (rank, g_lo, n_groups, rotate, experts, n_tile, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
               b.stride(2), *out_strides, pre_stride,
               *((0,) * 5 if scales is None else (*scales.a_strides, *scales.b_strides)), *cast_strides)
    return _Plan(rows=rows, n=n, empty=False, upcast=upcast, stage_out=stage_out, out_dtype=c_dtype, scaled=scaled,
                 copy_a=copy_a, copy_b=copy_b, scalars=scalars,
                 constexprs=constexprs, programs=programs, num_warps=config.num_warps, num_stages=config.num_stages,
                 out_n=out_n, cast=cast)


def _run(plan: _Plan, a, b, offsets, a_rows, row_scale, out, ready, err, counters, epoch, max_spin,
         pre=None, scales=None, cast=None) -> None:
    if plan.copy_a:
        a = a.contiguous()
    if plan.copy_b:
        b = b.contiguous()
    tensors = (a, offsets if a_rows is None else a_rows, b, out, offsets, out if row_scale is None else row_scale,
               out if ready is None else ready, out if err is None else err, out if counters is None else counters,
               out if pre is None else pre, *(scales or (out, out)), *(cast[:3] if cast else (out,) * 3))
    scalars = (wrap_int32(epoch), max_spin, *plan.scalars)
    if plan.compiled and torch.cuda.current_device() == a.device.index:
        triton_launch.launch_compiled(plan.compiled[0], a.device.index, plan.programs,
                                 (*(t.data_ptr() for t in tensors), *scalars), tuple(plan.constexprs.values()))
        return
    triton_launch.install_allocator()
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        kernel = grouped_gemm_kernel[(plan.programs,)](*tensors, *scalars, **plan.constexprs,
                                                       num_warps=plan.num_warps, num_stages=plan.num_stages)
    if a.is_cuda and triton_launch.FAST:
        plan.compiled.append(triton_launch.kept(kernel))




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
