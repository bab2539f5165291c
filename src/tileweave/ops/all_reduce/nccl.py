"""The unfused transport of GEMM + AllReduce: a GEMM, the group's all-reduce (NCCL on GPUs, gloo on the
CPU), then the bias, the residual add and the RMSNorm in torch. It is the baseline the fused transports
are measured against, the path for shapes where neither of them wins, and what a non-graphable op runs
under CUDA-graph capture (NCCL captures; the fused transports' epochs would not advance on replay).

The GEMM is torch's (cuBLAS on GPUs). On GPUs the partial goes through NCCL in its own dtype, as
Megatron-style TP layers do; on the CPU the GEMM and the all-reduce are fp32 (CPU bfloat16 then comes
out right, unlike Triton's interpreted bfloat16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.ops.compute.matmul import matmul
from tileweave.runtime.backend import Backend


def rms_norm_into(resid: torch.Tensor, norm_weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = resid * rsqrt(mean(resid**2, -1) + eps) * norm_weight`` in fp32, rounded to ``out``'s dtype."""
    x = resid.float()
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    out.copy_(x * scale * norm_weight.float())


def epilogue(total: torch.Tensor, bias, residual, norm_weight, eps: float, y: torch.Tensor,
             resid: torch.Tensor | None) -> None:
    """From the fp32 sum over ranks: ``y = total (+ bias) (+ residual)``, or with ``norm_weight``
    ``resid = total (+ bias) + residual`` and ``y = rmsnorm(resid) * norm_weight`` (the norm of the
    rounded ``resid``, as a separate RMSNorm after the add would see it)."""
    if bias is not None:
        total = total + bias.float()
    if residual is not None:
        total = total + residual.float()
    if norm_weight is None:
        y.copy_(total)
        return
    resid.copy_(total)
    rms_norm_into(resid, norm_weight, eps, y)


def run(backend: Backend, a: torch.Tensor, b: torch.Tensor, bias, residual, norm_weight, eps: float,
        y: torch.Tensor, resid: torch.Tensor | None, scales: tuple | None = None) -> None:
    """The whole call on the unfused path; writes ``y`` (and ``resid`` with a norm). ``scales``: the
    scaled FP8 GEMM's ``(scale_a, scale_b)`` (tileweave's, its partial in ``y``'s dtype on GPUs, fp32
    on the CPU). ``b`` None: ``a`` is this rank's partial itself (``GemmAllReduce.all_reduce``)."""
    if b is None:
        # a fresh tensor (the all-reduce works in place), fp32 on the CPU as the GEMM form's
        partial = a.clone() if a.is_cuda else a.to(torch.float32, copy=True)
        if backend.world_size > 1:
            dist.all_reduce(partial, group=backend.group)
        total = partial.float()
    elif scales is not None:
        partial = matmul(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=y.dtype if a.is_cuda else torch.float32)
        if backend.world_size > 1:
            dist.all_reduce(partial, group=backend.group)
        total = partial.float()
    elif a.is_cuda:
        partial = torch.matmul(a, b)
        if backend.world_size > 1:
            dist.all_reduce(partial, group=backend.group)
        total = partial.float()
    else:
        partial = torch.mm(a.float(), b.float())
        if backend.world_size > 1:
            dist.all_reduce(partial, group=backend.group)
        total = partial
    epilogue(total, bias, residual, norm_weight, eps, y, resid)
