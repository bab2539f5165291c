"""Single-device GEMM on the persistent kernel: the core the fused ops are built on."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from tileweave.ops import common
from tileweave.ops.compute import fp8_sm90, gemm_launch, scaling, splitk
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import FP8_DECODE_ROWS, GemmConfig
from tileweave.tune.splitk import choose_splitk_config


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.type, device.index)


@functools.cache
def _sm_count(kind: str, index: int | None) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4


def matmul(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor | None = None,
           scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: GemmConfig | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``out[M, N] = a[M, K] @ b[K, N] (+ bias[N])``, fp32 accumulation.

    ``b`` may be row-major ``[K, N]`` or the transpose of an ``nn.Linear`` weight (``weight.t()`` with
    ``weight`` ``[N, K]`` row-major), which is read in place. Inputs are float16, bfloat16 or float32,
    all on one device; the output has the input dtype.

    FP8 (torch's ``_scaled_mm`` / ``nn.functional.scaled_mm`` semantics): with ``a`` and ``b`` float8
    (e4m3fn or e5m2, either for either operand) and float32 ``scale_a``, ``scale_b``, ``out = (a *
    scale_a) @ (b * scale_b) (+ bias)`` in ``out_dtype`` (bfloat16 by default, float16 or float32).
    The scales' shapes choose the scaling: tensorwise (one element each, applied once per tile),
    rowwise (``[M, 1]`` and ``[1, N]``, an outer product in the epilogue) or blockwise (``[M, K/128]``
    per 1 x 128 block of ``a``, ``[K/128, ceil(N/128)]`` per 128 x 128 block of ``b``, applied per
    K step inside the main loop; K a multiple of 128). The bias (``out_dtype`` or float32) is added
    after scaling, in fp32. On Hopper ``b`` is best the transpose of an ``[N, K]`` weight (K-major, as
    the tensor cores read FP8). The scales are read on the device when the kernel runs (no host sync).
    ``use_fast_accum`` (torch's, default False): tensorwise and rowwise let the tensor cores accumulate
    across K steps, faster but with fewer bits kept over a long K (Hopper's FP8 MMA accumulates in
    reduced precision); by default each K step's product is added to the fp32 accumulator. Blockwise
    scaling always adds each K step's scaled product in fp32.

    On the CPU this runs in Triton's interpreter (``TRITON_INTERPRET=1``), which computes bfloat16
    wrongly: there bfloat16 inputs run in float32, a bfloat16 output is computed in float32, and the
    result is rounded to bfloat16.

    Errors (before any kernel): float8 inputs without both scales, scales on non-float8 inputs, one
    float8 operand and one not, scales of a wrong dtype, device or shape, blockwise scales with K not a
    multiple of 128, an ``out_dtype`` other than bfloat16, float16 or float32.
    """
    key = _plan_key(a, b, bias, out, config, scale_a, scale_b, out_dtype, use_fast_accum)
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        # Seen before with tensors alike in every property the launch depends on: skip the checks
        # and the derivation (tens of microseconds of host time, which small GEMMs cannot hide).
        scales, c_dtype = plan.extra
        if out is None:
            out = torch.empty((a.shape[0], b.shape[1]), dtype=c_dtype, device=a.device)
        if isinstance(plan.launch, splitk.LaunchPlan):
            splitk.relaunch(plan.launch, a, b, out, bias)
            common.record_path("matmul", "splitk")
            return out
        hopper = isinstance(plan.launch, fp8_sm90.LaunchPlan)
        if hopper and plan.launch.ready():
            fp8_sm90.relaunch(plan.launch, a, b, out, bias, scale_a, scale_b)
            common.record_path("matmul", "triton")
            return out
        if scales is not None:
            scales = dataclasses.replace(scales, a=scale_a, b=scale_b)
        if hopper:
            fp8_sm90.launch(a, b, out, bias, scales)
        else:
            gemm_launch.relaunch(plan.launch, a, b, out, bias, scales=scales)
        common.record_path("matmul", "triton")
        return out
    scaled = scaling.check_operands("matmul", a, b, scale_a, scale_b)
    c_dtype = scaling.out_dtype_of("matmul", a, out_dtype)
    if scaled:
        _check_fp8_matrix("a", a)
        _check_fp8_matrix("b", b)
    else:
        common.check_matrix("a", a)
        common.check_matrix("b", b, dtype=a.dtype, device=a.device)
    # A strided bias is copied below; a replayed launch would not copy it, so such calls are not cached.
    cacheable = key is not None and (bias is None or bias.is_contiguous())
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"a is [M={m}, K={k}] but b is {list(b.shape)}: b must be [K={k}, N]")
    n = b.shape[1]
    scales = (scaling.dense_scales("matmul", m, n, k, scale_a, scale_b, fast_accum=use_fast_accum) if scaled
              else None)
    if scaled and bias is not None and bias.dtype == torch.float32:
        bias = common.check_bias(bias, n, torch.float32, a.device)
    else:
        bias = common.check_bias(bias, n, c_dtype, a.device)
    out = common.out_or_new(out, (m, n), c_dtype, a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    if a.device.type == "cpu" and not common.interpreting():
        raise RuntimeError("tileweave.matmul on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if common.interpreting() and (a.dtype == torch.bfloat16 or scaled and c_dtype == torch.bfloat16):
        # The interpreter's bfloat16 loads, dots and stores are wrong: compute in float32, round once.
        if scaled:
            wide = matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                          bias=None if bias is None else bias.float(), config=config, use_fast_accum=use_fast_accum)
        else:
            wide = matmul(a.float(), b.float(), bias=None if bias is None else bias.float(), config=config)
        return out.copy_(wide)
    if config is None and m > FP8_DECODE_ROWS and fp8_sm90.suits(a, b, out, scales):
        hopper = fp8_sm90.launch(a, b, out, bias, scales)
        if cacheable:
            _remember(key, _Plan(hopper, (scales, c_dtype)))
        common.record_path("matmul", "triton")
        return out
    decode = None if config is not None or scaled else choose_splitk_config(
        m, n, k, a.dtype, num_sms=_num_sms(a.device), interpreter=common.interpreting())
    if decode is not None:
        launched = splitk.launch(a, b, out, bias, decode, num_sms=_num_sms(a.device))
        if cacheable:
            _remember(key, _Plan(launched, (None, c_dtype)))
        common.record_path("matmul", "splitk")
        return out
    a_copied = a.stride(1) != 1 and a.stride(0) != 1
    if a_copied:
        a = a.contiguous()
    chosen = config or select_config(m, n, k, a.dtype, a.device, num_sms=_num_sms(a.device),
                                     interpreter=common.interpreting(), out_dtype=c_dtype,
                                     scaling=None if scales is None else scales.scaling)
    programs = chosen.programs or _num_sms(a.device)
    launched = gemm_launch.launch(a=a, b=b, c=out, bias=bias, config=chosen, m_chunk=m, programs=programs,
                                  scales=scales)
    if cacheable and not a_copied:
        _remember(key, _Plan(launched, (scales, c_dtype)))
    common.record_path("matmul", "triton")
    return out


def _check_fp8_matrix(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _remember(key: tuple, plan: _Plan) -> None:
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


class _Plan(NamedTuple):
    launch: gemm_launch.LaunchPlan | fp8_sm90.LaunchPlan | splitk.LaunchPlan
    extra: tuple
    """(the scales' strides and scaling as first checked, or None; the output dtype)"""


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _plan_key(a, b, bias, out, config, scale_a, scale_b, out_dtype, fast_accum) -> tuple | None:
    """Everything about the arguments that the launch depends on, or None to take the checked path."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.dim() != 2 or b.dim() != 2:
        return None
    for t in (bias, out, scale_a, scale_b):
        if t is not None and type(t) is not torch.Tensor:
            return None
    layout = gemm_launch.layout
    return (layout(a), layout(b), layout(bias), layout(out), layout(scale_a), layout(scale_b), out_dtype, config,
            bool(fast_accum), common.interpreting(), a.dtype == torch.float32 and a.is_cuda and torch.backends.cuda.matmul.allow_tf32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[..., K]`` and ``weight`` ``[N, K]``, like
    ``torch.nn.functional.linear``, without transposing the weight in memory.

    FP8 (see ``matmul``): float8 ``x`` and ``weight`` with ``scale_a`` for the rows of ``x`` flattened to
    ``[M, K]`` (one element, ``[M, 1]`` or ``[M, K/128]``) and ``scale_b`` of ``weight.t()`` (one
    element, ``[1, N]``, or ``[K/128, ceil(N/128)]``: the transpose of the weight's ``[N/128, K/128]``
    block scales); ``use_fast_accum`` as ``matmul``'s."""
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, scale_a=scale_a, scale_b=scale_b,
               out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return y.reshape(*lead, weight.shape[0])
