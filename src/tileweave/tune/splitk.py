"""The decode-shaped GEMM's configuration and the rule that routes a shape to it.

A GEMM of a few rows reads its weight once: its time is ``K * N * itemsize`` bytes over the memory's
bandwidth, and the question is only whether enough loads are in flight. The split-K kernel
(``tileweave.kernels.splitk``) puts ``tiles x splits`` programs on the weight, each streaming a span of
K for ``BN`` columns. ``choose_splitk_config`` sizes the spans so that the grid has about
``PROGRAMS_PER_SM`` programs per SM, each of at least ``MIN_STEPS`` K steps (a span shorter than that
pays more in its pipeline's fill and its partial's store than it streams).

Worked example: Llama-3-8B's ``o_proj`` at one token, ``[1, 4096] x [4096, 4096]`` bf16 on 132 SMs:
BM = 16, 4096 / 64 = 64 column tiles; 2 x 132 / 64 = 4.1 spans wanted, K = 4096 has 32 steps of 128,
so 4 spans of 1024 (8 steps each): 256 programs, every SM streaming about 248 KB of the weight.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SPLITK_MAX_ROWS = 64
"""GEMMs of at most this many rows take the split-K kernel (``choose_splitk_config``)."""
PROGRAMS_PER_SM = 2
"""Programs the grid aims for per SM: two small tiles fit an SM at once. On one H100, 2 streamed the
decode shapes' weights faster than 4 or 8 (more spans: more partials and a longer tail) on most shapes."""
MIN_STEPS = 4
"""The fewest K steps a span of a split tile takes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitKConfig:
    """Compile-time shape of one split-K launch (``tileweave.kernels.splitk``)."""

    block_m: int = 16
    """Rows per tile: the smallest ``tl.dot`` takes 16; more rows than that take 32 or 64."""
    block_n: int = 64
    """Columns per tile."""
    block_k: int = 128
    """Depth of one K step (256 bytes of a bf16 weight row: whole 128-byte lines per load)."""
    num_warps: int = 4
    num_stages: int = 4
    """Pipeline depth: ``num_stages - 1`` K steps of loads in flight ahead of the dot."""
    splits: int = 0
    """Spans of K per tile; 0: chosen from the grid (module docstring)."""
    programs_per_sm: int = PROGRAMS_PER_SM
    """With ``splits`` 0: programs the grid aims for per SM."""
    tma: bool = False
    """Read both operands through tensor descriptors where their layout allows (else by pointers)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"SplitKConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SplitKConfig: bad num_stages={self.num_stages} or num_warps={self.num_warps}")
        if self.splits < 0 or self.programs_per_sm < 1:
            raise ValueError(f"SplitKConfig: splits must be >= 0 and programs_per_sm >= 1, got {self.splits} "
                             f"and {self.programs_per_sm}")

    def key(self) -> str:
        return (f"sk{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"
                f"_x{self.splits or 'auto'}_p{self.programs_per_sm}{'_tma' if self.tma else ''}")

    def grid(self, m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int]:
        """``(tiles, splits, k_split)``: the ``BM x BN`` tiles of ``[m, n]``, the spans of K per tile and
        the elements of K per span (a multiple of ``block_k``)."""
        tiles = math.ceil(m / self.block_m) * math.ceil(n / self.block_n)
        steps = max(1, math.ceil(k / self.block_k))
        splits = self.splits or round(self.programs_per_sm * num_sms / tiles)
        splits = max(1, min(splits, steps // MIN_STEPS if self.splits == 0 else steps))
        k_split = math.ceil(steps / splits) * self.block_k
        return tiles, math.ceil(k / k_split) if k else 1, k_split


INTERPRETER_SPLITK = SplitKConfig(block_m=16, block_n=32, block_k=32, num_stages=1, splits=0, programs_per_sm=4)
"""Small tiles for Triton's interpreter on the CPU (with its 4 nominal SMs: spans of 4 steps of 32)."""


def choose_splitk_config(m: int, n: int, k: int, dtype: torch.dtype, *, num_sms: int,
                         interpreter: bool = False) -> SplitKConfig | None:
    """The split-K config of an ``[m, k] x [k, n]`` GEMM in ``dtype``, or None where the tile kernel's
    route is the one to take: more than ``SPLITK_MAX_ROWS`` rows, float8 inputs, or no K to split."""
    if m > SPLITK_MAX_ROWS or m == 0 or k == 0 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if interpreter:
        return INTERPRETER_SPLITK
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = 64 if dtype == torch.float32 else 128
    return SplitKConfig(block_m=block_m, block_n=64, block_k=block_k, num_warps=4, num_stages=4)


SPLITK_PAYS_ROWS = 8
"""Rows up to which the split-K route can beat cuBLAS (``splitk_pays``)."""
SPLITK_PAYS_ELEMS = 1 << 28
"""Weight elements (``K x N``) from which it does: on one H100 the split-K route read Llama-3-70B's
``gate_up`` weight at TP = 1 (470 M elements) 1.03-1.05x faster than cuBLAS at M <= 8, and tied or lost
on every smaller weight (a language-model head, 525 M, is above the line too)."""


def splitk_pays(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a 16-bit ``[m, k] x [k, n]`` GEMM runs faster on the split-K route than on cuBLAS, the path
    the decode-step GEMMs otherwise take (``tileweave.ops.all_reduce.local.partial``): a few rows and a
    weight large enough that its read, not the launch and the pipeline's fill, sets the time."""
    return (dtype in (torch.bfloat16, torch.float16) and 0 < m <= SPLITK_PAYS_ROWS
            and n * k >= SPLITK_PAYS_ELEMS and choose_splitk_config(m, n, k, dtype, num_sms=1) is not None)
