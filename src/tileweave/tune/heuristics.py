"""When the fused path beats the unfused one (NCCL collective + cuBLAS), per op.

Fusion hides communication behind compute but pays fixed costs per call (flag traffic, a persistent
kernel that cannot start peer tiles early, a GEMM slightly slower than cuBLAS on small tiles). Below a
problem size those costs exceed what the overlap saves. The thresholds are measured on 2x H200; the
interpreter always fuses so that tests exercise the protocol.

Worked example: llama3-8b down at M=8192, TP=2 is an ``8192 x 4096 x 7168`` local GEMM (481 GFLOP);
GEMM+RS takes the chunked transport there (K_loc 7168, 4096 rows per rank), and for llama3-8b o at
M=8192 too (K_loc 2048, 4096 rows per rank); at M=4096 (2048 rows per rank) only where it pulls (two
ranks), and at M=2048 neither. llama3-8b qkv at M=4096 is a ``4096 x 3072 x 4096`` local GEMM (103
GFLOP): AllGather+GEMM takes its chunked transport there, and at M=2048 (52 GFLOP) too; at M=1024 (26
GFLOP) NCCL + cuBLAS. llama3-70b gate_up at M=1024 (``1024 x 28672 x 8192``, 481 GFLOP): the kernel.
"""

from __future__ import annotations

import math

import torch

from tileweave.tune.configs import wave_use

# AllGather+GEMM is fused (by the transport below) from MIN_FUSED_GFLOP_AG of local GEMM work (2*M*N_loc*K,
# M the gathered rows). Under that, a fused call's fixed costs, mostly the host's time to issue its
# copies, stream waits and flag writes (~85-100 us a call for the chunked transport on the benchmark
# hosts), exceed what the overlap saves: on 2x H200, llama3-8b qkv at M=2048 (52 GFLOP) ran chunked at
# ~0.09 ms against NCCL+cuBLAS's 0.125, at M=1024 (26 GFLOP) no faster than NCCL+cuBLAS. The threshold
# sits between the two; hosts whose driver calls are twice as slow would put the 52 GFLOP row back under
# NCCL + cuBLAS.
MIN_FUSED_GFLOP_AG = 40.0

# AllGather+GEMM transport under transport="auto": below CHUNKED_BELOW_GFLOP_AG of local GEMM work the
# chunked transport (cuBLAS on the own rows while the shards travel, then on each peer's rows), else the
# fused kernel. On 2x H200 the chunked transport was faster on the rows from ~90 to ~350 GFLOP (up to
# 1.3x NCCL+cuBLAS), the kernel faster or within 1% from ~480 GFLOP up.
CHUNKED_BELOW_GFLOP_AG = 400.0

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


def _gflop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k / 1e9


def prefer_fused_all_gather(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *,
                            interpreter: bool = False) -> bool:
    """``m``: gathered rows; ``n_local``: this rank's output columns."""
    return interpreter or _gflop(m, n_local, k) >= MIN_FUSED_GFLOP_AG


# AllGather+GEMM's kernel, its partial last wave of tiles shared by K steps over every program
# (``GemmConfig.stream_k``, ``_stream_k_tail`` in the kernel) instead of leaving the programs without a
# tile idle: from AG_STREAM_K_MIN_K (the plain GEMM's bound, configs.STREAM_K_MIN_K: shorter K did not
# earn back a segment's pipeline fill and fp32 partial), from AG_STREAM_K_MIN_WAVES full waves, and while
# whole tiles would fill less than AG_STREAM_K_BELOW of their waves. Measured on 2x H200 against whole
# tiles, 128 x 256 tiles on 132 SMs, three interleaved rounds: faster on gpt3-175b fc1 M=4096 (23.3 waves, 0.97 full: 1.023x, as fast as cuBLAS)
# and llama3-70b gate_up M=8192 (27.2 waves: 1.012x); slower from 5.8 to 19.4 waves (0.91-0.995x: fc1
# M 1024 and 2048, 70b gate_up M 2048 and 4096, 70b qkv M 8192 and 16384) and at 0.99 full (fc1 M=8192,
# 0.993x). With few waves the shared segments' fp32 partials and sums weigh more, and the idle SMs of a
# last wave cost less than their share where the power cap holds the clocks (the busy ones run faster).
AG_STREAM_K_MIN_K = 8192
AG_STREAM_K_MIN_WAVES = 20
AG_STREAM_K_BELOW = 0.98


def all_gather_stream_k(m_chunk: int, n_local: int, k: int, world: int, block_m: int, block_n: int,
                        programs: int) -> bool:
    """Whether the fused AllGather+GEMM kernel shares its last, partial wave by K steps; the kernel
    also needs that wave's tiles to lie in its last chunk (``ops.compute.gemm_launch.ag_stream_k_tail``)."""
    tiles = world * math.ceil(m_chunk / block_m) * math.ceil(n_local / block_n)
    if k < AG_STREAM_K_MIN_K or tiles < AG_STREAM_K_MIN_WAVES * programs:
        return False
    return wave_use(tiles, programs) < AG_STREAM_K_BELOW


def all_gather_transport(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *,
                         interpreter: bool = False) -> str:
    """``"chunked"`` or ``"mesh"`` for a fused call of ``transport="auto"``; the interpreter runs the
    kernel (``"mesh"``) so that tests exercise its protocol."""
    if interpreter or _gflop(m, n_local, k) >= CHUNKED_BELOW_GFLOP_AG:
        return "mesh"
    return "chunked"


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
