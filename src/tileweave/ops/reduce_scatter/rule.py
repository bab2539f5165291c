"""When GEMM+ReduceScatter fuses, and whether it pulls: the op's rule under ``policy="auto"``, a pure
function of the agreed shape, the same on every rank (how the chunked transports cut rows into blocks:
``blocks``). The thresholds are measured on 2x H200; the interpreter always fuses so that tests
exercise the protocol.

Worked example: llama3-8b down at M=8192, TP=2 is an ``8192 x 4096 x 7168`` local GEMM (481 GFLOP);
GEMM+RS takes the chunked transport there (K_loc 7168, 4096 rows per rank), and for llama3-8b o at
M=8192 too (K_loc 2048, 4096 rows per rank); at M=4096 (2048 rows per rank) only where it pulls (two
ranks), and at M=2048 neither.
"""

from __future__ import annotations

import torch

# GEMM+RS, chunked transport: it overlaps a block's copy with the next block's GEMM, so it wins when a
# block's GEMM outlasts its copy, i.e. when 2 K_loc / (GEMM rate) > 2 bytes / (copy-engine rate): K_loc
# above ~3300 at ~650 TFLOP/s and ~200 GB/s on an H200; with a smaller K_loc, when an owner's rows are
# many enough that the copies of the first blocks hide behind the GEMMs of the rest. On 2x H200
# (NCCL+cuBLAS = 1): K_loc >= 4096 with M/W >= 2048: 1.02-1.12x; K_loc 2048 (N 4096): M/W 2048 0.88x,
# 4096 1.07x, 8192 1.50x; K_loc 3072: M/W 4096 1.19x, 8192 1.33x. So: K_loc and M/W from 2048 each, and
# their product from 4096 x 2048.
MIN_CHUNKED_K_LOCAL = 2048
MIN_CHUNKED_ROWS_PER_RANK = 2048
MIN_CHUNKED_ROWS_X_K_LOCAL = 4096 * 2048

# The pulling chunked transport (two ranks, ``GemmReduceScatter.pull``) makes no local copy of a
# received partial, so it pays off on fewer rows. On 2x H200 (NCCL+cuBLAS = 1): M/W 1024 with K_loc
# 4096-24576 1.01-1.08x; M/W 2048 with K_loc 2048 1.03-1.13x; M/W 1024 with K_loc 2048 and the M/W 512
# rows mostly 0.42-0.96x, their GPU work under the host's ~150 us per call. So: M/W from 1024 and
# M/W x K_loc from 1024 x 4096.
MIN_PULL_ROWS_PER_RANK = 1024
MIN_PULL_ROWS_X_K_LOCAL = 1024 * 4096


def prefer_fused_reduce_scatter(m: int, n: int, k_local: int, world: int, dtype: torch.dtype, *,
                                interpreter: bool = False, pull: bool = False) -> bool:
    """Whether GEMM+ReduceScatter's chunked transport beats GEMM + NCCL reduce-scatter. ``m``: rows
    before the scatter; ``k_local``: this rank's slice of K; ``pull``: the chunked transport would pull
    (two ranks, ``GemmReduceScatter.pull``)."""
    if interpreter:
        return True
    rows = m // world
    if pull and world == 2:
        return (k_local >= MIN_CHUNKED_K_LOCAL and rows >= MIN_PULL_ROWS_PER_RANK
                and rows * k_local >= MIN_PULL_ROWS_X_K_LOCAL)
    return (k_local >= MIN_CHUNKED_K_LOCAL and rows >= MIN_CHUNKED_ROWS_PER_RANK
            and rows * k_local >= MIN_CHUNKED_ROWS_X_K_LOCAL)


def auto_route(m: int, n: int, k_local: int, world: int, dtype: torch.dtype, *, pull: bool,
               interpreter: bool = False) -> str:
    """The route of a call under ``policy="auto"``: "fallback" (GEMM + NCCL reduce-scatter), "pull" (two
    ranks, with ``pull``) or "chunked". ``m``: rows before the scatter; ``k_local``: this rank's slice
    of K. The same on every rank: it depends on the agreed shape alone."""
    pulls = pull and world == 2
    if not prefer_fused_reduce_scatter(m, n, k_local, world, dtype, interpreter=interpreter, pull=pulls):
        return "fallback"
    return "pull" if pulls else "chunked"
