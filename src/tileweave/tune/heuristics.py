"""When the fused path beats the unfused one (NCCL collective + cuBLAS), per op.

Fusion hides communication behind compute but pays fixed costs per call (flag traffic, a persistent
kernel that cannot start peer tiles early, a GEMM slightly slower than cuBLAS on small tiles). Below a
problem size those costs exceed what the overlap saves. The thresholds are measured on 2x H200 (see
NOTES.md and bench/results/); the interpreter always fuses so that tests exercise the protocol.

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
# hosts of run10), exceed what the overlap saves. On 2x H200 with the host path of 33d4bd5, two
# processes (bench/results/2026-11-30_h200x2_run10/, mid*): llama3-8b qkv M=2048 (52 GFLOP) ran
# 0.084 / 0.094 ms chunked and 0.101 / 0.102 with the kernel against NCCL+cuBLAS's 0.125; llama3-8b
# qkv M=1024 (26 GFLOP) 0.076 / 0.163 chunked and 0.078 / 0.074 with the kernel against 0.076 / 0.074.
# (With the host path of 0da0594 the chunked transport ran 0.80x and 0.75x on those two rows, run5.)
# The threshold sits between the two. Hosts whose driver calls are twice as slow (run9) would put the
# 52 GFLOP row back under NCCL + cuBLAS.
MIN_FUSED_GFLOP_AG = 40.0

# AllGather+GEMM transport under transport="auto": below CHUNKED_BELOW_GFLOP_AG of local GEMM work the
# chunked transport (cuBLAS on the own rows while the shards travel, then on each peer's rows), else the
# fused kernel. Run4: chunked was faster on 8 of the 9 rows from 100 to 500 GFLOP (1.03-1.32x
# NCCL+cuBLAS against 0.94-1.26x), the fused kernel faster or within 1% on 12 of the 13 above. Run10
# (mid*, both next to one set of baselines, two processes): chunked faster on the rows of 86-344 GFLOP
# but llama3-8b qkv M=4096 (103: 0.190 / 0.176 against the kernel's 0.173 / 0.174); on the two rows of
# 481 GFLOP the kernel: llama3-70b gate_up M=1024 0.745 / 0.750 against 0.768 / 0.786, llama3-8b
# gate_up M=4096 0.739 / 0.751 against 0.751 / 0.752.
CHUNKED_BELOW_GFLOP_AG = 400.0

# GEMM+RS, per transport. The store and copy-engine transports were slower than NCCL+cuBLAS on 14 and
# 15 of 15 rows (bench/results/2026-11-30_h200x2*/), so they are used only when asked for. The chunked
# transport overlaps a block's copy with the next block's GEMM: it wins when a block's GEMM outlasts its
# copy, i.e. when 2 K_loc / (GEMM rate) > 2 bytes / (copy-engine rate): K_loc above ~3300 at ~650
# TFLOP/s and ~200 GB/s on an H200; with a smaller K_loc, when an owner's rows are many enough that the
# copies of the first blocks hide behind the GEMMs of the rest. On 2x H200 (NCCL+cuBLAS = 1):
# K_loc >= 4096 with M/W >= 2048: 1.02-1.12x on the 8 suite rows (bench/results/2026-11-30_h200x2_run3/);
# K_loc 2048 (N 4096): M/W 2048 0.88x, 4096 1.07x, 8192 1.50x; K_loc 3072: M/W 4096 1.19x, 8192 1.33x
# (bench/results/2026-11-30_h200x2_run6/, rs_chunked_probe). So: K_loc and M/W from 2048 each, and
# their product from 4096 x 2048.
MIN_CHUNKED_K_LOCAL = 2048
MIN_CHUNKED_ROWS_PER_RANK = 2048
MIN_CHUNKED_ROWS_X_K_LOCAL = 4096 * 2048

# The pulling chunked transport (two ranks, ``GemmReduceScatter.pull``) makes no local copy of a
# received partial, so it pays off on fewer rows. Forced on the suite's rows of M/W 512-2048 on 2x H200
# (bench/results/2026-11-30_h200x2_run9/, pullsmall_*; NCCL+cuBLAS = 1, same run): M/W 1024 with K_loc
# 4096-24576 1.01-1.08x; M/W 2048 with K_loc 2048 1.03x (1.13x in run8); M/W 1024 with K_loc 2048 and
# every M/W 512 row but one (1.04x) 0.42-0.96x, their GPU work under the host's ~150 us per call. So:
# M/W from 1024 and M/W x K_loc from 1024 x 4096.
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
# tiles, 128 x 256 tiles on 132 SMs, three interleaved rounds (bench/results/2026-11-30_h200x2_run10/,
# ag_tail_probe): faster on gpt3-175b fc1 M=4096 (23.3 waves, 0.97 full: 1.023x, as fast as cuBLAS)
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
    also needs that wave's tiles to lie in its last chunk (``_launch.ag_stream_k_tail``)."""
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


# AllGather+GEMM, chunked transport at two ranks with ``head_split``: the own rows' first GEMM covers
# only as many rows as it takes to hide the shard's push (at ~300 GB/s over NVLink; DESIGN.md measured
# 365 GB/s on 256 MB), a flag's latency and the local copies of the gathered input, at ~600 TFLOP/s;
# the second GEMM then runs over all the other rows at once. Measured on 2x H200: no faster than one GEMM
# per shard on the suite's rows (NOTES.md, entries 47 and 50), so it stays opt-in.
HEAD_SPLIT_PUSH_GBPS = 300.0
HEAD_SPLIT_LOCAL_GBPS = 1500.0
HEAD_SPLIT_LATENCY_US = 20.0
HEAD_SPLIT_TFLOPS = 600.0
HEAD_SPLIT_ROWS = 256


def all_gather_head_rows(m_chunk: int, n_local: int, k: int, itemsize: int, *, local_copies: int) -> int:
    """Rows of the own shard for the first GEMM of a head-split chunked call, a multiple of
    ``HEAD_SPLIT_ROWS``; 0 where they would be half the shard or more (two GEMMs of the shard and the
    peer's rows are then as good). ``local_copies``: device-to-device copies of a shard the call makes
    (into the gather buffer or a caller's tensor) before the second GEMM may start.

    Worked example: llama3-8b gate_up at M=4096 (shard 2048 x 4096, N_loc 14336, bf16): push 16.8 MB in
    56 us, two local copies 22 us, 20 us latency: 98 us of GEMM, 500 rows at 2 x 14336 x 4096 flop a row:
    512 rows."""
    shard_bytes = m_chunk * k * itemsize
    cover_s = (shard_bytes / (HEAD_SPLIT_PUSH_GBPS * 1e9) + local_copies * shard_bytes / (HEAD_SPLIT_LOCAL_GBPS * 1e9)
               + HEAD_SPLIT_LATENCY_US * 1e-6)
    rows = math.ceil(cover_s * HEAD_SPLIT_TFLOPS * 1e12 / (2.0 * n_local * k) / HEAD_SPLIT_ROWS) * HEAD_SPLIT_ROWS
    return rows if 0 < rows <= m_chunk // 2 else 0


def prefer_fused_reduce_scatter(m: int, n: int, k_local: int, world: int, dtype: torch.dtype, *,
                                interpreter: bool = False, transport: str = "chunked",
                                pull: bool = False) -> bool:
    """``m``: rows before the scatter; ``k_local``: this rank's slice of K; ``pull``: the chunked
    transport would pull (two ranks, ``GemmReduceScatter.pull``)."""
    if interpreter:
        return True
    if transport != "chunked":
        return False
    rows = m // world
    if pull and world == 2:
        return (k_local >= MIN_CHUNKED_K_LOCAL and rows >= MIN_PULL_ROWS_PER_RANK
                and rows * k_local >= MIN_PULL_ROWS_X_K_LOCAL)
    return (k_local >= MIN_CHUNKED_K_LOCAL and rows >= MIN_CHUNKED_ROWS_PER_RANK
            and rows * k_local >= MIN_CHUNKED_ROWS_X_K_LOCAL)
