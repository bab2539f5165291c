"""When AllGather+GEMM fuses, by which transport, and whether its kernel shares its last wave by K steps:
the op's rule under ``policy="auto"``, a pure function of the agreed shape, the same on every rank.

Fusion hides communication behind compute but pays fixed costs per call (flag traffic, a persistent
kernel that cannot start peer tiles early, a GEMM slightly slower than cuBLAS on small tiles). Below a
problem size those costs exceed what the overlap saves. The thresholds are measured on 2x H200; the
interpreter always fuses so that tests exercise the protocol.

Worked example: llama3-8b qkv at M=4096 is a ``4096 x 3072 x 4096`` local GEMM (103 GFLOP):
AllGather+GEMM takes its chunked transport there, and at M=2048 (52 GFLOP) too; at M=1024 (26 GFLOP)
NCCL + cuBLAS. llama3-70b gate_up at M=1024 (``1024 x 28672 x 8192``, 481 GFLOP): the kernel.
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


def auto_route(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *, interpreter: bool = False,
               transport: str = "auto") -> str:
    """The route of a call under ``policy="auto"``: "fallback" (NCCL + cuBLAS), or the fused transport
    (``transport``, or under "auto" "chunked" or "mesh" by ``all_gather_transport``).
    ``m``: gathered rows; ``n_local``: this rank's output columns. The same on every rank: it depends on
    the agreed shape alone."""
    if not prefer_fused_all_gather(m, n_local, k, world, dtype, interpreter=interpreter):
        return "fallback"
    return fused_transport(m, n_local, k, world, dtype, interpreter=interpreter, transport=transport)


def fused_transport(m: int, n_local: int, k: int, world: int, dtype: torch.dtype, *, interpreter: bool,
                    transport: str) -> str:
    if transport == "auto":
        return all_gather_transport(m, n_local, k, world, dtype, interpreter=interpreter)
    return transport
