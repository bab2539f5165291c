"""What produces a TP linear's input, fused into the linear: an RMSNorm before a column-parallel linear,
a SwiGLU before a row-parallel one (``ColumnParallelLinear(x, norm=...)``,
``RowParallelLinear(gate_up, swiglu=True)``).

Without FP8 the producer runs first, in torch, and the linear takes its output as before. With an FP8
recipe the producer's output is cast to float8 by the kernel that computes it
(``tileweave.ops.compute.fused_quantize``), never written in high precision; the backward here takes
the gradient of the producer's output from the linear's input-gradient GEMM and returns those of the
producer's inputs, each in one kernel (``tileweave.ops.compute.rms_norm``, ``tileweave.ops.compute.swiglu``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tileweave.ops.compute import swiglu as swiglu_ops
from tileweave.ops.compute.rms_norm import rms_norm_grad


def check_norm(owner: str, norm, x: torch.Tensor) -> None:
    """Refuse a ``norm`` that is not an ``nn.RMSNorm`` over ``x``'s last dimension."""
    if not isinstance(norm, nn.RMSNorm):
        raise TypeError(f"{owner}: norm must be a torch.nn.RMSNorm, got {type(norm).__name__}")
    if tuple(norm.normalized_shape) != (x.shape[-1],):
        raise ValueError(f"{owner}: norm normalizes shape {tuple(norm.normalized_shape)}, but the input's last "
                         f"dimension is {x.shape[-1]}; the fused norm takes one over the last dimension")


def norm_eps(norm: nn.RMSNorm, x: torch.Tensor) -> float:
    """``norm``'s epsilon, or torch's default for ``x``'s dtype where it has none."""
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


def check_swiglu(owner: str, x: torch.Tensor, in_features: int) -> None:
    """Refuse a ``gate | up`` input whose last dimension is not twice ``in_features``."""
    if x.shape[-1] != 2 * in_features:
        raise ValueError(f"{owner}: with swiglu=True the input is gate | up, [..., 2 * {in_features}] for this "
                         f"rank's {in_features} input features; got {list(x.shape)}")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = gate | up`` (the two halves of its last dimension), in torch."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor):
    """``(dx, dweight)`` of ``y = x * rstd * weight`` (``rstd [M]`` of the rows of ``x [M, H]``) for the
    gradient ``dy [M, H]``: ``dx`` in ``x``'s dtype, ``dweight`` (the sum over this rank's rows) in the
    weight's; None without a weight. One fused pass over the rows (``rms_norm_grad``)."""
    return rms_norm_grad(dy, x, weight, rstd)


def swiglu_backward(dh: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x = gate | up`` (``[M, 2F]``) for the gradient ``dh [M, F]`` of ``silu(gate) * up``,
    in ``x``'s dtype (``dh`` of that dtype too): one kernel, math in float32
    (``tileweave.ops.compute.swiglu.swiglu_backward``)."""
    return swiglu_ops.swiglu_backward(dh, x)
