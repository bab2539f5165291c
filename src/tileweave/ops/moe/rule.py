"""Which path an MoE op takes for a shape: the one rule of the pair (``policy="auto"``)."""

from __future__ import annotations

import torch

FIXED_COST_S = 25e-6
"""What the fused paths cost a call beyond the fallback's NCCL collective and grouped GEMM: the copy
stream's join, the flag writes and the extra host work, tens of microseconds on the dense ops' GPU hosts
(a first fused AllGather+GEMM lost 25-70 us a call to two barriers and its stream joins)."""
GROUPED_FLOPS = 400e12
"""Grouped GEMM rate assumed for bf16/fp16 (the dense core reaches ~650 TFLOP/s on an H200 under the
power cap; partial row tiles of W*E groups cost a share of it); fp32 at a quarter."""
LINK_BYTES_S = 200e9
"""NCCL all-gather / reduce-scatter bus bandwidth on the dense ops' NVLink hosts (226 and 202 GB/s)."""


def choose_path(*, tokens: int, topk: int, hidden: int, f_loc: int, world: int, dtype: torch.dtype,
                interpreter: bool = False) -> str:
    """``"fused"`` or ``"fallback"`` for an MoE layer (either: both move ``[T, H]`` over the group and
    compute ``2*T*k*H*F_loc`` flops per rank). Fusing hides the smaller of the GEMM time and the
    communication time behind the larger, and costs ``FIXED_COST_S`` a call, so it is taken where that
    hidden time is at least the fixed cost: ``min(t_gemm, t_comm) >= FIXED_COST_S``. A group of one
    communicates nothing (``"local"``); emulated ranks in Triton's interpreter always fuse (there is no
    speed to win there, and the tests drive the flag protocol).

    Worked example, bf16, W = 2. Mixtral-8x7B (H 4096, F 14336, k 2), T 4096: F_loc 7168, 481 GFLOP
    -> t_gemm 1.2 ms; ``[T, H]`` is 32 MiB, half of it moved: t_comm 84 us; min 84 us >= 25 us: fused.
    Same layer at T 256: t_gemm 75 us, t_comm 5.2 us: fallback. Qwen3-30B-A3B (H 2048, F 768, k 8),
    T 8192: F_loc 384, 103 GFLOP -> 258 us, t_comm 84 us: fused; at T 2048: 64 and 21 us: fallback.
    The constants are estimates from the dense ops' measurements, not yet measured for these ops."""
    if world == 1:
        return "local"
    if interpreter:
        return "fused"
    itemsize = torch.empty((), dtype=dtype).element_size()
    rate = GROUPED_FLOPS / (4 if dtype == torch.float32 else 1)
    t_gemm = 2.0 * tokens * topk * hidden * f_loc / rate
    t_comm = (world - 1) / world * tokens * hidden * itemsize / LINK_BYTES_S
    return "fused" if min(t_gemm, t_comm) >= FIXED_COST_S else "fallback"
