"""Single-device GEMM on the persistent kernel: the core the fused ops are built on."""

from __future__ import annotations

import functools

import torch

from tileweave.ops import _launch
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
    (``TRITON_INTERPRET=1``).
    """
    _launch.check_matrix("a", a)
    _launch.check_matrix("b", b, dtype=a.dtype, device=a.device)
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"a is [M={m}, K={k}] but b is {list(b.shape)}: b must be [K={k}, N]")
    n = b.shape[1]
    bias = _launch.check_bias(bias, n, a.dtype, a.device)
    out = _launch.check_out(out, (m, n), a.dtype, a.device)
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    if a.device.type == "cpu" and not _launch.interpreting():
        raise RuntimeError("tileweave.matmul on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if a.stride(1) != 1 and a.stride(0) != 1:
        a = a.contiguous()
    config = config or select_config(m, n, k, a.dtype, a.device, num_sms=_num_sms(a.device),
                                     interpreter=_launch.interpreting())
    programs = config.programs or _num_sms(a.device)
    _launch.launch(mode=_launch.MODE_PLAIN, a=a, b=b, c=out, bias=bias, config=config, m_chunk=m,
                   programs=programs)
    _launch.record_path("matmul", "triton")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[..., K]`` and ``weight`` ``[N, K]``, like
    ``torch.nn.functional.linear``, without transposing the weight in memory."""
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias)
    return y.reshape(*lead, weight.shape[0])
