"""When the fused path beats the unfused one (NCCL collective + cuBLAS), per op.

Fusion hides communication behind compute but pays fixed costs per call (flag traffic, a persistent
kernel that cannot start peer tiles early, a GEMM slightly slower than cuBLAS on small tiles). Below a
problem size those costs exceed what the overlap saves. The thresholds are measured on 2x H200 (see
NOTES.md and bench/results/); the interpreter always fuses so that tests exercise the protocol.

Worked example: llama3-8b down at M=8192, TP=2 is an ``8192 x 4096 x 7168`` local GEMM (481 GFLOP);
GEMM+RS takes the chunked transport there (K_loc 7168, 4096 rows per rank), AllGather+GEMM the fused
kernel (8192 gathered rows).
"""

from __future__ import annotations

import torch

# AllGather+GEMM is fused from MIN_FUSED_ROWS_AG gathered rows, or from MIN_FUSED_GFLOP_AG (2*M*N*K of
# the local GEMM) below that. On 2x H200 the fused kernel was faster than NCCL+cuBLAS on all 25 rows of
# M 2048-16384 (1.01-1.34x); at M=1024 it was 0.63-0.98x on the three rows under 130 GFLOP and
# 1.03-1.04x on the two over 480 (bench/results/2026-11-30_h200x2_run3/).
MIN_FUSED_ROWS_AG = 2048
MIN_FUSED_GFLOP_AG = 400.0

# AllGather+GEMM transport under transport="auto": below CHUNKED_BELOW_GFLOP_AG of local GEMM work the
# chunked transport (cuBLAS on the own rows while the shards travel, then on each peer's rows), else the
# fused kernel. On 2x H200, M 2048-8192 (bench/results/2026-11-30_h200x2_run3/, ag-mesh and ag-chunked
# in one run), chunked was faster on 4 of the 5 rows under 300 GFLOP (1.12-1.29x NCCL+cuBLAS against
# 1.03-1.20x) and the fused kernel on 8 of the 10 above (1.03-1.18x against 0.99-1.08x).
CHUNKED_BELOW_GFLOP_AG = 300.0

# GEMM+RS, per transport. The store and copy-engine transports were slower than NCCL+cuBLAS on 14 and
# 15 of 15 rows (bench/results/2026-11-30_h200x2*/), so they are used only when asked for. The chunked
# transport overlaps a block's copy with the next block's GEMM: it wins when a block's GEMM outlasts its
# copy, i.e. when 2 K_loc / (GEMM rate) > 2 bytes / (copy-engine rate): K_loc above ~3300 at ~650
# TFLOP/s and ~200 GB/s on an H200; and when each owner has at least two blocks to pipeline. On 2x
# H200 it was 1.02-1.12x NCCL+cuBLAS on the 8 suite rows with K_loc >= 4096 and M/W >= 2048, and
# 0.43-1.00x on the 7 others (bench/results/2026-11-30_h200x2_run3/).
MIN_CHUNKED_K_LOCAL = 4096
MIN_CHUNKED_ROWS_PER_RANK = 2048


def _gflop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k / 1e9


def prefer_fused_all_gather(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *,
                            interpreter: bool = False) -> bool:
    """``m``: gathered rows; ``n_local``: this rank's output columns."""
    return interpreter or m >= MIN_FUSED_ROWS_AG or _gflop(m, n_local, k) >= MIN_FUSED_GFLOP_AG


def all_gather_transport(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *,
                         interpreter: bool = False) -> str:
    """``"chunked"`` or ``"mesh"`` for a fused call of ``transport="auto"``; the interpreter runs the
    kernel (``"mesh"``) so that tests exercise its protocol."""
    if interpreter or _gflop(m, n_local, k) >= CHUNKED_BELOW_GFLOP_AG:
        return "mesh"
    return "chunked"


def prefer_fused_reduce_scatter(m: int, n: int, k_local: int, world: int, dtype: torch.dtype, *,
                                interpreter: bool = False, transport: str = "chunked") -> bool:
    """``m``: rows before the scatter; ``k_local``: this rank's slice of K."""
    if interpreter:
        return True
    if transport != "chunked":
        return False
    return k_local >= MIN_CHUNKED_K_LOCAL and m // world >= MIN_CHUNKED_ROWS_PER_RANK
