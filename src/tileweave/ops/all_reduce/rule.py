"""Which transport a GEMM + AllReduce call of one shape takes under ``policy="auto"``.

The GEMM is the same on every path (the rank's ``[M, K_loc] x [K_loc, N]`` partial), so the rule compares
only the time to sum the W partials of ``B = M * N * itemsize`` bytes each onto every rank:

* one-shot: one kernel; every rank reads the W-1 peers' whole partials over NVLink:
  ``T_LAUNCH + T_FLAG + (W-1) * B / bw``;
* two-shot: one kernel in two phases; every rank reads its share of the rows (``ceil(M/W)`` at most) of
  the W-1 peers' partials, then the W-1 peers' reduced rows:
  ``T_LAUNCH + 2 * T_FLAG + 2 * (W-1) * ceil(M/W) * N * itemsize / bw`` (``2 (W-1)/W * B`` where W divides M);
* NCCL: ``NCCL_LATENCY + 2 * (W-1)/W * B / NCCL_BUS_BW`` (ring all-reduce, bus bandwidth).

``bw`` is what the kernel's programs can pull: ``min(PEER_BW, programs * SM_PULL_BW)``, with one program
per block of rows (``rows_per_program``), so one row is read by one SM and the smallest M reads slowly.
Two-shot moves less than one-shot from W = 3 on, and pays a second flag round trip; at W = 2 both read
``B`` per rank and one-shot always wins. A fused transport also needs its two slots of the call's
output in symmetric memory: above ``FUSED_MAX_BYTES`` the call takes NCCL.

Worked example (Llama-3-70B ``o_proj``, N = 8192, bf16, on H200s with 132 SMs):

* TP = 8, M = 8: B = 128 KiB. One-shot: 4 blocks of 2 rows, bw = 4 x 20 = 80 GB/s:
  4 + 2 + 7 x 128 KiB / 80 GB/s = 17.5 us. Two-shot: one row per rank, one block, bw = 20 GB/s:
  4 + 4 + 2 x 7 x 16 KiB / 20 GB/s = 19.5 us. NCCL: 20 + 1.75 x 128 KiB / 200 GB/s = 21.1 us: **one-shot**.
* TP = 8, M = 256: B = 4 MiB. One-shot: 128 blocks, bw = 365 GB/s: 6 + 7 x 4 MiB / 365 GB/s = 86.4 us.
  Two-shot: 32 rows per rank in 16 blocks, bw = 320 GB/s: 8 + 2 x 7 x 512 KiB / 320 GB/s = 30.9 us. NCCL:
  20 + 1.75 x 4 MiB / 200 GB/s = 56.7 us: **two-shot** (it takes over from one-shot at M ~ 100 here).
* TP = 2, M = 64: B = 1 MiB. One-shot 6 + 1 MiB / 365 GB/s = 8.9 us, two-shot 11.3 us, NCCL
  20 + 1 MiB / 200 GB/s = 25.2 us: **one-shot** (at TP = 2 it always beats two-shot).

These constants are estimates from measurements (docs/design.md, "Measuring": copy-engine peer pull
365 GB/s, NCCL bus bandwidth ~200 GB/s; NCCL all-reduce latency 15-25 us) and from what one SM's loads
over NVLink typically reach; they are to be measured on GPUs (``tileweave bench --op decode``) and replaced.
"""

from __future__ import annotations

T_LAUNCH = 4e-6
"""Seconds: a kernel's launch and start inside a CUDA graph."""
T_FLAG = 2e-6
"""Seconds: one flag's round trip between two GPUs over NVLink (release, then a peer's acquire poll)."""
PEER_BW = 365e9
"""Bytes/s one GPU pulls from its peers over NVLink (the copy engines' 365 GB/s on H200)."""
SM_PULL_BW = 20e9
"""Bytes/s one program (one SM) pulls over NVLink with plain loads."""
NCCL_LATENCY = 20e-6
"""Seconds: an NCCL all-reduce of a few KiB on NVLink (15-25 us measured)."""
NCCL_BUS_BW = 200e9
"""Bytes/s: NCCL's bus bandwidth (all-gather 226, reduce-scatter 202 GB/s measured)."""
FUSED_MAX_BYTES = 64 << 20
"""Symmetric memory one op may hold for its two slots of a call's output (and residual sum)."""
MAX_ROWS_PER_PROGRAM = 16
"""Rows one program of the fused kernels owns at most (its registers hold a [rows, BN] fp32 tile)."""


def rows_per_program(rows: int, programs: int) -> int:
    """Rows per block of the fused kernels for ``rows`` rows over at most ``programs`` programs: the
    smallest power of two (2 at least) that needs no more programs, capped at ``MAX_ROWS_PER_PROGRAM``."""
    per = 2
    while per < MAX_ROWS_PER_PROGRAM and per * programs < rows:
        per *= 2
    return per


def _bandwidth(rows: int, programs: int) -> float:
    blocks = -(-rows // rows_per_program(rows, programs))
    return min(PEER_BW, min(blocks, programs) * SM_PULL_BW)


def estimates(m: int, n: int, world: int, itemsize: int, programs: int) -> dict[str, float]:
    """Seconds each transport is expected to take to all-reduce an ``[m, n]`` partial (module docstring)."""
    b = m * n * itemsize
    chunk = -(-m // world)
    return {
        "oneshot": T_LAUNCH + T_FLAG + (world - 1) * b / _bandwidth(m, programs),
        "twoshot": T_LAUNCH + 2 * T_FLAG + 2 * (world - 1) * chunk * n * itemsize / _bandwidth(chunk, programs),
        "fallback": NCCL_LATENCY + 2 * (world - 1) / world * b / NCCL_BUS_BW,
    }


def choose_path(m: int, n: int, world: int, itemsize: int, *, programs: int, slot_bytes: int) -> str:
    """``"local"`` for a group of one, ``"fallback"`` (NCCL) where a fused transport's slots would
    exceed ``FUSED_MAX_BYTES`` or the output is empty, else the transport of least estimated time
    (``estimates``; ties go to the one-shot). ``programs``: the GPU's SMs; ``slot_bytes``: one slot of
    the call (the output, and the residual sum with a norm)."""
    if world == 1:
        return "local"
    if m == 0 or n == 0 or 2 * slot_bytes > FUSED_MAX_BYTES:
        return "fallback"
    times = estimates(m, n, world, itemsize, programs)
    return min(("oneshot", "twoshot", "fallback"), key=lambda path: times[path])


def fused_path(m: int, n: int, world: int, itemsize: int, *, programs: int) -> str:
    """The fused transport of least estimated time (``policy="fused"``: never NCCL)."""
    times = estimates(m, n, world, itemsize, programs)
    return min(("oneshot", "twoshot"), key=lambda path: times[path])
