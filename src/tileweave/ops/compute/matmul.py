"""Single-device GEMM on the persistent kernel: the core the fused ops are built on."""

from __future__ import annotations

import functools

import torch

from tileweave.ops import common
from tileweave.ops.compute import gemm_launch
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import GemmConfig


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.type, device.index)


@functools.cache
def _sm_count(kind: str, index: int | None) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """``out[M, N] = a[M, K] @ b[K, N] (+ bias[N])``, fp32 accumulation.

    ``b`` may be row-major ``[K, N]`` or the transpose of an ``nn.Linear`` weight (``weight.t()`` with
    ``weight`` ``[N, K]`` row-major), which is read in place. Inputs are float16, bfloat16 or float32,
    all on one device; the output has the input dtype. On the CPU this runs in Triton's interpreter
    (``TRITON_INTERPRET=1``), which computes bfloat16 wrongly: there bfloat16 inputs run in float32
    and the result is rounded to bfloat16.
    """
    key = _plan_key(a, b, bias, out, config)
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        # Seen before with tensors alike in every property the launch depends on: skip the checks
        # and the derivation (tens of microseconds of host time, which small GEMMs cannot hide).
        if out is None:
            out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        gemm_launch.relaunch(plan, a, b, out, bias)
        common.record_path("matmul", "triton")
        return out
    common.check_matrix("a", a)
    common.check_matrix("b", b, dtype=a.dtype, device=a.device)
    # A strided bias is copied below; a replayed launch would not copy it, so such calls are not cached.
    cacheable = key is not None and (bias is None or bias.is_contiguous())
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"a is [M={m}, K={k}] but b is {list(b.shape)}: b must be [K={k}, N]")
    n = b.shape[1]
    bias = common.check_bias(bias, n, a.dtype, a.device)
    out = common.out_or_new(out, (m, n), a.dtype, a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    if a.device.type == "cpu" and not common.interpreting():
        raise RuntimeError("tileweave.matmul on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if a.dtype == torch.bfloat16 and common.interpreting():
        wide = matmul(a.float(), b.float(), bias=None if bias is None else bias.float(), config=config)
        return out.copy_(wide)
    a_copied = a.stride(1) != 1 and a.stride(0) != 1
    if a_copied:
        a = a.contiguous()
    chosen = config or select_config(m, n, k, a.dtype, a.device, num_sms=_num_sms(a.device),
                                     interpreter=common.interpreting())
    programs = chosen.programs or _num_sms(a.device)
    launched = gemm_launch.launch(a=a, b=b, c=out, bias=bias, config=chosen, m_chunk=m, programs=programs)
    if cacheable and not a_copied:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = launched
    common.record_path("matmul", "triton")
    return out


_plans: dict[tuple, gemm_launch.LaunchPlan] = {}
_MAX_PLANS = 4096


def _plan_key(a, b, bias, out, config) -> tuple | None:
    """Everything about the arguments that the launch depends on, or None to take the checked path."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.dim() != 2 or b.dim() != 2:
        return None
    if bias is not None and type(bias) is not torch.Tensor or out is not None and type(out) is not torch.Tensor:
        return None
    layout = gemm_launch.layout
    return (layout(a), layout(b), layout(bias), layout(out), config, common.interpreting(),
            a.dtype == torch.float32 and a.is_cuda and torch.backends.cuda.matmul.allow_tf32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[..., K]`` and ``weight`` ``[N, K]``, like
    ``torch.nn.functional.linear``, without transposing the weight in memory."""
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias)
    return y.reshape(*lead, weight.shape[0])
