"""When the fused path beats the unfused one (NCCL collective + cuBLAS), per op.

Fusion hides communication behind compute but pays fixed costs per call (flag traffic, a persistent
kernel that cannot start peer tiles early, a GEMM slightly slower than cuBLAS on small tiles). Below a
problem size those costs exceed what the overlap saves. The thresholds are measured on 2x H200 (see
NOTES.md and bench/results/); the interpreter always fuses so that tests exercise the protocol.

Worked example: llama3-8b down at M=8192, TP=2 is an ``8192 x 4096 x 7168`` local GEMM (481 GFLOP);
GEMM+RS takes the unfused path at any size for now, AllGather+GEMM the fused one.
"""

from __future__ import annotations

import torch

# Smallest local GEMM (in GFLOP, 2*M*N*K) at which the fused ops are used by default. AG+GEMM was
# faster than NCCL+cuBLAS on all 15 rows measured (M 2048-8192, 1.01-1.34x). GEMM+RS with the store
# transport was slower on 14 of 15 (0.82-0.98x), so it is not chosen on GPUs until a transport beats
# the unfused path (bench/results/2026-11-30_h200x2/).
MIN_FUSED_GFLOP_AG = 0.0
MIN_FUSED_GFLOP_RS = float("inf")


def _gflop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k / 1e9


def prefer_fused_all_gather(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *,
                            interpreter: bool = False) -> bool:
    """``m``: gathered rows; ``n_local``: this rank's output columns."""
    return interpreter or _gflop(m, n_local, k) >= MIN_FUSED_GFLOP_AG


def prefer_fused_reduce_scatter(m: int, n: int, k_local: int, world: int, dtype: torch.dtype, *,
                                interpreter: bool = False) -> bool:
    """``m``: rows before the scatter; ``k_local``: this rank's slice of K."""
    return interpreter or _gflop(m, n, k_local) >= MIN_FUSED_GFLOP_RS
